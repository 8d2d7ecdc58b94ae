"""ChatKVBoost.with_structured_output: constrained decoding makes even a random-weight model's replies parse
into the schema, on every prompt."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llguidance")

from langchain_kvboost import ChatKVBoost  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402


class Person(BaseModel):
    name: Literal["alice", "bob", "chen"]
    age: int = Field(ge=0, le=120)
    pilot: bool


@pytest.fixture(scope="module")
def chat():
    return ChatKVBoost(engine=KVEngine(*tiny_model_and_tokenizer()), max_tokens=48)


def test_json_schema_parses_over_20_prompts(chat):
    structured = chat.with_structured_output(Person)
    prompts = [f"Describe person number {i} who lives in city {i * 7 % 13}." for i in range(20)]
    people = structured.batch(prompts[:10]) + [structured.invoke(p) for p in prompts[10:]]
    assert len(people) == 20 and all(isinstance(p, Person) for p in people)


def test_json_mode_include_raw_and_sampling(chat):
    out = chat.with_structured_output(Person, method="json_mode", include_raw=True).invoke(
        "Any person, please.", temperature=0.9, seed=3)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person)
    assert Person(**json.loads(out["raw"].content)) == out["parsed"]
    # no schema: any JSON object; a random model's keys may outrun the budget, but it is an object so far
    raw = chat.with_structured_output(None, method="json_mode", include_raw=True).invoke("JSON?")["raw"]
    assert raw.content.startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    assert set(chat.with_structured_output(schema).invoke("ok?")) == {"ok"}


def test_structured_stream_and_async(chat):
    structured = chat.with_structured_output(Person)
    assert isinstance(list(structured.stream("who?"))[-1], Person)
    assert isinstance(asyncio.run(structured.ainvoke("who?")), Person)


def test_bad_method_and_missing_schema(chat):
    with pytest.raises(ValueError, match="method"):
        chat.with_structured_output(Person, method="xml")
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)


def test_structured_call_reuses_warmed_documents(chat):
    from kvboost_rag.tiny import synthetic_facts

    docs = synthetic_facts(4)
    chat.warm_documents(docs, show_progress=False)
    out = chat.with_structured_output(Person, include_raw=True).invoke(
        "Documents:\n\n" + "\n\n".join(docs[1:3]) + "\n\nWho is described first?")
    assert isinstance(out["parsed"], Person)
    info = out["raw"].response_metadata["kvboost"]
    assert info["documents"] == 2 and info["reuse_ratio"] > 0 and info["doc_tokens_reused"] > 0

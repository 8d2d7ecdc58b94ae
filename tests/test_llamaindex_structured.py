"""KVBoostLLM.structured_predict: the JSON schema is enforced by constrained decoding, so even a random-weight
model's replies parse into the class, and the call runs through the engine (warmed documents reused)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llguidance")

from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

DOC = "Alice Brandt is a pilot who lives in the town of Portvale and repairs gliders on weekends."


class Person(BaseModel):
    name: Literal["alice", "bob", "chen"]
    age: int = Field(ge=0, le=120)
    pilot: bool


@pytest.fixture(scope="module")
def llm():
    return KVBoostLLM(engine=KVEngine(*tiny_model_and_tokenizer()), max_new_tokens=48)


def test_structured_predict_parses_over_20_prompts(llm):
    tmpl = PromptTemplate("Describe person number {i} who lives in city {city}.")
    people = [llm.structured_predict(Person, tmpl, i=i, city=i * 7 % 13) for i in range(20)]
    assert all(isinstance(p, Person) for p in people)


def test_async_and_reuse_of_warmed_documents(llm):
    llm.warm_documents([DOC], show_progress=False)
    tmpl = PromptTemplate("Context: {doc}\n\nWho is described?")
    out = asyncio.run(llm.astructured_predict(Person, tmpl, doc=DOC))
    assert isinstance(out, Person)
    assert llm.last_stats["reused_exact"] + llm.last_stats["reused_approx"] > 0


def test_bad_output_class_and_budget(llm):
    tmpl = PromptTemplate("Who?")
    with pytest.raises(TypeError, match="output_cls"):
        llm.structured_predict(dict, tmpl)
    with pytest.raises(ValueError, match="max_new_tokens=3"):
        llm.structured_predict(Person, tmpl, llm_kwargs={"max_new_tokens": 3})

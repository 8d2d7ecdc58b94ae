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


# ---------------------------------------------------------------------------------------------------- streaming
def test_stream_structured_predict_is_constrained_and_yields_partials(llm):
    tmpl = PromptTemplate("Describe person number {i} who lives in city {city}.")
    real, processors = llm.rag.stream, []

    def stream(prompt, **kw):
        processors.append(kw.get("logits_processor"))
        return real(prompt, **kw)

    object.__setattr__(llm.rag, "stream", stream)
    partial_seen = 0
    for i in range(6):
        out = list(llm.stream_structured_predict(Person, tmpl, i=i, city=i * 7 % 13))
        assert isinstance(out[-1], Person)  # the last one complete and valid
        Person.model_validate(out[-1].model_dump())
        assert processors[-1] is not None  # through the grammar, not llama-index's free path
        partial_seen += sum(not isinstance(o, Person) for o in out)
        assert len(out) >= 2 and all(set(o.model_dump()) <= set(Person.model_fields) for o in out)
    assert partial_seen > 0  # flexible copies with the fields parsed so far, as llama-index streams them
    object.__setattr__(llm.rag, "stream", real)


def test_astream_structured_predict_runs_off_the_loop(llm):
    tmpl = PromptTemplate("Who is person {i}?")

    async def collect():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        out = [o async for o in await llm.astream_structured_predict(Person, tmpl, i=3)]
        ticker.cancel()
        return out, ticks

    out, ticks = asyncio.run(collect())
    assert isinstance(out[-1], Person) and len(out) >= 2
    assert ticks > len(out)  # the loop kept running while the model generated


def test_stream_structured_predict_errors(llm):
    tmpl = PromptTemplate("Who?")
    with pytest.raises(TypeError, match="output_cls"):
        list(llm.stream_structured_predict(dict, tmpl))
    with pytest.raises(ValueError, match="max_new_tokens=3"):
        list(llm.stream_structured_predict(Person, tmpl, llm_kwargs={"max_new_tokens": 3}))

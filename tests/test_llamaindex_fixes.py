"""LlamaIndex KVBoostLLM as a user migrating from HuggingFaceLLM hits it: empty streams, field aliases and
HuggingFacePipeline-style arguments, unknown per-call keywords, and async methods that keep the loop free."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

PROMPT = "Alice lives in Portvale and works as a chemist. Where does Alice live?"


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model_and_tokenizer()


@pytest.fixture
def llm(model_and_tok):
    return KVBoostLLM(engine=KVEngine(*model_and_tok), max_new_tokens=6)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_and_tok):
    path = tmp_path_factory.mktemp("tiny-li")
    model, tok = model_and_tok
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _first_char_stop(llm: KVBoostLLM) -> list[str]:
    """A stop string the first generated token hits, so the generation is empty."""
    text = llm.complete(PROMPT).text
    assert text, "the tiny model produced nothing to stop on"
    return [text[:1]]


def test_empty_stream_yields_one_empty_response(llm):
    stop = _first_char_stop(llm)
    assert llm.complete(PROMPT, stop=stop).text == ""
    pieces = list(llm.stream_complete(PROMPT, stop=stop))  # raised ValidationError (response=None) before
    assert [(p.text, p.delta) for p in pieces] == [("", "")]
    chat = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=PROMPT)], stop=["<"] + stop))
    assert len(chat) >= 1 and chat[-1].message.content is not None

    async def run():
        gen = await llm.astream_complete(PROMPT, stop=stop)
        return [r.text async for r in gen]

    assert asyncio.run(run()) == [""]


def test_aliases_and_pipeline_kwargs(model_and_tok, tiny_dir):
    engine = KVEngine(*model_and_tok)
    assert KVBoostLLM(engine=engine, max_tokens=3).max_new_tokens == 3
    llm = KVBoostLLM.from_model_id(str(tiny_dir), max_tokens=4, chunk_size=32)
    assert llm.max_new_tokens == 4 and llm.engine.config.chunk_size == 32
    llm = KVBoostLLM.from_model_id(str(tiny_dir), task="text-generation",
                                   pipeline_kwargs={"max_new_tokens": 5, "do_sample": True, "top_p": 0.9})
    assert (llm.max_new_tokens, llm.temperature, llm.top_p) == (5, 1.0, 0.9)
    with pytest.raises(ValueError, match="top_k"):
        KVBoostLLM.from_model_id(str(tiny_dir), pipeline_kwargs={"top_k": 5})
    with pytest.raises(ValueError, match="text-generation"):
        KVBoostLLM.from_model_id(str(tiny_dir), task="summarization")
    with pytest.raises(TypeError, match="two spellings"):
        KVBoostLLM(engine=engine, max_tokens=3, max_new_tokens=4)
    assert len(KVBoostLLM(engine=engine).complete(PROMPT, max_tokens=2).raw["token_ids"]) <= 2


def test_unknown_per_call_keyword_is_a_type_error_naming_it(llm):
    with pytest.raises(TypeError, match="top_k"):
        llm.complete(PROMPT, top_k=5)
    with pytest.raises(TypeError, match="top_k"):
        llm.stream_complete(PROMPT, top_k=5)
    with pytest.raises(TypeError, match="top_k"):
        llm.chat([ChatMessage(role=MessageRole.USER, content="hi")], top_k=5)
    assert isinstance(llm.complete(PROMPT, formatted=True).text, str)  # formatted= is LlamaIndex's own


@pytest.mark.parametrize("method", ["acomplete", "achat", "astream_complete"])
def test_async_methods_keep_the_event_loop_ticking(llm, method):
    """The generation waits (in its worker thread) for a coroutine on the loop to run; if the call blocked
    the loop, that coroutine could never run and the wait would time out."""
    ticked = threading.Event()
    seen: dict[str, bool] = {}
    real_generate, real_stream = llm.rag.generate, llm.rag.stream

    def slow_generate(*a, **kw):
        seen["ticked_during_call"] = ticked.wait(timeout=10)
        return real_generate(*a, **kw)

    def slow_stream(*a, **kw):
        seen["ticked_during_call"] = ticked.wait(timeout=10)
        yield from real_stream(*a, **kw)

    llm.rag.generate, llm.rag.stream = slow_generate, slow_stream

    async def ticker():
        await asyncio.sleep(0)
        ticked.set()

    async def run():
        tick = asyncio.ensure_future(ticker())
        if method == "acomplete":
            out = (await llm.acomplete(PROMPT)).text
        elif method == "achat":
            out = (await llm.achat([ChatMessage(role=MessageRole.USER, content=PROMPT)])).message.content
        else:
            out = "".join([r.delta async for r in await llm.astream_complete(PROMPT)])
        await tick
        return out

    try:
        assert isinstance(asyncio.run(run()), str)
    finally:
        llm.rag.generate, llm.rag.stream = real_generate, real_stream
    assert seen["ticked_during_call"] is True

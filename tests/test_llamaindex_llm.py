"""KVBoostLLM as a LlamaIndex LLM: construction, metadata, completion/chat/stream/async, zero drift vs
HuggingFaceLLM."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

pytest.importorskip("llama_index.core")

from conftest import CORPUS, make_tiny_model  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402

N_NEW = 8
DOCS = CORPUS[1:3] + CORPUS[4:5]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", max_positions=2048)


@pytest.fixture
def engine(model, tokenizer):
    return KVEngine(model, tokenizer)


@pytest.fixture
def llm(engine):
    return KVBoostLLM(engine=engine, max_new_tokens=N_NEW)


def _rag_prompt(docs: list[str], question: str) -> str:
    context = "\n\n".join(docs)
    return (f"Context information is below.\n---------------------\n{context}\n---------------------\n"
            f"Given the context information and not prior knowledge, answer the query.\nQuery: {question}\nAnswer: ")


def test_import_from_outside_repo():
    """The PEP 420 namespace merges with the installed llama_index: both import from any directory."""
    code = ("import llama_index.core; from llama_index.llms.kvboost import KVBoostLLM, KVWarmer, "
            "StableOrderPostprocessor; print(KVBoostLLM.class_name())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "KVBoostLLM"


def test_metadata_fields_and_handles(llm, engine):
    md = llm.metadata
    assert md.context_window == 2048  # the model's real max_position_embeddings
    assert md.num_output == N_NEW
    assert md.model_name == llm.model_name and md.model_name
    assert md.is_chat_model is False
    assert KVBoostLLM.class_name() == "KVBoostLLM"
    assert llm.engine is engine
    assert llm.rag.engine is engine
    for name in ("max_new_tokens", "temperature", "top_p", "repair", "recompute_ratio", "context_window", "stop"):
        assert KVBoostLLM.model_fields[name].description, name
    d = llm.to_dict()
    assert d["class_name"] == "KVBoostLLM" and d["max_new_tokens"] == N_NEW
    assert KVBoostLLM(engine=engine, context_window=512).metadata.context_window == 512


def test_constructor_and_call_errors(engine, llm):
    with pytest.raises(TypeError, match="engine="):
        KVBoostLLM()
    with pytest.raises(TypeError, match="KVEngine"):
        KVBoostLLM(engine="not an engine")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        KVBoostLLM(engine=engine, context_window=4096)
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.complete("hello", bogus=1)
    with pytest.raises(ValueError):  # pydantic field validation
        KVBoostLLM(engine=engine, max_new_tokens=0)


def test_complete_stream_and_stats(llm):
    llm.warm_documents(DOCS)
    prompt = _rag_prompt(DOCS, "Where was Alice born?")
    resp = llm.complete(prompt)
    assert isinstance(resp.text, str)
    assert resp.raw["finish_reason"] in ("eos", "length", "stop")
    stats = llm.last_stats
    assert stats["doc_tokens"] > 0 and stats["doc_tokens_reused"] > 0
    assert "ttft_s" in stats
    pieces = list(llm.stream_complete(prompt))
    streamed = "".join(p.delta for p in pieces)
    assert streamed == resp.text
    if pieces:
        assert pieces[-1].text == resp.text
    # per-call overrides are accepted
    short = llm.complete(prompt, max_new_tokens=2)
    assert len(short.raw["token_ids"]) <= 2


def test_chat_goes_through_chat_template(llm, tokenizer):
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Use the documents."),
                ChatMessage(role=MessageRole.USER, content=DOCS[0] + "\nWhere was Alice born?")]
    rendered = tokenizer.apply_chat_template([{"role": m.role.value, "content": m.content} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    assert "<|user|>" in rendered and rendered.endswith("<|assistant|>\n")
    expected = llm.complete(rendered, formatted=True).text
    got = llm.chat(messages)
    assert got.message.role == MessageRole.ASSISTANT
    assert got.message.content == expected
    streamed = "".join(r.delta or "" for r in llm.stream_chat(messages))
    assert streamed == expected


def test_async_defaults(llm):
    prompt = _rag_prompt(DOCS[:2], "Who repairs bicycles?")
    sync = llm.complete(prompt).text

    async def run():
        a = await llm.acomplete(prompt)
        gen = await llm.astream_complete(prompt)
        s = "".join([r.delta async for r in gen])
        c = await llm.achat([ChatMessage(role=MessageRole.USER, content="hi")])
        return a.text, s, c.message.content

    a, s, c = asyncio.run(run())
    assert a == sync and s == sync
    assert isinstance(c, str)


@pytest.mark.parametrize("warm_repeat", [False, True])
def test_zero_drift_vs_huggingface_llm(model, tokenizer, warm_repeat):
    """repair="full" answers equal HuggingFaceLLM's greedy answers for the same model and prompt.

    HuggingFaceLLM is configured plain: no system prompt, identity completion_to_prompt, query wrapper
    "{query_str}", complete(formatted=False) → tokenizer(prompt) *with* special tokens (BOS here), greedy
    generate, decode with skip_special_tokens. KVBoostLLM does the same: add_special_tokens=True by default.
    """
    hf_mod = pytest.importorskip("llama_index.llms.huggingface")
    hf = hf_mod.HuggingFaceLLM(model=model, tokenizer=tokenizer, max_new_tokens=N_NEW, context_window=2048,
                               generate_kwargs={"do_sample": False}, tokenizer_outputs_to_remove=["token_type_ids"])
    engine = KVEngine(model, tokenizer)
    llm = KVBoostLLM(engine=engine, max_new_tokens=N_NEW, repair="full")
    llm.warm_documents(DOCS)
    questions = ["Where was Alice born?", "What is the capital of Norland?"]
    for q in questions:
        docs = list(reversed(DOCS)) if q.startswith("What") else DOCS
        prompt = _rag_prompt(docs, q)
        ours = llm.complete(prompt).text
        assert llm.last_stats["doc_tokens"] > 0  # the documents were found in the prompt
        if warm_repeat:  # a second identical call: an exact prefix hit
            ours = llm.complete(prompt).text
            assert llm.last_stats["reused_exact"] > 0
        assert ours == hf.complete(prompt).text

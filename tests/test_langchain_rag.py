"""LangChain end to end: a stock retrieval chain over warmed documents, chat history reuse, streaming
callbacks, async that does not block the loop, and the warming helpers."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
import torch

pytest.importorskip("langchain_classic")

from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_kvboost import (  # noqa: E402
    ChatKVBoost,
    KVBoostLLM,
    KVHashEmbeddings,
    KVWarmTransformer,
    add_documents_warmed,
)

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer  # noqa: E402

DOCS = [Document(page_content=t, metadata={"i": i}) for i, t in enumerate(synthetic_facts(20))]
N_NEW = 8
PROMPT = PromptTemplate.from_template(
    "System: Use the following pieces of retrieved context to answer the question. If you do not know the "
    "answer, say that you do not know.\n\n{context}\n\nQuestion: {input}\nAnswer:")
PLAN = {"Where does Dana live?": [3, 7, 12], "Who is a pilot?": [12, 3, 5]}  # overlapping, reordered


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model_and_tokenizer(layers=2)


class FixedRetriever(BaseRetriever):
    """Returns a chosen list of documents per question, in the chosen order."""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun
                                ) -> list[Document]:
        return [DOCS[i] for i in PLAN[query]]


class PromptCapture(BaseCallbackHandler):
    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.tokens: list[str] = []

    def on_llm_start(self, serialized, prompts, **kwargs) -> None:
        self.prompts.extend(prompts)

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def _llm(**config) -> KVBoostLLM:
    model, tok = _model()
    llm = KVBoostLLM(engine=KVEngine(model, tok, **config), max_tokens=N_NEW)
    llm.warm_documents(DOCS, progress=False)
    return llm


def _chain(llm: KVBoostLLM):
    return create_retrieval_chain(FixedRetriever(), create_stuff_documents_chain(llm, PROMPT))


def _hf_greedy(prompt: str) -> str:
    model, tok = _model()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_retrieval_chain_reuses_documents_and_matches_full_prefill() -> None:
    """repair="full": documents are found and served from the cache, then recomputed, so the answer must
    equal a plain HF full prefill of the very prompt the chain built."""
    llm = _llm(repair="full")
    chain, capture = _chain(llm), PromptCapture()
    chain.invoke({"input": "Where does Dana live?"}, config={"callbacks": [capture]})
    out = chain.invoke({"input": "Who is a pilot?"}, config={"callbacks": [capture]})
    s = llm.last_stats
    assert s["documents"] == 3
    assert s["doc_tokens_reused"] / s["doc_tokens"] >= 0.9
    assert llm.rag.last_result.prompt_token_ids == _model()[1](capture.prompts[-1]).input_ids
    assert out["answer"] == _hf_greedy(capture.prompts[-1])


def test_retrieval_chain_cacheblend_keeps_most_document_kv() -> None:
    """Default CacheBlend: >= 90% of document tokens served from the cache and >= 80% used as is. (On a
    random-weight model the greedy answer may differ from full prefill, so it is not asserted here.)"""
    llm = _llm()
    chain = _chain(llm)
    chain.invoke({"input": "Where does Dana live?"})
    chain.invoke({"input": "Who is a pilot?"})
    s = llm.last_stats
    assert s["doc_tokens_reused"] / s["doc_tokens"] >= 0.9
    assert s["doc_tokens_kept"] / s["doc_tokens"] >= 0.8


def test_chat_history_is_reused_across_four_turns() -> None:
    model, tok = _model()
    chat = ChatKVBoost(engine=KVEngine(model, tok), max_tokens=6)
    messages = [SystemMessage("You answer questions about the town records.")]
    prev_prompt_tokens = 0
    for turn in range(4):
        messages.append(HumanMessage(f"Question {turn + 1}: where does {['Alice', 'Bruno', 'Chen', 'Dana'][turn]} "
                                     "live, and what is their job?"))
        reply = chat.invoke(messages)
        assert reply.usage_metadata["input_tokens"] == chat.last_stats["prompt_tokens"]
        messages.append(AIMessage(reply.content))
        s = chat.last_stats
        if turn == 3:
            assert s["reused_exact"] >= 0.9 * prev_prompt_tokens  # all earlier turns came from the cache
            assert s["computed"] <= s["prompt_tokens"] - prev_prompt_tokens + 16  # ~ reply + new message
        prev_prompt_tokens = s["prompt_tokens"]


def test_llm_stream_fires_callbacks() -> None:
    llm = _llm(repair="full")
    capture = PromptCapture()
    prompt = PROMPT.format(context=DOCS[1].page_content, input="Who?")
    streamed = "".join(llm.stream(prompt, config={"callbacks": [capture]}))
    assert streamed == llm.invoke(prompt) and "".join(capture.tokens) == streamed
    assert llm.get_num_tokens(prompt) == len(_model()[1](prompt).input_ids)


async def test_async_does_not_block_the_event_loop() -> None:
    llm = _llm()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    text = await llm.ainvoke(PROMPT.format(context=DOCS[2].page_content, input="Who?"), max_tokens=24)
    pieces = [p async for p in llm.astream("Fact 1: Alice", max_tokens=8)]
    elapsed = time.perf_counter() - t0
    task.cancel()
    assert isinstance(text, str) and pieces
    assert ticks >= max(3, int(elapsed / 0.005 * 0.2))  # the loop kept running while the model worked


def test_warm_transformer_and_vectorstore_helper() -> None:
    from langchain_community.vectorstores import FAISS

    model, tok = _model()
    llm = KVBoostLLM(engine=KVEngine(model, tok), max_tokens=2)
    transformer = KVWarmTransformer(llm)
    assert transformer.transform_documents(DOCS[:4]) == DOCS[:4]
    assert transformer.last_report.warmed == 4 and len(llm.rag.registry) == 4
    store = FAISS.from_documents(DOCS[:1], KVHashEmbeddings())
    ids = add_documents_warmed(store, DOCS[4:8], llm)
    assert len(ids) == 4 and len(llm.rag.registry) == 8
    assert store.similarity_search("Where does Emeka live?", k=1)[0].page_content in \
        [d.page_content for d in DOCS]


def test_constructor_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="from_model_id"):
        KVBoostLLM()
    with pytest.raises(TypeError, match="KVEngine"):
        ChatKVBoost(engine="gpt2")

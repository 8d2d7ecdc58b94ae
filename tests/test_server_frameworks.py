"""Stock framework clients against `kvboost-rag serve`: langchain-openai's ChatOpenAI in a stock retrieval chain
(cached_tokens equal to ChatKVBoost's cache_read in process for the same messages: exact reuse only, see
kvboost_core.CacheCounts and tests/test_cached_tokens.py) and llama-index's OpenAILike in a query engine."""

from __future__ import annotations

import pytest
from _server_fixture import demo_workload, running_server

httpx = pytest.importorskip("httpx")

QUESTIONS = ["What is the country of Dethik?", "What is the river of Seshel?", "What is the city of Voulim?"]
HUMAN = "Documents:\n\n{context}\n\nQuestion: {input}\nAnswer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv")) as srv:
        corpus, _ = demo_workload(0)
        assert httpx.post(srv.v1 + "/documents", json={"documents": corpus}, timeout=120).status_code == 200
        yield srv


def _reused(srv) -> float:
    """Prompt tokens served from the cache so far, exact (cached) or approximate."""
    lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
    names = ("kvboost_cached_prompt_tokens_total ", "kvboost_approximate_prompt_tokens_total ")
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(names))


def test_langchain_chat_openai_retrieval_chain(server):
    pytest.importorskip("langchain_openai")
    pytest.importorskip("langchain_classic")
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_kvboost import ChatKVBoost, KVHashEmbeddings
    from langchain_openai import ChatOpenAI

    class Usage(BaseCallbackHandler):
        def __init__(self) -> None:
            self.calls: list[tuple[list, dict]] = []
            self.pending: list = []

        def on_chat_model_start(self, serialized, messages, **kw) -> None:
            self.pending.append(messages[0])

        def on_llm_end(self, response, **kw) -> None:
            msg = response.generations[0][0].message
            self.calls.append((self.pending.pop(0), msg.usage_metadata))

    corpus, _ = demo_workload(0)
    store = FAISS.from_documents([Document(page_content=t) for t in corpus], KVHashEmbeddings())
    llm = ChatOpenAI(model="demo", base_url=server.v1, api_key="unused", temperature=0, max_tokens=8,
                     max_retries=0, timeout=60)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the documents."), ("human", HUMAN)])
    chain = create_retrieval_chain(store.as_retriever(search_kwargs={"k": 3}),
                                   create_stuff_documents_chain(llm, prompt))
    usage = Usage()
    answers = [chain.invoke({"input": q}, config={"callbacks": [usage]}) for q in QUESTIONS]
    assert all(isinstance(a["answer"], str) and len(a["context"]) == 3 for a in answers)
    assert len(usage.calls) == len(QUESTIONS)

    # In process, ChatKVBoost over the same model with the same documents warmed finds the same documents in
    # the same messages: the server's prompt_tokens and cached tokens are exactly its figures. Cached is exact
    # reuse only; the documents, re-placed under CacheBlend, are approximate and counted apart.
    from kvboost_rag.app.loading import load_engine

    local = ChatKVBoost(engine=load_engine("demo").engine, max_tokens=1, temperature=0)
    local.warm_documents(corpus, progress=False)
    for messages, meta in usage.calls:
        local_meta = local.invoke(messages).usage_metadata
        stats = local.last_stats
        assert meta["input_tokens"] == stats["prompt_tokens"] == local_meta["input_tokens"]
        assert meta["input_token_details"]["cache_read"] == stats["reused_exact"] + stats.get("reused_block", 0)
        assert meta["input_token_details"]["cache_read"] == local_meta["input_token_details"]["cache_read"]
        assert stats["reused_approx"] > 0  # the documents' KV was reused, approximately: not in cache_read


def test_llamaindex_openai_like_query_engine(server):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import Document
    from llama_index.llms.kvboost import KVHashEmbedding
    from llama_index.llms.openai_like import OpenAILike

    corpus, _ = demo_workload(0)
    llm = OpenAILike(model="demo", api_base=server.v1, api_key="unused", is_chat_model=True, context_window=2048,
                     max_tokens=8, temperature=0.0, max_retries=0, timeout=60)
    embed = KVHashEmbedding()
    index = VectorStoreIndex.from_documents([Document(text=t) for t in corpus[:40]], embed_model=embed)
    engine = index.as_query_engine(llm=llm, similarity_top_k=3, response_mode="compact")
    before = _reused(server)
    response = engine.query("What is the country of Dethik?")
    assert isinstance(response.response, str) and len(response.source_nodes) == 3
    assert _reused(server) > before  # the retrieved documents' KV was reused by the server

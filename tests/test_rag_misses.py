"""No silent misses: retrieved documents that were never warmed are counted, logged once per interval, and
with auto_warm=True warmed after the call so the next query reuses them (LangChain and LlamaIndex)."""

from __future__ import annotations

import logging

import pytest

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.misses import RECENT, MissWarning
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

FACTS = synthetic_facts(12)


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model_and_tokenizer()


@pytest.fixture(autouse=True)
def _fresh_recent():
    RECENT.clear()
    yield
    RECENT.clear()


def _misses(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "were not warmed" in r.getMessage()]


def test_explicit_documents_not_warmed_are_counted_and_logged_once(model_and_tok, caplog):
    rag = KVBoostRAG(KVEngine(*model_and_tok))
    rag.warm_documents(FACTS[:1], show_progress=False)
    with caplog.at_level(logging.WARNING, logger="kvboost"):
        rag.generate("Who?", kv_documents=FACTS[:3], max_new_tokens=1)
        assert rag.last_stats["documents_not_warmed"] == 2
        rag.generate("Who else?", kv_documents=FACTS[3:5], max_new_tokens=1)  # within the interval
    assert len(_misses(caplog)) == 1 and "2 of 3 retrieved documents" in _misses(caplog)[0]


def test_miss_warning_is_rate_limited_and_counts_suppressed():
    w = MissWarning(interval_s=3600)
    assert w.report(2, 3, auto_warm=False) is True
    assert w.report(1, 3, auto_warm=False) is False
    assert w.report(0, 3, auto_warm=False) is False  # nothing missed: nothing to say
    w.interval_s = 0
    assert w.report(1, 1, auto_warm=True) is True


def test_langchain_retrieval_chain_reports_and_auto_warms(model_and_tok, caplog):
    pytest.importorskip("langchain_classic")
    pytest.importorskip("faiss")
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import PromptTemplate
    from langchain_kvboost import KVBoostLLM, KVHashEmbeddings

    docs = [Document(page_content=t) for t in FACTS]
    store = FAISS.from_documents(docs, KVHashEmbeddings())
    prompt = PromptTemplate.from_template("Documents:\n\n{context}\n\nQuestion: {input}\nAnswer:")
    for auto in (False, True):
        llm = KVBoostLLM(engine=KVEngine(*model_and_tok), max_tokens=2, auto_warm=auto)
        chain = create_retrieval_chain(store.as_retriever(search_kwargs={"k": 3}),
                                       create_stuff_documents_chain(llm, prompt))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvboost"):
            chain.invoke({"input": "Where does Dana live?"})
        assert llm.last_stats["documents_not_warmed"] == 3, auto
        assert len(_misses(caplog)) == 1
        chain.invoke({"input": "Where does Dana live?"})
        if auto:
            assert llm.last_stats["documents_not_warmed"] == 0
            assert llm.last_stats["documents"] == 3 and llm.last_stats["doc_tokens_reused"] > 0
        else:
            assert llm.last_stats["documents_not_warmed"] == 3


def test_llamaindex_sentence_splitter_after_warming_documents(model_and_tok, caplog):
    """The reported case: documents warmed, then an index that splits them into nodes. The nodes' texts are
    not the warmed texts, so nothing is reused: that is said out loud, and auto_warm fixes it."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.schema import Document
    from llama_index.llms.kvboost import KVBoostLLM, KVHashEmbedding

    documents = [Document(text=" ".join(FACTS[i:i + 4])) for i in range(0, 12, 4)]
    embed = KVHashEmbedding()
    nodes = SentenceSplitter(chunk_size=48, chunk_overlap=0).get_nodes_from_documents(documents)
    assert len(nodes) > len(documents)
    index = VectorStoreIndex(nodes, embed_model=embed)
    for auto in (False, True):
        llm = KVBoostLLM(engine=KVEngine(*model_and_tok), max_new_tokens=2, auto_warm=auto)
        llm.warm_documents(documents, show_progress=False)
        engine = index.as_query_engine(llm=llm, similarity_top_k=2, response_mode="compact")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvboost"):
            engine.query("Where does Dana live?")
        first = dict(llm.last_stats)
        assert first["documents_not_warmed"] == 2 and first["doc_tokens_reused"] == 0, auto
        assert len(_misses(caplog)) == 1
        engine.query("Where does Dana live?")
        second = llm.last_stats
        if auto:
            assert second["documents_not_warmed"] == 0 and second["documents"] == 2
            assert second["doc_tokens_reused"] > 0
        else:
            assert second["documents_not_warmed"] == 2

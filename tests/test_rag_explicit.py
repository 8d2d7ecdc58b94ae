"""Warming, the registry, explicit mode (kv_documents=[...]) and document rendering."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG, doc_key, document_text
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

DOCS = synthetic_facts(20)


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model_and_tokenizer(layers=2)


def _rag(**kw) -> KVBoostRAG:
    model, tok = _model()
    return KVBoostRAG(KVEngine(model, tok), **kw)


def test_warming_is_idempotent_and_registers() -> None:
    rag = _rag()
    first = rag.warm_documents(DOCS + DOCS[:2], batch_size=6, progress=False)
    assert (first.documents, first.warmed, first.already_warm) == (22, 20, 0)
    assert first.tokens > 0 and first.bytes > 0
    again = rag.warm_documents(DOCS, progress=False)
    assert (again.warmed, again.already_warm, again.tokens, again.bytes) == (0, 20, 0, 0)
    assert len(rag.registry) == 20
    doc = rag.registry.get(doc_key(DOCS[0]))
    assert doc is not None and list(doc.token_ids) == rag.encode(DOCS[0], add_special_tokens=False)
    with pytest.raises(ValueError, match="batch_size"):
        rag.warm_documents(DOCS, batch_size=0)


def test_document_text_renders_like_the_frameworks() -> None:
    from langchain_core.documents import Document
    from llama_index.core.schema import TextNode

    assert document_text("plain") == "plain"
    assert document_text(Document(page_content="lc text", metadata={"a": 1})) == "lc text"
    node = TextNode(text="node text", metadata={"source": "s.txt"})
    assert document_text(node) == "source: s.txt\n\nnode text"
    with pytest.raises(TypeError, match="pass a str"):
        document_text(42)


def test_explicit_mode_stable_order_is_an_exact_hit() -> None:
    rag = _rag()
    rag.warm_documents(DOCS, progress=False)
    a = rag.generate("Question: who?\nAnswer:", kv_documents=[DOCS[3], DOCS[1], DOCS[8]], max_new_tokens=2)
    assert rag.last_stats["mode"] == "explicit" and rag.last_stats["documents"] == 3
    sa = dict(rag.last_stats)
    b = rag.generate("Question: who?\nAnswer:", kv_documents=[DOCS[8], DOCS[3], DOCS[1]], max_new_tokens=2)
    assert a.prompt_token_ids == b.prompt_token_ids  # sorted by key: same prompt whatever the order
    s = rag.last_stats
    # the same prompt gets the same answer from the same reuse: the first call's repaired KV is not served
    assert b.token_ids == a.token_ids and s["reused_repaired"] == 0
    keys = ("doc_tokens", "doc_tokens_reused", "doc_tokens_kept", "doc_tokens_recomputed")
    assert {k: s[k] for k in keys} == {k: sa[k] for k in keys} and 0 < s["doc_tokens_kept"] < s["doc_tokens"]


def test_explicit_mode_preserve_order_and_unwarmed_docs() -> None:
    rag = _rag(preserve_order=True)
    rag.warm_documents(DOCS[:5], progress=False)
    a = rag.generate("Q?", kv_documents=[DOCS[1], DOCS[2]], max_new_tokens=1)
    b = rag.generate("Q?", kv_documents=[DOCS[2], DOCS[1]], max_new_tokens=1)
    assert a.prompt_token_ids != b.prompt_token_ids
    c = rag.generate("Q?", kv_documents=["An unwarmed note about nothing in particular."], max_new_tokens=1)
    assert c.prompt_token_ids[0] == _model()[1].bos_token_id and rag.last_stats["documents"] == 1


def test_adapter_contract_helpers() -> None:
    rag = _rag()
    tok = _model()[1]
    assert rag.token_ids("Alice lives") == tok("Alice lives").input_ids
    assert rag.count_tokens("Alice lives") == len(tok("Alice lives").input_ids)
    assert rag.context_window == 2048
    assert rag.chat_prompt([{"role": "user", "content": "Hi"}]).endswith("<|assistant|>\n")
    with pytest.raises(TypeError, match="KVEngine"):
        KVBoostRAG(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chat_prompt"):
        rag.generate(["not", "a", "str"])  # type: ignore[arg-type]


def test_importing_kvboost_rag_does_not_import_frameworks() -> None:
    code = ("import sys, kvboost_rag, kvboost_rag.retrieval, kvboost_rag.tiny; "
            "bad = [m for m in sys.modules if m.startswith(('langchain', 'llama_index'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_faiss_helper_and_hashing_embedding() -> None:
    from kvboost_rag.retrieval import FaissIndex, HashingEmbedding

    emb = HashingEmbedding(512)
    assert (emb(["a b"]) == emb(["a b"])).all()
    index = FaissIndex(emb)
    index.add(DOCS)
    hits = index.search("Where does Dana work?", k=3)
    assert len(hits) == 3 and "Dana" in hits[0].document

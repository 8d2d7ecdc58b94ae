"""Every warm entry point: a progress bar by default on a terminal, none when not a TTY; show_progress=
forces it either way and the old progress= still works."""

from __future__ import annotations

import io

import pytest

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer
from kvboost_rag.warming import resolve_progress

DOCS = synthetic_facts(3)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def engine_parts():
    return tiny_model_and_tokenizer()


def _entry_points(parts):
    """(name, warm(docs, **progress_kw)) for each public way to warm."""
    out = []
    rag = KVBoostRAG(KVEngine(*parts))
    out.append(("KVBoostRAG.warm_documents", lambda d, **kw: rag.warm_documents(d, **kw)))
    try:
        from langchain_core.documents import Document
        from langchain_core.vectorstores import InMemoryVectorStore
        from langchain_kvboost import KVBoostLLM, KVHashEmbeddings, KVWarmTransformer, add_documents_warmed

        lc = KVBoostLLM(engine=KVEngine(*parts))
        store = InMemoryVectorStore(KVHashEmbeddings())
        out.append(("langchain llm.warm_documents", lambda d, **kw: lc.warm_documents(d, **kw)))
        out.append(("add_documents_warmed", lambda d, **kw: add_documents_warmed(
            store, [Document(page_content=t) for t in d], lc, **kw)))
        out.append(("KVWarmTransformer", lambda d, **kw: KVWarmTransformer(lc, **kw).transform_documents(
            [Document(page_content=t) for t in d])))
    except ImportError:
        pass
    try:
        from llama_index.core.schema import TextNode
        from llama_index.llms.kvboost import KVBoostLLM as LIKVBoostLLM
        from llama_index.llms.kvboost import KVWarmer

        li = LIKVBoostLLM(engine=KVEngine(*parts))
        out.append(("llamaindex llm.warm_documents", lambda d, **kw: li.warm_documents(d, **kw)))
        out.append(("KVWarmer", lambda d, **kw: KVWarmer(li, **kw)([TextNode(text=t) for t in d])))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("tty", [True, False])
def test_default_bar_follows_the_terminal(engine_parts, monkeypatch, tty):
    for name, warm in _entry_points(engine_parts):
        err = FakeTTY() if tty else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        warm([f"{name}: {t}" for t in DOCS])
        monkeypatch.undo()
        assert ("kvboost warm" in err.getvalue()) == tty, name


def test_show_progress_overrides_and_progress_alias(engine_parts, monkeypatch):
    for name, warm in _entry_points(engine_parts):
        for kw, shown in (({"show_progress": True}, True), ({"progress": True}, True),
                          ({"show_progress": False}, False)):
            err = FakeTTY() if not shown else io.StringIO()  # the override beats what the TTY says
            monkeypatch.setattr("sys.stderr", err)
            warm([f"{name} {kw}: {t}" for t in DOCS], **kw)
            monkeypatch.undo()
            assert ("kvboost warm" in err.getvalue()) == shown, (name, kw)


def test_resolve_progress():
    assert resolve_progress(None) is None
    assert resolve_progress(None, False) is False
    assert resolve_progress(True, True) is True
    with pytest.raises(TypeError, match="disagree"):
        resolve_progress(True, False)

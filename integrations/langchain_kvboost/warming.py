"""Warming documents as part of LangChain indexing pipelines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.vectorstores import VectorStore

from kvboost_rag.aio import run_blocking
from kvboost_rag.warming import resolve_progress

if TYPE_CHECKING:
    from kvboost_rag import WarmReport


def _warmer(target: Any) -> Any:
    """Anything with ``warm_documents``: KVBoostLLM, ChatKVBoost or a KVBoostRAG."""
    if hasattr(target, "warm_documents"):  # duck-typed: importing KVBoostRAG here would load torch
        return target
    raise TypeError(f"expected a KVBoostLLM, ChatKVBoost or KVBoostRAG to warm with, got {type(target).__name__}")


class KVWarmTransformer(BaseDocumentTransformer):
    """Warms documents passing through (e.g. after a text splitter) and returns them unchanged."""

    def __init__(self, llm: Any, *, batch_size: int = 8, show_progress: bool | None = None,
                 progress: bool | None = None) -> None:
        self.llm = _warmer(llm)
        self.batch_size = batch_size
        self.show_progress = resolve_progress(show_progress, progress)
        self.last_report: WarmReport | None = None

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        self.last_report = self.llm.warm_documents(list(documents), batch_size=self.batch_size,
                                                   show_progress=self.show_progress)
        return documents

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        return await run_blocking(self.transform_documents, documents, **kwargs)


def add_documents_warmed(vectorstore: VectorStore, docs: Sequence[Document], llm: Any, *, batch_size: int = 8,
                         show_progress: bool | None = None, progress: bool | None = None,
                         **kwargs: Any) -> list[str]:
    """``vectorstore.add_documents(docs)`` after warming the same documents in ``llm``; returns the ids.
    ``show_progress`` (alias ``progress``): None shows a bar on a terminal only."""
    _warmer(llm).warm_documents(list(docs), batch_size=batch_size,
                                show_progress=resolve_progress(show_progress, progress))
    return vectorstore.add_documents(list(docs), **kwargs)

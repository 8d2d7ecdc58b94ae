"""kvboost_rag: document warming and KV reuse for RAG chains on top of kvboost_core.

Importing this package never imports LangChain or LlamaIndex; their integrations live in
``langchain_kvboost`` and ``llama_index.llms.kvboost``, which build on this library, and no module of it
imports them. The CLI, demos, benches and server are the application layer :mod:`kvboost_rag.app`, above
both. It does not import torch either until a name that needs the engine is used (``KVBoostRAG`` ...): the
CLI's ``--help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvboost_core.lazy import lazy_exports

# name -> module that defines it; resolved on first attribute access (PEP 562)
_EXPORTS = {
    "KVBoostRAG": "kvboost_rag.rag", "PromptPlan": "kvboost_rag.rag", "doc_stats": "kvboost_rag.rag",
    "document_text": "kvboost_rag.documents", "document_texts": "kvboost_rag.documents",
    "DocumentRegistry": "kvboost_rag.registry", "RegisteredDoc": "kvboost_rag.registry",
    "doc_key": "kvboost_rag.registry", "WarmReport": "kvboost_rag.warming", "RAGOptions": "kvboost_rag.options",
}

if TYPE_CHECKING:
    from kvboost_rag.documents import document_text, document_texts
    from kvboost_rag.options import RAGOptions
    from kvboost_rag.rag import KVBoostRAG, PromptPlan, doc_stats
    from kvboost_rag.registry import DocumentRegistry, RegisteredDoc, doc_key
    from kvboost_rag.warming import WarmReport


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = ["DocumentRegistry", "KVBoostRAG", "PromptPlan", "RAGOptions", "RegisteredDoc", "WarmReport", "doc_key",
           "doc_stats", "document_text", "document_texts"]

"""kvboost_rag: document warming and KV reuse for RAG chains on top of kvboost_core.

Importing this package never imports LangChain or LlamaIndex; their integrations live in
``langchain_kvboost`` and ``llama_index.llms.kvboost``.
"""

from kvboost_rag.adapter import KVBoostRAG, PromptPlan, doc_stats
from kvboost_rag.documents import document_text, document_texts
from kvboost_rag.registry import DocumentRegistry, RegisteredDoc, doc_key
from kvboost_rag.warming import WarmReport

__all__ = ["DocumentRegistry", "KVBoostRAG", "PromptPlan", "RegisteredDoc", "WarmReport", "doc_key", "doc_stats",
           "document_text", "document_texts"]

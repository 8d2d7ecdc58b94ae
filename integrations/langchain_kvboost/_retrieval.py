"""Seeing what LangChain retrievers return, so prompts holding unwarmed documents are reported.

The LLM only gets a flat prompt; the retriever's documents are visible to callbacks. One handler is added to
every LangChain run (``register_configure_hook`` with a context variable that defaults to it), the way
LangChain's own tracers attach themselves; it only records ``page_content`` of retrieved documents, which is
how ``create_stuff_documents_chain`` renders them. Retrievers that bypass callbacks stay invisible.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from kvboost_rag.misses import note_retrieved


class RetrievalWatcher(BaseCallbackHandler):
    """Records retrieved documents' texts in :mod:`kvboost_rag.misses` (nothing else)."""

    run_inline = True  # a few dict inserts: not worth a thread hop in async runs
    raise_error = False
    ignore_llm = ignore_chain = ignore_agent = ignore_chat_model = ignore_custom_event = True

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        note_retrieved(d.page_content for d in documents if isinstance(getattr(d, "page_content", None), str))


_WATCHER = RetrievalWatcher()
_VAR: ContextVar[BaseCallbackHandler | None] = ContextVar("kvboost_retrieval_watcher", default=_WATCHER)
_registered = False
_lock = threading.Lock()


def watch_retrievals() -> None:
    """Attach the watcher to every LangChain run from now on (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        from langchain_core.tracers.context import register_configure_hook

        register_configure_hook(_VAR, inheritable=True)
        _registered = True

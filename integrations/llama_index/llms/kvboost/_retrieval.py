"""Seeing what LlamaIndex retrievers return, so prompts holding unwarmed nodes are reported.

A query engine hands the LLM a flat prompt; the retrieved nodes are visible on the instrumentation bus as a
``RetrievalEndEvent``. One handler on the root dispatcher records each node's ``MetadataMode.LLM`` rendering
(what the response synthesizers put in prompts). Retrievers that do not emit the event stay invisible.
"""

from __future__ import annotations

import threading
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvboost_rag.misses import note_retrieved


def render_node(node: BaseNode | NodeWithScore) -> str:
    """The text a response synthesizer puts in the prompt for ``node`` (``get_content(MetadataMode.LLM)``)."""
    if isinstance(node, NodeWithScore):
        node = node.node
    return node.get_content(metadata_mode=MetadataMode.LLM)


class RetrievalWatcher(BaseEventHandler):
    @classmethod
    def class_name(cls) -> str:
        return "KVBoostRetrievalWatcher"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = []
            for n in event.nodes:
                try:
                    texts.append(render_node(n))
                except Exception:  # noqa: BLE001 - a node we cannot render is simply not tracked
                    continue
            note_retrieved(texts)


_lock = threading.Lock()
_registered = False


def watch_retrievals() -> None:
    """Add the watcher to the root dispatcher once."""
    global _registered
    with _lock:
        if not _registered:
            get_dispatcher().add_event_handler(RetrievalWatcher())
            _registered = True

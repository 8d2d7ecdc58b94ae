"""LlamaIndex ingestion and retrieval helpers around :class:`KVBoostLLM`.

- :class:`KVWarmer` — the last transform of an ``IngestionPipeline``: warms every node's LLM rendering.
- :class:`StableOrderPostprocessor` — sorts retrieved nodes by the registry key of their rendering, so the same
  document set always yields the same prompt (exact prefix hits).
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, TransformComponent
from llama_index.llms.kvboost.base import _as_rag, registry_key, render_node

from kvboost_rag.options import RAGOptions

if TYPE_CHECKING:
    from llama_index.llms.kvboost.base import KVBoostLLM

    from kvboost_core import KVEngine
    from kvboost_rag.rag import KVBoostRAG


class _StoreTokens:
    """An identity token per KV store instance, renewed when the store may have lost warmed entries.

    ``IngestionPipeline`` caches a transform's output under a hash of the nodes and ``transform.to_dict()``;
    :class:`KVWarmer` puts this token in its ``to_dict()`` so a cached result is only reused for the very store
    it warmed, and only while that store has not evicted or dropped entries since.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._by_id: dict[int, tuple[Any, dict[str, Any]]] = {}  # stores that refuse weak references

    def _state(self, store: Any) -> dict[str, Any]:
        try:
            st = self._weak.get(store)
            if st is None:
                st = self._weak[store] = {"token": uuid.uuid4().hex, "entries": 0, "evictions": 0}
            return st
        except TypeError:
            ref, st = self._by_id.get(id(store), (None, None))
            if ref is not store or st is None:
                st = {"token": uuid.uuid4().hex, "entries": 0, "evictions": 0}
                self._by_id[id(store)] = (store, st)
            return st

    @staticmethod
    def _counts(store: Any) -> tuple[int, int]:
        try:
            s = store.stats()
        except Exception:  # a store without stats: never trust the cache
            return -1, -1
        return int(s.get("entries", 0) or 0), int(s.get("evictions", 0) or 0)

    def token(self, store: Any) -> str:
        with self._lock:
            st = self._state(store)
            entries, evictions = self._counts(store)
            if entries < 0 or entries < st["entries"] or evictions > st["evictions"]:
                st["token"] = uuid.uuid4().hex  # entries were lost (evicted, cleared): warm again
            st["entries"], st["evictions"] = max(entries, 0), max(evictions, 0)
            return st["token"]

    def warmed(self, store: Any) -> None:
        with self._lock:
            st = self._state(store)
            entries, evictions = self._counts(store)
            if evictions > st["evictions"]:  # the warm itself evicted: the next run must warm again
                st["token"] = uuid.uuid4().hex
            st["entries"], st["evictions"] = max(entries, 0), max(evictions, 0)


_STORE_TOKENS = _StoreTokens()


# ---------------------------------------------------------------------------------------------------- ingestion
class KVWarmer(TransformComponent):
    """Last step of an ``IngestionPipeline``: warms each node's KV and returns the nodes unchanged.

    Nodes are rendered with ``MetadataMode.LLM``, exactly as the response synthesizers put them in prompts.
    The pipeline's transform cache cannot skip warming a store that lacks the nodes: the cache key
    (``to_dict()``) carries an identity token of the engine's KV store, renewed when the store loses entries.
    """

    batch_size: int = Field(default=8, gt=0, description="Documents warmed per batch.")
    show_progress: bool | None = Field(default=None, description="Progress bar while warming: None shows one "
                                       "on a terminal only; True/False force it on/off.")

    _rag: Any = PrivateAttr(default=None)
    _last_report: Any = PrivateAttr(default=None)

    def __init__(self, llm: KVBoostLLM | KVBoostRAG | KVEngine, **kwargs: Any) -> None:
        if "progress" in kwargs:  # the older name, as in warm_documents(progress=...)
            from kvboost_rag.warming import resolve_progress

            kwargs["show_progress"] = resolve_progress(kwargs.get("show_progress"), kwargs.pop("progress"))
        super().__init__(**kwargs)
        self._rag = _as_rag(llm, RAGOptions())

    @classmethod
    def class_name(cls) -> str:
        return "KVWarmer"

    @property
    def last_report(self) -> Any:
        """The ``WarmReport`` of the last call (None before the first)."""
        return self._last_report

    def _store(self) -> Any:
        return self._rag.engine.store

    def to_dict(self, **kwargs: Any) -> dict[str, Any]:
        data = super().to_dict(**kwargs)
        data["kv_store_token"] = _STORE_TOKENS.token(self._store())
        data["kv_fingerprint"] = str(self._rag.engine.fingerprint)
        data["kv_namespace"] = self._rag.engine.config.namespace
        return data

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = [render_node(n) for n in nodes]
        texts = [t for t in texts if t.strip()]
        if texts:
            self._last_report = self._rag.warm_documents(texts, batch_size=self.batch_size,
                                                         show_progress=self.show_progress)
            _STORE_TOKENS.warmed(self._store())
        return nodes


# ---------------------------------------------------------------------------------------------------- retrieval
class StableOrderPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes by the registry key of their rendered text (xxh3 of ``get_content(LLM)``).

    The same set of documents then always yields the same prompt, so a repeated document set is an exact
    prefix hit. Put it last in ``node_postprocessors`` (after any reranker/cut-off that depends on scores).
    """

    @classmethod
    def class_name(cls) -> str:
        return "StableOrderPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return sorted(nodes, key=lambda n: registry_key(render_node(n)))


__all__ = ["KVWarmer", "StableOrderPostprocessor"]

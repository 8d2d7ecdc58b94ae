"""What the routes share: the model's name, one KVBoostRAG per namespace (all over one loaded model), the
scheduler, the key ring and the metrics."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvboost_rag.app.server.auth import DEFAULT_NAMESPACE, KeyRing
from kvboost_rag.app.server.metrics import Metrics
from kvboost_rag.app.server.protocol import APIError
from kvboost_rag.app.server.scheduler import Scheduler


@dataclass(slots=True, eq=False)
class ServerState:
    base: Any  # KVBoostRAG of the first namespace; the others share its model and tokenizer
    model_name: str
    scheduler: Scheduler
    keyring: KeyRing
    metrics: Metrics
    request_timeout: float = 300.0
    default_temperature: float = 1.0  # OpenAI's default when a request gives none
    model_aliases: frozenset[str] = frozenset()
    max_documents: int = 256  # per POST /v1/documents (--max-documents)
    max_document_bytes: int = 8 * 2**20  # of document text per POST /v1/documents (--max-document-bytes)
    replica: str | None = None  # this process's name among several (Ray Serve replicas); None when alone
    catalogue: Any = None  # server.catalogue.DocumentCatalogue: documents warmed by the other processes
    created: int = field(default_factory=lambda: int(time.time()))
    _rags: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.model_aliases = frozenset({self.model_name, *self.model_aliases})
        self._rags[self.base.engine.config.namespace] = self.base
        for ns in self.keyring.namespaces:
            self.rag(ns)

    def namespace_of(self, authorization: str | None) -> str:
        ns = self.keyring.namespace(authorization)
        if ns is None:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")
        return ns

    def rag(self, namespace: str) -> Any:
        """The namespace's KVBoostRAG: its own engine (store namespace, registry), the shared model."""
        with self._lock:
            rag = self._rags.get(namespace)
            if rag is None:
                from kvboost_core import KVEngine
                from kvboost_rag import KVBoostRAG

                eng = self.base.engine
                store = namespaced_store(eng.config.store, namespace)
                engine = KVEngine(eng.model, eng.tokenizer, eng.config.with_(namespace=namespace, store=store))
                rag = self._rags[namespace] = KVBoostRAG(engine, self.base.options)
            return rag

    def store_stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            rags = dict(self._rags)
        return {ns: rag.engine.store.stats() for ns, rag in rags.items()}


def namespaced_store(spec: Any, namespace: str) -> Any:
    """A disk tier gets a directory per namespace: keys already differ by namespace, but each disk store's
    byte budget evicts across every file it scans, which must not be another tenant's. Memory tiers are
    per engine anyway; Redis keys are prefixed by namespace."""
    if isinstance(spec, str) and spec.startswith("disk:"):
        path, sep, query = spec[len("disk:"):].partition("?")
        return f"disk:{path.rstrip('/')}/ns-{namespace}{sep}{query}"
    if isinstance(spec, (list, tuple)):
        return [namespaced_store(s, namespace) for s in spec]
    return spec


def default_state(rag: Any, model_name: str, *, keys: dict[str, str] | None = None, max_batch: int = 8,
                  max_queue: int = 64, request_timeout: float = 300.0, step_delay: float = 0.0,
                  aliases: tuple[str, ...] = (), prefill_chunk: int | None = None,
                  deterministic: bool = True, warm_budget: int = 256, max_documents: int = 256,
                  max_document_bytes: int = 8 * 2**20, kv_pool_bytes: int | None = None,
                  page_tokens: int = 16) -> ServerState:
    metrics = Metrics()
    keyring = KeyRing(keys)
    scheduler = Scheduler(rag.engine.driver, max_batch=max_batch, max_queue=max_queue, metrics=metrics,
                          step_delay=step_delay, prefill_chunk=prefill_chunk, deterministic=deterministic,
                          warm_budget=warm_budget, kv_pool_bytes=kv_pool_bytes, page_tokens=page_tokens)
    state = ServerState(rag, model_name, scheduler, keyring, metrics, request_timeout=request_timeout,
                        model_aliases=frozenset(aliases), max_documents=max_documents,
                        max_document_bytes=max_document_bytes)
    scheduler.start()
    return state


__all__ = ["DEFAULT_NAMESPACE", "ServerState", "default_state"]

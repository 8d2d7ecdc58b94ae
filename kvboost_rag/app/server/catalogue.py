"""Which documents were warmed, shared through Redis by every server process of one deployment.

The Redis tier shares document *KV*, but transparent reuse also needs each process's document *registry* (the
texts it looks for inside chat prompts), which is local. So a process that warms documents (``POST
/v1/documents``) also appends their texts here, and before planning a request every process registers the texts
it has not seen yet. Registering a text whose KV is in Redis is a store lookup, not a prefill; one evicted
from Redis since is computed again, as any miss is.

Layout, per namespace and model fingerprint (tenants and models never see each other's documents):
``kvboost-docs:{ns}:{fp}:keys`` (a hash of document keys, so a text is appended once) and
``kvboost-docs:{ns}:{fp}:texts`` (a list in warm order; each process remembers how far it has read). The
texts are stored in Redis in the clear, so the Redis server must be as trusted as the documents are private.
A Redis outage degrades to misses, as the KV tier does: requests are served, without cross-process reuse.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvboost_rag.registry import doc_key

log = logging.getLogger("kvboost_rag.app.server")

PULL_LIMIT = 256  # texts registered per request at most: a new process catches up over a few requests


class DocumentCatalogue:
    def __init__(self, url: str, fingerprint: str, *, client: Any = None, socket_timeout: float = 0.5) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {url!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
        try:
            import redis
        except ImportError as exc:  # an optional extra
            raise ImportError("the document catalogue needs redis-py: pip install kvboost-rag[redis]") from exc
        from kvboost_core.store.redis_tier import split_ttl

        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        url, _ttl = split_ttl(url)  # the KV tier's ttl; catalogue entries are tiny and kept
        self._client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        self._fp = fingerprint
        self._read: dict[str, int] = {}  # namespace -> texts of the list already registered here
        self._lock = threading.Lock()
        self._warned = False

    def _keys(self, namespace: str) -> tuple[str, str]:
        base = f"kvboost-docs:{namespace}:{self._fp}"
        return f"{base}:keys", f"{base}:texts"

    def _failed(self, op: str, err: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("document catalogue in Redis unavailable (%s: %s); documents warmed by other processes "
                        "are misses here until it is back", op, type(err).__name__)

    def publish(self, namespace: str, texts: Sequence[str]) -> int:
        """Append the texts not published yet; returns how many were new (0 when Redis is down)."""
        unique = [t for t in dict.fromkeys(texts) if t]
        if not unique:
            return 0
        keys, texts_key = self._keys(namespace)
        try:
            pipe = self._client.pipeline(transaction=False)
            for t in unique:
                pipe.hsetnx(keys, doc_key(t), 1)
            new = [t for t, added in zip(unique, pipe.execute(), strict=True) if added]
            if new:
                self._client.rpush(texts_key, *(t.encode("utf-8") for t in new))
        except self._errors as err:
            self._failed("publish", err)
            return 0
        return len(new)

    def pull(self, namespace: str, limit: int = PULL_LIMIT) -> list[str]:
        """Texts published since this process last pulled (at most ``limit``)."""
        _keys, texts_key = self._keys(namespace)
        with self._lock:  # concurrent requests: each text is handed out once
            start = self._read.get(namespace, 0)
            try:
                total = int(self._client.llen(texts_key))
                if total < start:  # the list was flushed: start over
                    start = 0
                if total == start:
                    self._read[namespace] = start
                    return []
                raw = self._client.lrange(texts_key, start, min(total, start + limit) - 1)
            except self._errors as err:
                self._failed("pull", err)
                return []
            self._read[namespace] = start + len(raw)
        return [r.decode("utf-8", "replace") if isinstance(r, bytes) else str(r) for r in raw]


def for_store(store: Any, fingerprint: str) -> DocumentCatalogue | None:
    """A catalogue on the Redis server of a ``redis://`` store spec; None for any other spec."""
    if isinstance(store, str) and store.startswith(("redis://", "rediss://")):
        return DocumentCatalogue(store, fingerprint)
    return None


async def publish(state: Any, rag: Any, texts: Sequence[str]) -> None:
    """After ``POST /v1/documents``: tell the other processes (no-op without a catalogue)."""
    cat = state.catalogue
    if cat is not None:
        await asyncio.to_thread(cat.publish, rag.engine.config.namespace, list(texts))


async def sync(state: Any, rag: Any) -> None:
    """Before planning a request: register the documents other processes warmed (no-op without a catalogue).
    The Redis read runs off the event loop and the warm on the engine thread, like ``POST /v1/documents``."""
    cat = state.catalogue
    if cat is None:
        return
    texts = await asyncio.to_thread(cat.pull, rag.engine.config.namespace)
    new = [t for t in texts if not rag.is_warm(t)]
    if new:
        try:
            await asyncio.wrap_future(state.scheduler.call(lambda: rag.warm_documents(new, progress=False)))
        except Exception as exc:  # the request is still served, only without reuse of these documents
            log.warning("registering %d shared documents failed (%s)", len(new), type(exc).__name__)

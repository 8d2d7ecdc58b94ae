"""Which documents were warmed, shared through Redis by every server process of one deployment.

The Redis tier shares document *KV*, but transparent reuse also needs each process's document *registry* (the
texts it looks for inside chat prompts), which is local. So a process that warms documents (``POST
/v1/documents``) also appends their texts here, and before planning a request every process registers the texts
it has not seen yet. Registering a text whose KV is in Redis is a store lookup, not a prefill; one evicted
from Redis since is computed again, as any miss is.

Layout, per namespace and model fingerprint (tenants and models never see each other's documents: every key
names both, the namespace is checked against the engine's safe character set, and a catalogue only ever reads
the keys of the namespace it is asked about): ``kvboost-docs:{ns}:{fp}:keys`` (a hash of the document keys
present, so a text is appended once), ``...:entries`` (a list in warm order of the document key, a newline, the text) and
``...:meta`` (``bytes`` held, ``trimmed``: entries evicted from the list's head so far, which keeps each
process's read position valid across evictions). The texts are stored in Redis in the clear, so the Redis
server must be as trusted as the documents are private.

Bounded: each namespace holds at most ``max_entries`` documents and ``max_bytes`` bytes of entries (defaults
:data:`MAX_ENTRIES` and :data:`MAX_BYTES`; ``kvboost-rag serve --catalogue-max-docs/--catalogue-max-bytes``);
publishing past either evicts the oldest entries first, atomically (one Lua script), and a document larger than
``max_bytes`` alone is not published. An evicted document is only no longer *announced*: processes that
registered it keep it, and one that had not is served without its reuse (a miss), as for any unwarmed text.
A Redis outage degrades to misses, as the KV tier does: requests are served, without cross-process reuse.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvboost_core.config import validate_namespace
from kvboost_rag.registry import doc_key

log = logging.getLogger("kvboost_rag.app.server")

PULL_LIMIT = 256  # texts registered per request at most: a new process catches up over a few requests
MAX_ENTRIES = 10_000  # documents per namespace
MAX_BYTES = 64 * 1024**2  # bytes of entries (key + text, UTF-8) per namespace

# KEYS: keys hash, entries list, meta hash. ARGV: max entries, max bytes, then (doc key, entry) pairs.
_PUBLISH = """
local added = 0
for i = 3, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], 1) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    redis.call('HINCRBY', KEYS[3], 'bytes', #ARGV[i + 1])
    added = added + 1
  end
end
local max_n, max_b = tonumber(ARGV[1]), tonumber(ARGV[2])
while true do
  local n = redis.call('LLEN', KEYS[2])
  local b = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
  if n == 0 or (n <= max_n and b <= max_b) then break end
  local old = redis.call('LPOP', KEYS[2])
  local cut = string.find(old, '\\n', 1, true) or (#old + 1)
  redis.call('HDEL', KEYS[1], string.sub(old, 1, cut - 1))
  redis.call('HINCRBY', KEYS[3], 'bytes', -#old)
  redis.call('HINCRBY', KEYS[3], 'trimmed', 1)
end
return added
"""
# KEYS: entries list, meta hash. ARGV: absolute read position, limit. -> {trimmed, length, entries}
_PULL = """
local trimmed = tonumber(redis.call('HGET', KEYS[2], 'trimmed') or '0')
local idx = math.max(tonumber(ARGV[1]) - trimmed, 0)
local items = redis.call('LRANGE', KEYS[1], idx, idx + tonumber(ARGV[2]) - 1)
return {trimmed, redis.call('LLEN', KEYS[1]), items}
"""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class DocumentCatalogue:
    def __init__(self, url: str, fingerprint: str, *, client: Any = None, socket_timeout: float = 0.5,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        from kvboost_core.store.redis_tier import mask_url, scrub, split_ttl, url_secrets

        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            shown = mask_url(url) if isinstance(url, str) else repr(url)
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {shown!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
        self.max_entries = _positive_int("max_entries", max_entries)
        self.max_bytes = _positive_int("max_bytes", max_bytes)
        try:
            import redis
        except ImportError as exc:  # an optional extra
            raise ImportError("the document catalogue needs redis-py: pip install kvboost-rag[redis]") from exc

        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        url, _ttl = split_ttl(url)  # the KV tier's ttl; catalogue entries are tiny and kept
        try:
            self._client = client if client is not None else redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        except ValueError as exc:
            raise ValueError(f"bad Redis URL {mask_url(url)}: {scrub(str(exc), url_secrets(url))}") from None
        self._publish = self._client.register_script(_PUBLISH)
        self._pull = self._client.register_script(_PULL)
        self._fp = fingerprint
        self._read: dict[str, int] = {}  # namespace -> absolute position (evicted entries included) read here
        self._lock = threading.Lock()
        self._warned = False

    def _keys(self, namespace: str) -> tuple[str, str, str]:
        base = f"kvboost-docs:{validate_namespace(namespace)}:{self._fp}"
        return f"{base}:keys", f"{base}:entries", f"{base}:meta"

    def _failed(self, op: str, err: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("document catalogue in Redis unavailable (%s: %s); documents warmed by other processes "
                        "are misses here until it is back", op, type(err).__name__)

    def publish(self, namespace: str, texts: Sequence[str]) -> int:
        """Append the texts not published yet, evicting the namespace's oldest past its bounds; returns how many
        were new (0 when Redis is down)."""
        keys = self._keys(namespace)
        args: list[Any] = [self.max_entries, self.max_bytes]
        too_big = 0
        for t in dict.fromkeys(texts):
            if not t:
                continue
            k = doc_key(t)
            entry = f"{k}\n{t}".encode()
            if len(entry) > self.max_bytes:
                too_big += 1
                continue
            args += [k, entry]
        if too_big:
            log.warning("%d documents larger than the catalogue's %d bytes per namespace were not shared with the "
                        "other processes", too_big, self.max_bytes)
        if len(args) == 2:
            return 0
        try:
            return int(self._publish(keys=list(keys), args=args))
        except self._errors as err:
            self._failed("publish", err)
            return 0

    def pull(self, namespace: str, limit: int = PULL_LIMIT) -> list[str]:
        """Texts published since this process last pulled (at most ``limit``; evicted ones are skipped)."""
        _keys, entries, meta = self._keys(namespace)
        with self._lock:  # concurrent requests: each text is handed out once
            start = self._read.get(namespace, 0)
            try:
                trimmed, length, raw = self._pull(keys=[entries, meta], args=[start, limit])
                trimmed, length = int(trimmed), int(length)
                if trimmed + length < start:  # the catalogue was flushed: start over
                    start = 0
                    trimmed, length, raw = self._pull(keys=[entries, meta], args=[0, limit])
                    trimmed, length = int(trimmed), int(length)
            except self._errors as err:
                self._failed("pull", err)
                return []
            self._read[namespace] = max(start, trimmed) + len(raw)
        out = []
        for r in raw:
            text = r.decode("utf-8", "replace") if isinstance(r, bytes) else str(r)
            out.append(text.partition("\n")[2])
        return out

    def stats(self, namespace: str) -> dict[str, int]:
        """Entries and bytes the namespace holds now, and how many were evicted so far."""
        _keys, entries, meta = self._keys(namespace)
        m = self._client.hgetall(meta)
        return {"entries": int(self._client.llen(entries)), "bytes": int(m.get(b"bytes", 0)),
                "evicted": int(m.get(b"trimmed", 0))}


def for_store(store: Any, fingerprint: str, *, max_entries: int = MAX_ENTRIES,
              max_bytes: int = MAX_BYTES) -> DocumentCatalogue | None:
    """A catalogue on the Redis server of a ``redis://`` store spec; None for any other spec."""
    if isinstance(store, str) and store.startswith(("redis://", "rediss://")):
        return DocumentCatalogue(store, fingerprint, max_entries=max_entries, max_bytes=max_bytes)
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

"""Shared tier on Redis: blocks as safetensors bytes (same format as the disk tier), visible to every process.

Keys: ``kvboost:{namespace}:{fingerprint}:{key hex}``; the children of a parent live in a SET at
``kvboost:{namespace}:{fingerprint}:children:{parent hex}``. Both take the optional TTL.

Redis being down or slow must never take the engine down: every request-path operation (get, put, contains,
delete, children) catches connection errors and timeouts (``socket_timeout`` 0.5 s by default), answers a miss /
False, and warns once per outage. After a failure the tier stays "down" for ``retry_after_s`` so that each
request does not pay the timeout. ``clear()`` is the exception: it is an explicit administrative call, so it
always tries the server and raises :class:`RedisClearError` when it could not delete every key (an outage, a
missing permission) instead of returning as if the cache were empty.

Commands the tier needs (grant them to its ACL user, for keys ``kvboost:*``): GET, SET, DEL, EXISTS, STRLEN,
SADD, SREM, SMEMBERS, PEXPIRE, SCAN, EVAL, EVALSHA, SCRIPT LOAD, MULTI, EXEC (:data:`REQUIRED_COMMANDS`; e.g.
``ACL SETUSER kv on >pw ~kvboost:* +get +set +del +exists +strlen +sadd +srem +smembers +pexpire +scan +eval
+evalsha +script|load +multi +exec``). STRLEN, GET and DEL also run inside the tier's Lua scripts, where ACLs
apply too. Construction probes them on a throwaway key and raises PermissionError naming the ones the user may
not run; a server unreachable at construction is probed at no later point, but a permission error during
operation is logged at ERROR with the same list instead of being treated as an outage.

Trust: any client of the server can write any key, so every value goes through
:func:`~kvboost_core.store.serialize.parse_entry` (structure, key, namespace, model, MAC, and the model's KV
shape when the tier has a :class:`~kvboost_core.store.base.KVGeometry`); a value that fails is a miss and is
unlinked, except one that may be another reader's (a MAC this reader cannot check, a value over the entry cap
or a chunk longer than this engine's): a miss, counted as ``skipped``, left in place. Only a deployment secret (``secret=`` / ``KVBOOST_STORE_SECRET``) stops a client that can
write to the server from forging entries another tenant will serve; without one this tier logs a warning.
Namespaces and fingerprints come from a fixed character set and ``clear()`` matches an escaped literal prefix,
so no tenant's name can act as a glob over another's keys.

Credentials: a URL may carry them (``redis://user:secret@host:6379/0``, ``?password=``); every log line,
warning and exception message names the server through :func:`mask_url` (``redis://***@host:6379/0``) and has
the password scrubbed from the client's own error text, so a password never reaches a log.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import warnings
from typing import Any

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock, KVGeometry
from kvboost_core.store.redis_conn import (  # noqa: F401  (mask_url ... split_ttl: re-exported, their old home)
    DEL_IF_EQUAL,
    GET_BOUNDED,
    REQUIRED_COMMANDS,
    glob_escape,
    import_redis,
    mask_url,
    no_permission,
    probe_permissions,
    scrub,
    split_ttl,
    url_secrets,
    wrong_type,
)
from kvboost_core.store.serialize import CorruptEntry, ForeignEntry, dumps, entry_cap, parse_entry
from kvboost_core.store.trust import (
    SECRET_ENV,
    DropLog,
    resolve_secret,
    validate_fingerprint,
    validate_namespace,
)

logger = logging.getLogger("kvboost")
_warned_no_secret = False
_HEX_KEY = re.compile(rb"[0-9a-f]{32}")


class RedisClearError(RuntimeError):
    """``RedisStore.clear()`` could not delete this namespace's keys (the server is unreachable, or the user
    lacks a command): some or all of them remain."""


def _warn_no_secret() -> None:
    global _warned_no_secret
    if not _warned_no_secret:
        _warned_no_secret = True
        logger.warning("kvboost redis tier without a store secret: entries are integrity-checked but not "
                       "authenticated, so any client of the server can forge them; set %s or store_secret=",
                       SECRET_ENV)


class RedisStore:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, namespace: str, fingerprint: str,
                 ttl_s: float | None = None, socket_timeout: float = 0.5, retry_after_s: float = 2.0,
                 client: Any = None, secret: str | bytes | None = None,
                 max_entry_bytes: int = 256 * 1024**2, geometry: KVGeometry | None = None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        validate_namespace(namespace)
        validate_fingerprint(fingerprint)
        self._secret = resolve_secret(secret)
        if self._secret is None:
            _warn_no_secret()
        redis = import_redis()
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._secrets = url_secrets(url)
        try:
            self._client = client if client is not None else redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        except ValueError as exc:  # redis-py's URL parsing: its message must not carry the password either
            raise ValueError(f"bad Redis URL {mask_url(url)}: {scrub(str(exc), self._secrets)}") from None
        self._url = mask_url(url)  # the only form of the URL kept: for messages
        self._namespace = namespace
        self._fingerprint = fingerprint
        self._ttl_ms = int(ttl_s * 1000) if ttl_s is not None else None
        self._prefix = f"kvboost:{namespace}:{fingerprint}:"
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._warned = False
        self._lock = threading.Lock()  # guards the counters and the outage state; redis-py's pool is safe
        self._counters = {"hits": 0, "misses": 0, "errors": 0, "corrupt": 0, "skipped": 0, "puts": 0}
        self._log_drop = DropLog(logger, "redis")
        self._geometry = geometry
        self._max_entry_bytes = min(int(max_entry_bytes), entry_cap(geometry) if geometry else max_entry_bytes)
        self._get_bounded = self._client.register_script(GET_BOUNDED)
        self._denied_logged = False
        self._probe()

    def _probe(self) -> None:
        probe_permissions(self._client, self._prefix, self._get_bounded, self._errors, self._url)

    def _log_denied(self, op: str, err: BaseException) -> None:
        if not self._denied_logged:
            self._denied_logged = True
            logger.error("kvboost redis tier at %s: %s refused by the server's ACL (%s); the tier needs %s",
                         self._url, op, scrub(str(err), self._secrets), ", ".join(REQUIRED_COMMANDS))

    # -- outage handling -----------------------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, err: BaseException) -> None:
        if no_permission(err):
            self._log_denied(op, err)
        with self._lock:
            self._counters["errors"] += 1
            self._down_until = time.monotonic() + self._retry_after_s
            first = not self._warned
            self._warned = True
        if first:
            msg = (f"kvboost redis tier at {self._url} unavailable ({op}: {scrub(repr(err), self._secrets)}); "
                   "serving misses until it is back")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _recovered(self) -> None:
        if self._warned:
            with self._lock:
                was, self._warned = self._warned, False
            if was:
                logger.info("kvboost redis tier at %s is reachable again", self._url)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _k(self, key: CacheKey) -> str:
        return self._prefix + key.hex()

    def _kids(self, parent: CacheKey) -> str:
        return f"{self._prefix}children:{parent.hex()}"

    # -- KVStore -------------------------------------------------------------------------------------------
    def get(self, key: CacheKey) -> KVBlock | None:
        if not self._available():
            self._count("misses")
            return None
        try:
            data = self._get_bounded(keys=[self._k(key)], args=[self._max_entry_bytes])
        except self._errors as e:
            if wrong_type(e):  # another client stored a list/set/... there: bad data, not an outage
                self._drop_key(self._k(key), "not a string value")
            else:
                self._failed("get", e)
            self._count("misses")
            return None
        self._recovered()
        if data is None:
            self._count("misses")
            return None
        if isinstance(data, int):  # the value's length, returned instead of a value over the cap
            # maybe another engine's (longer chunks): not fetched, not deleted
            self._log_drop(self._k(key), f"skipped: {data} bytes is over the {self._max_entry_bytes}-byte entry cap")
            self._count("skipped")
            self._count("misses")
            return None
        try:
            block = parse_entry(data, key=key, namespace=self._namespace, fingerprint=self._fingerprint,
                                secret=self._secret, geometry=self._geometry)
        except ForeignEntry as e:
            self._log_drop(self._k(key), f"skipped, not deleted: {e}")
            self._count("skipped")
            self._count("misses")
            return None
        except CorruptEntry as e:
            self._log_drop(self._k(key), str(e))
            self._count("corrupt")
            self._count("misses")
            self._unlink_if_same(key, data)
            return None
        self._count("hits")
        return block

    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool:
        """Store ``block`` (``pin`` is ignored: Redis memory is managed by the server's maxmemory policy)."""
        if block.namespace != self._namespace:
            raise ValueError(f"block namespace {block.namespace!r} != store namespace {self._namespace!r}")
        if block.fingerprint != self._fingerprint:
            raise ValueError("block fingerprint does not match the Redis store's fingerprint")
        if not self._available():
            return False
        data = dumps(key, block, secret=self._secret)
        for attempt in (0, 1):
            try:
                pipe = self._client.pipeline(transaction=True)
                pipe.set(self._k(key), data, px=self._ttl_ms)
                if block.parent is not None:
                    pipe.sadd(self._kids(block.parent), key.hex())
                    if self._ttl_ms is not None:
                        pipe.pexpire(self._kids(block.parent), self._ttl_ms)
                pipe.execute()
                break
            except self._errors as e:
                if attempt == 0 and block.parent is not None and wrong_type(e):
                    self._drop_key(self._kids(block.parent), "children key is not a SET")
                    continue  # once more, with the bad children key gone
                self._failed("put", e)
                return False
        self._recovered()
        self._count("puts")
        return True

    def contains(self, key: CacheKey) -> bool:
        if not self._available():
            return False
        try:
            found = bool(self._client.exists(self._k(key)))
        except self._errors as e:
            self._failed("contains", e)
            return False
        self._recovered()
        return found

    def delete(self, key: CacheKey) -> bool:
        if not self._available():
            return False
        try:
            # The parent's SET is cleaned lazily by children(): finding the parent would cost a read.
            removed = bool(self._client.delete(self._k(key)))
        except self._errors as e:
            self._failed("delete", e)
            return False
        self._recovered()
        return removed

    def _drop_key(self, rkey: str, reason: str) -> None:
        self._log_drop(rkey, reason)
        self._count("corrupt")
        try:
            self._client.delete(rkey)
        except self._errors as e:
            self._failed("delete", e)

    def _unlink_if_same(self, key: CacheKey, bad: bytes) -> None:
        """Unlink a bad value, unless a writer replaced it since we read it (compare-and-delete in one script,
        so a fresh good entry is never removed)."""
        if not self._available():
            return
        try:
            self._client.eval(DEL_IF_EQUAL, 1, self._k(key), hashlib.sha1(bad).hexdigest())
        except self._errors as e:
            self._failed("delete", e)

    def children(self, parent: CacheKey) -> list[CacheKey]:
        if not self._available():
            return []
        try:
            raw = self._client.smembers(self._kids(parent))
        except self._errors as e:
            if wrong_type(e):
                self._drop_key(self._kids(parent), "children key is not a SET")
            else:
                self._failed("children", e)
            return []
        try:
            junk = [m for m in raw if not isinstance(m, bytes) or _HEX_KEY.fullmatch(m) is None]
            members = sorted(m.decode() for m in raw if isinstance(m, bytes) and _HEX_KEY.fullmatch(m))
            if junk:  # members that are not key hex (written by someone else): never parsed, removed
                self._client.srem(self._kids(parent), *junk)
            if not members:
                return []
            pipe = self._client.pipeline(transaction=False)
            for m in members:
                pipe.exists(self._prefix + m)
            alive = pipe.execute()
            dead = [m for m, a in zip(members, alive, strict=True) if not a]
            if dead:  # expired or deleted children: drop them from the SET
                self._client.srem(self._kids(parent), *dead)
        except self._errors as e:
            self._failed("children", e)
            return []
        self._recovered()
        return [CacheKey(bytes.fromhex(m)) for m, a in zip(members, alive, strict=True) if a]

    def clear(self) -> None:
        """Delete this namespace+fingerprint's keys (never other tenants' or other models'). Tried even while
        the tier is marked down; raises :class:`RedisClearError` when the server could not be cleared (an
        outage, a refused command): a caller that asked to drop the cache must not believe it is empty."""
        try:
            batch: list[bytes] = []
            prefix = self._prefix.encode()
            for k in self._client.scan_iter(match=glob_escape(self._prefix) + "*", count=500):
                raw = k if isinstance(k, bytes) else str(k).encode()
                if not raw.startswith(prefix):  # belt and braces: never delete what is not under our prefix
                    continue
                batch.append(raw)
                if len(batch) >= 500:
                    self._client.delete(*batch)
                    batch.clear()
            if batch:
                self._client.delete(*batch)
        except self._errors as e:
            self._failed("clear", e)
            raise RedisClearError(f"kvboost redis tier at {self._url}: clear() failed "
                                  f"({scrub(repr(e), self._secrets)}); keys under {self._prefix!r} may remain"
                                  ) from None
        self._recovered()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counters, "available": int(self._available())}

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass

"""``EngineConfig.store`` -> a KVStore.

Accepted specs:
  * ``"memory"`` — the in-memory tier alone, ``max_bytes`` budget;
  * ``"disk:/path"`` (optionally ``"disk:/path?max_bytes=20GiB"``; default budget 4x ``max_bytes``);
  * ``"redis://host:port/0"`` / ``"rediss://..."`` (optionally ``?ttl=3600`` seconds);
  * a list of those: a TieredStore in the order memory -> disk -> redis, with a memory tier of
    ``max_bytes`` added first when the list has none (a single disk/redis string is read the same way);
  * an object that already implements KVStore: returned as is.

``secret`` authenticates disk and Redis entries (HMAC-SHA256); None reads ``$KVBOOST_STORE_SECRET``, and
without either entries are integrity-checked only (see :mod:`kvboost_core.store.trust`). ``geometry`` (the
model's KV shape, :class:`~kvboost_core.store.base.KVGeometry`) makes the disk and Redis tiers refuse entries
of another shape and caps what they read per entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl

from kvboost_core.config import parse_bytes, validate_namespace
from kvboost_core.store.base import KVGeometry, KVStore
from kvboost_core.store.memory import MemoryStore
from kvboost_core.store.trust import resolve_secret

_FORMS = ("'memory'", "'disk:/path[?max_bytes=20GiB]'", "'redis://host:port/db[?ttl=seconds]'",
          "a list of those", "an object implementing KVStore")
_METHODS = ("get", "put", "contains", "delete", "children", "stats", "clear")
_ORDER = {"memory": 0, "disk": 1, "redis": 2}


def _bad(spec: Any, why: str = "") -> ValueError:
    extra = f" ({why})" if why else ""
    return ValueError(f"unsupported store spec {spec!r}{extra}; accepted forms: {', '.join(_FORMS)}")


def is_kv_store(obj: Any) -> bool:
    return not isinstance(obj, (str, bytes, list, tuple)) and all(
        callable(getattr(obj, m, None)) for m in _METHODS)


def _kind(spec: str) -> str:
    if spec == "memory":
        return "memory"
    if spec.startswith("disk:"):
        return "disk"
    if spec.startswith(("redis://", "rediss://")):
        return "redis"
    raise _bad(spec)


def _build_one(spec: str, *, max_bytes: int, fingerprint: str, namespace: str, secret: bytes | None,
               geometry: KVGeometry | None) -> KVStore:
    kind = _kind(spec)
    if kind == "memory":
        return MemoryStore(max_bytes, namespace=namespace)
    if kind == "disk":
        from kvboost_core.store.disk import DiskStore

        path, _, query = spec[len("disk:"):].partition("?")
        if not path:
            raise _bad(spec, "disk needs a path")
        opts = dict(parse_qsl(query))
        unknown = set(opts) - {"max_bytes"}
        if unknown:
            raise _bad(spec, f"unknown disk options {sorted(unknown)}")
        budget = parse_bytes(opts["max_bytes"]) if "max_bytes" in opts else 4 * max_bytes
        return DiskStore(path, budget, fingerprint, namespace=namespace, secret=secret, geometry=geometry)
    from kvboost_core.store.redis_tier import RedisStore, split_ttl

    url, ttl = split_ttl(spec)
    return RedisStore(url, namespace=namespace, fingerprint=fingerprint, ttl_s=ttl, secret=secret, geometry=geometry)


def build_store(spec: Any, *, max_bytes: int, fingerprint: str, namespace: str,
                secret: str | bytes | None = None, geometry: KVGeometry | None = None) -> KVStore:
    if is_kv_store(spec):
        return spec  # type: ignore[no-any-return]
    validate_namespace(namespace)
    key = resolve_secret(secret)
    if isinstance(spec, str):
        specs: Sequence[Any] = [spec]
    elif isinstance(spec, (list, tuple)):
        specs = spec
    else:
        raise _bad(spec)
    if not specs:
        raise _bad(spec, "empty list")
    if not all(isinstance(s, str) for s in specs):
        raise _bad(spec, "list items must be strings")
    kinds = [_kind(s) for s in specs]
    if kinds.count("memory") > 1:
        raise _bad(spec, "more than one memory tier")
    if "memory" not in kinds:
        specs, kinds = ["memory", *specs], ["memory", *kinds]
    if len(specs) == 1:
        return _build_one(specs[0], max_bytes=max_bytes, fingerprint=fingerprint, namespace=namespace, secret=key,
                          geometry=geometry)
    ordered = [s for _, s in sorted(zip(kinds, specs, strict=True), key=lambda ks: _ORDER[ks[0]])]
    from kvboost_core.store.tiered import TieredStore

    return TieredStore([_build_one(s, max_bytes=max_bytes, fingerprint=fingerprint, namespace=namespace,
                                   secret=key, geometry=geometry) for s in ordered])

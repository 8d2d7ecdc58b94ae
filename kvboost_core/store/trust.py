"""Who may write an entry a tier will serve: the deployment secret, the entry MAC, and names that are safe.

With a secret (``store_secret=`` / env ``KVBOOST_STORE_SECRET``) every entry carries an HMAC-SHA256 over its
canonical header and its tensor bytes, bound to the key, namespace and model fingerprint the reader expects:
only a writer holding the secret can produce an entry another process will serve. Without a secret the tag is
an unkeyed xxh3-128: it catches corruption (bit flips, truncation, a stale or foreign entry) but **does not
authenticate** — anyone who can write to the directory or the Redis server can forge entries. A reader
with a secret refuses unkeyed entries, and a reader without one refuses keyed entries it cannot check.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections import OrderedDict

import xxhash

from kvboost_core.config import validate_namespace

__all__ = ["SECRET_ENV", "DropLog", "entry_tag", "resolve_secret", "tags_equal", "validate_fingerprint",
           "validate_namespace"]

SECRET_ENV = "KVBOOST_STORE_SECRET"
_DOMAIN = b"kvboost/entry/v2\0"
_FINGERPRINT_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes: the argument when given, else ``$KVBOOST_STORE_SECRET``, else None (no auth)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("secret must be a non-empty str or bytes, or None")
    return secret


def validate_fingerprint(fingerprint: object) -> str:
    """Fingerprints name directories and Redis key parts: the same safe character set as namespaces."""
    if not isinstance(fingerprint, str) or _FINGERPRINT_RE.fullmatch(fingerprint) is None:
        raise ValueError(f"fingerprint must match {_FINGERPRINT_RE.pattern}, got {fingerprint!r}")
    return fingerprint


def _field(h: object, value: bytes | memoryview) -> None:
    # Length-prefixed so that no two different (key, namespace, fingerprint, header) tuples hash the same bytes.
    h.update(memoryview(value).nbytes.to_bytes(8, "little"))  # type: ignore[attr-defined]
    h.update(value)  # type: ignore[attr-defined]


def entry_tag(secret: bytes | None, *, key: bytes, namespace: str, fingerprint: str, header: bytes,
              data: bytes | memoryview) -> str:
    """``hmac-sha256:<hex>`` under ``secret``, else ``xxh3:<hex>`` (integrity only, see the module doc)."""
    h: object = hmac.new(secret, digestmod=hashlib.sha256) if secret is not None else xxhash.xxh3_128()
    h.update(_DOMAIN)  # type: ignore[attr-defined]
    for part in (bytes(key), namespace.encode("utf-8"), fingerprint.encode("utf-8"), header):
        _field(h, part)
    _field(h, data)  # a view: a multi-MB payload is hashed in place, never copied
    scheme = "hmac-sha256" if secret is not None else "xxh3"
    return f"{scheme}:{h.hexdigest()}"  # type: ignore[attr-defined]


def tags_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


class DropLog:
    """Log a dropped entry once per key per ``every_s``: a poisoned key that is looked up on every request
    must not flood the log. Remembers at most ``capacity`` keys (oldest forgotten first)."""

    def __init__(self, logger: logging.Logger, tier: str, every_s: float = 60.0, capacity: int = 4096) -> None:
        self._logger = logger
        self._tier = tier
        self._every_s = every_s
        self._capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, name: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._seen.get(name)
            if last is not None and now - last < self._every_s:
                return
            self._seen[name] = now
            self._seen.move_to_end(name)
            while len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
        self._logger.warning("kvboost %s tier: dropped %s: %s", self._tier, name, reason)

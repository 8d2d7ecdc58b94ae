"""A stack of tiers, fastest first (memory -> disk -> redis), behind the one KVStore interface.

Reads go down the stack and promote a hit into every faster tier (read-through); a promotion that does not
fit is fine — the block is still returned. Writes go to every tier (write-through), so a restart or another
process finds what this one computed.

Concurrency: operations on the same key serialize on one of ``_STRIPES`` locks (so a promotion cannot
resurrect a key a concurrent ``delete`` just removed); different keys proceed in parallel. Each tier is
thread-safe on its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock, KVStore

logger = logging.getLogger("kvboost")

_STRIPES = 64


def tier_name(tier: object) -> str:
    return type(tier).__name__.removesuffix("Store").lower() or "tier"


class TieredStore:
    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self._tiers = list(tiers)
        names = [tier_name(t) for t in self._tiers]
        self._names = [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._lock = threading.Lock()  # counters
        self._hits = [0] * len(self._tiers)
        self._misses = 0

    @property
    def tiers(self) -> list[KVStore]:
        return list(self._tiers)

    def _stripe(self, key: CacheKey) -> threading.RLock:
        return self._stripes[key[0] % _STRIPES if key else 0]

    def get(self, key: CacheKey) -> KVBlock | None:
        with self._stripe(key):
            for i, tier in enumerate(self._tiers):
                block = tier.get(key)
                if block is None:
                    continue
                self._promote(key, block, i)
                with self._lock:
                    self._hits[i] += 1
                return block
        with self._lock:
            self._misses += 1
        return None

    def _promote(self, key: CacheKey, block: KVBlock, found_at: int) -> None:
        for tier in self._tiers[:found_at]:
            try:
                tier.put(key, block)  # False (does not fit) is fine: the caller still gets the block
            except ValueError as e:  # e.g. a tier of another namespace: skip it, never fail the read
                logger.debug("kvboost: promotion into %s skipped: %s", tier_name(tier), e)

    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool:
        """Write-through; ``pin`` applies to the first (memory) tier. True if any tier stored the block."""
        stored = False
        with self._stripe(key):
            for i, tier in enumerate(self._tiers):
                stored = tier.put(key, block, pin=pin and i == 0) or stored
        return stored

    def contains(self, key: CacheKey) -> bool:
        return any(tier.contains(key) for tier in self._tiers)

    def delete(self, key: CacheKey) -> bool:
        with self._stripe(key):
            results = [tier.delete(key) for tier in self._tiers]
        return any(results)

    def children(self, parent: CacheKey) -> list[CacheKey]:
        seen: dict[CacheKey, None] = {}
        for tier in self._tiers:
            for k in tier.children(parent):
                seen.setdefault(k, None)
        return list(seen)

    def stats(self) -> dict[str, int]:
        first = self._tiers[0].stats()
        out: dict[str, int] = {k: v for k, v in first.items()}  # the engine reads the memory budget here
        with self._lock:
            out["hits"] = sum(self._hits)
            out["misses"] = self._misses
            for name, h in zip(self._names, self._hits, strict=True):
                out[f"{name}.served"] = h
        for name, tier in zip(self._names, self._tiers, strict=True):
            for k, v in tier.stats().items():
                out[f"{name}.{k}"] = v
        return out

    def clear(self) -> None:
        for lock in self._stripes:
            lock.acquire()
        try:
            for tier in self._tiers:
                tier.clear()
        finally:
            for lock in reversed(self._stripes):
                lock.release()

    def pin(self, key: CacheKey, pinned: bool = True) -> bool:
        pin = getattr(self._tiers[0], "pin", None)
        return bool(pin(key, pinned)) if pin is not None else False

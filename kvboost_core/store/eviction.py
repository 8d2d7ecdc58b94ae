"""Eviction as a strategy object: the entry with the lowest ``priority`` goes first (SGLang-style)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from kvboost_core.keys import CacheKey


@dataclass(slots=True)
class EntryMeta:
    key: CacheKey
    nbytes: int
    num_tokens: int
    num_layers: int
    pinned: bool = False
    hits: int = 0
    created: float = field(default_factory=time.monotonic)
    last_access: float = field(default_factory=time.monotonic)


class EvictionPolicy(Protocol):
    def priority(self, entry: EntryMeta) -> float: ...


class LRUPolicy:
    """Least recently used first."""

    def priority(self, entry: EntryMeta) -> float:
        return entry.last_access


class ImportancePolicy:
    """Keep what is expensive to recompute, often hit, recently used and small; evict the rest first.

    ``priority = log(1 + hits) + log(tokens * layers) - log(bytes) + ln2 * last_access / half_life``

    * ``tokens * layers`` is the prefill work a hit saves; dividing by bytes makes it value per byte of
      budget, so a quantized block (same savings, fewer bytes) outlives its dense twin.
    * the recency term is ``log(0.5 ** (age / half_life))`` up to a constant shared by every entry: written
      with ``last_access`` instead of ``age`` the order does not depend on when it is computed, so one sort
      is consistent. With all else equal it is exactly LRU.
    * hits enter as a log so one very hot entry cannot pin itself forever: each doubling of hits buys
      ``half_life`` seconds of idleness.
    """

    def __init__(self, half_life_s: float = 60.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._rate = math.log(2.0) / half_life_s

    def priority(self, entry: EntryMeta) -> float:
        work = max(1, entry.num_tokens) * max(1, entry.num_layers)
        return (math.log1p(entry.hits) + math.log(work) - math.log(max(1, entry.nbytes))
                + self._rate * entry.last_access)

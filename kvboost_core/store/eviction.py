"""Eviction as a strategy object: the entry with the lowest ``priority`` goes first (SGLang-style)."""

from __future__ import annotations

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

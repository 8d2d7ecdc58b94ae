"""In-memory tier with a hard byte budget.

The budget is never exceeded: a put that cannot fit after evicting every unpinned entry is refused
(returns False) rather than overshooting. Pinned entries are never evicted, and pinning more than the
budget is refused with a ValueError. Eviction order comes from an :class:`EvictionPolicy`
(default :class:`ImportancePolicy`), kept in a heap with lazy deletion: an entry's record is replaced (not
updated in place) whenever its priority inputs change, so an evicting put costs O(log n), not a sort. This
needs ``priority(entry)`` to depend only on the entry's fields, not on when it is called (both built-in
policies do).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import defaultdict

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock
from kvboost_core.store.eviction import EntryMeta, EvictionPolicy, ImportancePolicy
from kvboost_core.store.trust import validate_namespace


class MemoryStore:
    def __init__(self, max_bytes: int, policy: EvictionPolicy | None = None, *,
                 namespace: str | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = int(max_bytes)
        self._policy = policy or ImportancePolicy()
        # None: any namespace; else blocks of another namespace never hit
        self._namespace = validate_namespace(namespace) if namespace is not None else None
        self._hits = 0
        self._misses = 0
        self._blocks: dict[CacheKey, KVBlock] = {}
        self._meta: dict[CacheKey, EntryMeta] = {}
        self._children: defaultdict[CacheKey, set[CacheKey]] = defaultdict(set)
        self._bytes = 0
        self._pinned_bytes = 0
        self._evictions = 0
        self._heap: list[tuple[float, int, CacheKey]] = []  # (priority, seq, key); pinned entries absent
        self._live: dict[CacheKey, int] = {}  # key -> seq of its one current heap record
        self._seq = 0
        self._lock = threading.RLock()

    # -- reads --------------------------------------------------------------------------------------
    def get(self, key: CacheKey) -> KVBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None or (self._namespace is not None and block.namespace != self._namespace):
                self._misses += 1
                return None
            meta = self._meta[key]
            meta.hits += 1
            meta.last_access = time.monotonic()
            self._push(meta)
            self._hits += 1
            return block

    def contains(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._blocks

    def children(self, parent: CacheKey) -> list[CacheKey]:
        with self._lock:
            return list(self._children.get(parent, ()))

    # -- writes -------------------------------------------------------------------------------------
    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool:
        """Store ``block``; False (a miss, nothing raised) when it cannot fit even after evicting every
        unpinned entry, and then an older entry under ``key`` is dropped too: after a put, ``key`` serves that
        block or nothing, never a superseded one. Pinning past the budget is a caller error (ValueError,
        nothing changed)."""
        if self._namespace is not None and block.namespace != self._namespace:
            raise ValueError(f"block namespace {block.namespace!r} != store namespace {self._namespace!r}")
        size = block.nbytes
        with self._lock:
            old = self._meta.get(key)
            pinned = pin or (old.pinned if old else False)
            pinned_other = self._pinned_bytes - (old.nbytes if old is not None and old.pinned else 0)
            if pinned_other + size > self._max_bytes:
                if pin:  # an explicit request to pin past the budget; an inherited pin is just a miss
                    raise ValueError(
                        f"pinning {size} bytes would put {pinned_other + size} pinned bytes over the "
                        f"{self._max_bytes}-byte budget; raise max_cache_bytes or unpin entries first")
                if old is not None:  # superseded: never serve the value this put replaces
                    self._remove(key)
                return False  # would not fit even after evicting every unpinned entry
            if old is not None:
                self._remove(key)
            if not self._make_room(size):
                raise RuntimeError("memory store could not make room it had checked was available")
            self._blocks[key] = block
            n_layers = int(getattr(block.payload, "num_layers", 1) or 1)
            self._meta[key] = EntryMeta(key=key, nbytes=size, num_tokens=block.num_tokens,
                                        num_layers=n_layers, pinned=pinned)
            self._bytes += size
            self._push(self._meta[key])
            if pinned:
                self._pinned_bytes += size
            if block.parent is not None:
                self._children[block.parent].add(key)
            return True

    def pin(self, key: CacheKey, pinned: bool = True) -> bool:
        with self._lock:
            meta = self._meta.get(key)
            if meta is None:
                return False
            if pinned and not meta.pinned:
                if self._pinned_bytes + meta.nbytes > self._max_bytes:
                    raise ValueError("pinning this entry would exceed the budget; raise max_cache_bytes")
                self._pinned_bytes += meta.nbytes
            elif not pinned and meta.pinned:
                self._pinned_bytes -= meta.nbytes
            meta.pinned = pinned
            self._push(meta)
            return True

    def delete(self, key: CacheKey) -> bool:
        with self._lock:
            if key not in self._blocks:
                return False
            self._remove(key)
            return True

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            if max_bytes < self._pinned_bytes:
                raise ValueError(f"cannot shrink the budget to {max_bytes} bytes below the "
                                 f"{self._pinned_bytes} pinned bytes; unpin entries first")
            self._max_bytes = int(max_bytes)
            self._make_room(0)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._meta.clear()
            self._children.clear()
            self._heap.clear()
            self._live.clear()
            self._bytes = self._pinned_bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._blocks), "bytes": self._bytes, "max_bytes": self._max_bytes,
                    "pinned_bytes": self._pinned_bytes, "evictions": self._evictions,
                    "hits": self._hits, "misses": self._misses,
                    "tokens": sum(m.num_tokens for m in self._meta.values())}

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        return self._bytes

    # -- internals (lock held) ----------------------------------------------------------------------
    def _push(self, meta: EntryMeta) -> None:
        """Supersede ``meta``'s heap record (older records are skipped when popped); pinned: no record."""
        if meta.pinned:
            self._live.pop(meta.key, None)
            return
        self._seq += 1
        self._live[meta.key] = self._seq
        heapq.heappush(self._heap, (self._policy.priority(meta), self._seq, meta.key))
        if len(self._heap) > 2 * len(self._meta) + 1024:  # stale records dominate: rebuild, O(n)
            self._heap = [(self._policy.priority(self._meta[k]), s, k) for k, s in self._live.items()]
            heapq.heapify(self._heap)

    def _remove(self, key: CacheKey) -> None:
        self._live.pop(key, None)
        block = self._blocks.pop(key)
        meta = self._meta.pop(key)
        self._bytes -= meta.nbytes
        if meta.pinned:
            self._pinned_bytes -= meta.nbytes
        if block.parent is not None:
            kids = self._children.get(block.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[block.parent]

    def _make_room(self, size: int) -> bool:
        if self._bytes + size <= self._max_bytes:
            return True
        if self._pinned_bytes + size > self._max_bytes:
            return False  # even evicting every unpinned entry would not make room
        while self._heap and self._bytes + size > self._max_bytes:
            _, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) != seq:
                continue  # superseded, pinned or removed since this record was pushed
            self._remove(key)
            self._evictions += 1
        return self._bytes + size <= self._max_bytes

"""The disk tier's in-memory index of its directory: per entry its file name, size, last access and parent link,
the keys of each shard, the children of each parent, the byte total, and the least-recently-used order.

Pure bookkeeping, no I/O: :class:`~kvboost_core.store.disk.DiskStore` lists and reads the files, and unlinks
what :meth:`DiskIndex.evict` hands back. Not thread-safe on its own: the store calls it under its lock.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from kvboost_core.keys import CacheKey


@dataclass(slots=True)
class DiskEntry:
    name: str
    nbytes: int
    last_access: float  # wall clock: mtime at scan, then time of last get/put
    parent: CacheKey | None
    seq: int = 0  # the eviction heap's live record for this entry (older records are stale)


def shard_of(key: CacheKey) -> str:
    return key.hex()[:2]


class DiskIndex:
    def __init__(self) -> None:
        self.entries: dict[CacheKey, DiskEntry] = {}
        self._shard_keys: defaultdict[str, set[CacheKey]] = defaultdict(set)
        self._children: defaultdict[CacheKey, set[CacheKey]] = defaultdict(set)
        self._heap: list[tuple[float, int, CacheKey]] = []
        self._seq = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: CacheKey) -> DiskEntry | None:
        return self.entries.get(key)

    def shard_keys(self, shard: str) -> set[CacheKey]:
        return self._shard_keys[shard]

    def children(self, parent: CacheKey) -> list[CacheKey]:
        return list(self._children.get(parent, ()))

    def add(self, key: CacheKey, entry: DiskEntry) -> None:
        self.drop(key)
        self._link(key, entry)
        self._push(key, entry)

    def add_unordered(self, key: CacheKey, entry: DiskEntry) -> None:
        """Start-up fast path (240k files) for a key not indexed yet: the heap record is appended unordered;
        call :meth:`heapify` once after the last."""
        self._seq += 1
        entry.seq = self._seq
        self._link(key, entry)
        self._heap.append((entry.last_access, entry.seq, key))

    def heapify(self) -> None:
        heapq.heapify(self._heap)

    def touch(self, key: CacheKey, entry: DiskEntry, now: float) -> None:
        entry.last_access = now
        self._push(key, entry)

    def drop(self, key: CacheKey) -> bool:
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self._shard_keys[shard_of(key)].discard(key)
        self.nbytes -= entry.nbytes
        if entry.parent is not None:
            kids = self._children.get(entry.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[entry.parent]
        return True

    def evict(self, size: int, max_bytes: int, *, replacing: CacheKey | None = None) -> Iterator[DiskEntry]:
        """Drop least recently used entries until ``size`` more bytes fit under ``max_bytes`` (``replacing``'s
        bytes count as freed, and it is never chosen), yielding each for the caller to delete: O(log n) each."""
        prev = self.entries.get(replacing) if replacing is not None else None
        old = prev.nbytes if prev is not None else 0
        spared: list[tuple[float, int, CacheKey]] = []
        while self._heap and self.nbytes - old + size > max_bytes:
            rec = heapq.heappop(self._heap)
            entry = self.entries.get(rec[2])
            if entry is None or entry.seq != rec[1]:
                continue  # stale record
            if rec[2] == replacing:
                spared.append(rec)
                continue
            self.drop(rec[2])
            yield entry
        for rec in spared:
            heapq.heappush(self._heap, rec)

    def clear(self) -> None:
        self.entries.clear()
        self._shard_keys.clear()
        self._children.clear()
        self._heap.clear()
        self.nbytes = 0

    def _link(self, key: CacheKey, entry: DiskEntry) -> None:
        self.entries[key] = entry
        self._shard_keys[shard_of(key)].add(key)
        self.nbytes += entry.nbytes
        if entry.parent is not None:
            self._children[entry.parent].add(key)

    def _push(self, key: CacheKey, entry: DiskEntry) -> None:
        # Lazy deletion: a new record supersedes the old one, which is skipped when popped. Rebuild the heap
        # when stale records outnumber live ones, so it stays O(entries).
        self._seq += 1
        entry.seq = self._seq
        heapq.heappush(self._heap, (entry.last_access, entry.seq, key))
        if len(self._heap) > 2 * len(self.entries) + 1024:
            self._heap = [(e.last_access, e.seq, k) for k, e in self.entries.items()]
            heapq.heapify(self._heap)

"""Disk tier: one safetensors file per entry, under a byte budget, in a directory of its own model and tenant.

Layout: ``root/<fingerprint>/<namespace>/<key hex[:2]>/<key hex>[.<parent key hex>]``. Each (model, namespace)
pair owns one subdirectory: start-up, ``clear()``, eviction and clean-up never look outside it, so tenants and
models can share a root. The 256 shards keep directories small. The parent link is part of the file name so
that the index (sizes, access times, parent links) is rebuilt at start from a directory listing and one
``lstat`` per file, without opening any entry.

Trust: a file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink or a FIFO named like an entry cannot
redirect or block a read), must be a regular file no bigger than ``max_entry_bytes`` whose header declares
exactly its size, and is then checked by :func:`~kvboost_core.store.serialize.parse_entry` (MAC, key,
namespace, model, structure). Anything that fails is a miss, is deleted, and is logged once per key.

Crash safety: a write goes to a temp file in the same shard, is flushed and fsynced, then ``os.replace``d over
the final name and the shard is fsynced, so a reader sees the old entry, the new one, or none. A writer killed
mid-write leaves only a temp file, removed when its shard is next scanned.

Other processes: a key missing from the index triggers a re-listing of its shard when the shard directory
changed since it was last listed, so entries another process wrote are found; the byte budget is this
process's view of the directory.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock
from kvboost_core.store.safe_io import pid_alive, read_entry_file
from kvboost_core.store.serialize import CorruptEntry, dumps, parse_entry
from kvboost_core.store.trust import DropLog, resolve_secret, validate_fingerprint, validate_namespace

logger = logging.getLogger("kvboost")

_ENTRY = re.compile(r"([0-9a-f]{32})(?:\.([0-9a-f]{32}))?")
_SHARD = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.([0-9a-f]{32})\.(\d+)\.[0-9a-f]+\.tmp")
_STALE_TEMP_S = 3600.0  # a temp file this old is abandoned even if its writer's pid was reused
_SETTLE_NS = 50_000_000  # a listing this soon after the shard's mtime may have missed a same-tick change
DEFAULT_MAX_ENTRY_BYTES = 1 << 30


@dataclass(slots=True)
class _DiskEntry:
    name: str
    nbytes: int
    last_access: float  # wall clock: mtime at scan, then time of last get/put
    parent: CacheKey | None
    seq: int = 0  # the eviction heap's live record for this entry (older records are stale)


def _entry_name(key: CacheKey, parent: CacheKey | None) -> str:
    return key.hex() if parent is None else f"{key.hex()}.{parent.hex()}"


class DiskStore:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int, fingerprint: str, *,
                 namespace: str = "default", secret: str | bytes | None = None, fsync: bool = True,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if max_entry_bytes < 8:
            raise ValueError(f"max_entry_bytes must be >= 8, got {max_entry_bytes}")
        self._fingerprint = validate_fingerprint(fingerprint)
        self._namespace = validate_namespace(namespace)
        self._secret = resolve_secret(secret)
        self._root = Path(root)
        self._dir = self._root / self._fingerprint / self._namespace
        self._dir.mkdir(parents=True, exist_ok=True)
        self._max_bytes = int(max_bytes)
        self._max_entry_bytes = int(max_entry_bytes)
        self._fsync = fsync
        self._index: dict[CacheKey, _DiskEntry] = {}
        self._shard_keys: defaultdict[str, set[CacheKey]] = defaultdict(set)
        self._listed: dict[str, tuple[int, int]] = {}  # shard -> (its mtime_ns, wall ns) when last listed
        self._children: defaultdict[CacheKey, set[CacheKey]] = defaultdict(set)
        self._heap: list[tuple[float, int, CacheKey]] = []
        self._seq = 0
        self._bytes = 0
        self._counters = {"hits": 0, "misses": 0, "corrupt": 0, "evictions": 0, "write_errors": 0}
        self._lock = threading.RLock()
        self._log_drop = DropLog(logger, "disk")
        with self._lock:
            for e in os.scandir(self._dir):
                if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                    self._list_shard(e.name, bulk=True)
            heapq.heapify(self._heap)  # once, not one push per file
            self._evict_for(0)  # the budget may have shrunk since the last run

    @property
    def root(self) -> Path:
        return self._root

    @property
    def directory(self) -> Path:
        """This model's and namespace's own subdirectory: the only one this store reads, writes or clears."""
        return self._dir

    # -- listing (lock held) -------------------------------------------------------------------------------
    def _list_shard(self, shard: str, *, bulk: bool = False) -> None:
        """(Re)build the index of one shard from its listing: one lstat per new file, no file opened.
        ``bulk`` (start-up): heap records are appended unordered; the caller heapifies once at the end."""
        sdir = self._dir / shard
        try:
            mtime = os.stat(sdir, follow_symlinks=False).st_mtime_ns
            listing = list(os.scandir(sdir))
        except OSError:
            listing, mtime = [], 0
        self._listed[shard] = (mtime, time.time_ns())
        now, seen = time.time(), set()
        keys = self._shard_keys[shard]
        for e in listing:
            m = _ENTRY.fullmatch(e.name)
            if m is None:
                if _TEMP.fullmatch(e.name):
                    self._clean_temp(e, now)
                continue  # not ours: left alone
            if not e.name.startswith(shard):
                continue
            key = CacheKey(bytes.fromhex(m.group(1)))
            if not bulk:
                seen.add(key)
            known = self._index.get(key)
            if known is not None and known.name == e.name:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not 8 <= st.st_size <= self._max_entry_bytes:
                self._discard(key, Path(e.path), None, "not a regular file of a plausible size")
                continue
            parent = CacheKey(bytes.fromhex(m.group(2))) if m.group(2) else None
            if known is not None or not bulk:
                self._index_add(key, _DiskEntry(e.name, st.st_size, st.st_mtime, parent))
                continue
            # start-up fast path (240k files): the plain bookkeeping of _index_add, inlined
            self._seq += 1
            self._index[key] = _DiskEntry(e.name, st.st_size, st.st_mtime, parent, self._seq)
            keys.add(key)
            self._bytes += st.st_size
            if parent is not None:
                self._children[parent].add(key)
            self._heap.append((st.st_mtime, self._seq, key))
        if not bulk:  # a re-listing: drop what someone else deleted
            for key in keys - seen:
                self._index_drop(key)

    def _clean_temp(self, e: os.DirEntry[str], now: float) -> None:
        m = _TEMP.fullmatch(e.name)
        assert m is not None
        try:
            stale = now - e.stat(follow_symlinks=False).st_mtime > _STALE_TEMP_S
            if stale or not pid_alive(int(m.group(2))):
                os.unlink(e.path)
        except OSError:
            pass  # already gone, or not ours to remove

    def _refresh(self, key: CacheKey) -> _DiskEntry | None:
        """Index entry for ``key``, re-listing its shard first when the shard changed since its last listing."""
        entry = self._index.get(key)
        if entry is not None:
            return entry
        shard = key.hex()[:2]
        try:
            mtime = os.stat(self._dir / shard, follow_symlinks=False).st_mtime_ns
        except OSError:
            return None
        listed = self._listed.get(shard)
        if listed is None or listed[0] != mtime or listed[1] - listed[0] < _SETTLE_NS:
            self._list_shard(shard)
        return self._index.get(key)

    # -- reads ---------------------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        return self._dir / name[:2] / name

    def get(self, key: CacheKey) -> KVBlock | None:
        with self._lock:
            entry = self._refresh(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
            path = self._path(entry.name)
        ino = None
        try:
            data, ino = read_entry_file(path, self._max_entry_bytes)
            block = parse_entry(data, key=key, namespace=self._namespace, fingerprint=self._fingerprint,
                                secret=self._secret)
        except FileNotFoundError:
            with self._lock:
                if self._index.get(key) is entry:
                    self._index_drop(key)
                self._counters["misses"] += 1
            return None
        except CorruptEntry as e:
            self._discard(key, path, ino, str(e))
            return None
        except OSError as e:
            logger.warning("kvboost disk tier: cannot read %s: %s", path, e)
            with self._lock:
                self._counters["misses"] += 1
            return None
        with self._lock:
            if self._index.get(key) is entry:
                self._touch(key, entry)
            self._counters["hits"] += 1
        return block

    def contains(self, key: CacheKey) -> bool:
        with self._lock:
            return self._refresh(key) is not None

    def children(self, parent: CacheKey) -> list[CacheKey]:
        with self._lock:
            return list(self._children.get(parent, ()))

    # -- writes --------------------------------------------------------------------------------------------
    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool:
        """Write-through store; ``pin`` is accepted for the interface and ignored (pinning is a memory-tier
        notion). False when the entry is bigger than the budget or the write failed (logged)."""
        if block.namespace != self._namespace:
            raise ValueError(f"block namespace {block.namespace!r} != store namespace {self._namespace!r}")
        if block.fingerprint != self._fingerprint:
            raise ValueError("block fingerprint does not match the disk store's fingerprint")
        data = dumps(key, block, secret=self._secret)
        if len(data) > min(self._max_bytes, self._max_entry_bytes):
            self.delete(key)  # superseded: never serve the value this put replaces (as MemoryStore)
            return False
        name = _entry_name(key, block.parent)
        path = self._path(name)
        tmp = path.parent / f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_temp(tmp, data)
            with self._lock:
                self._evict_for(len(data), replacing=key)
                os.replace(tmp, path)
                self._fsync_dir(path.parent)
                old = self._index.get(key)
                if old is not None and old.name != name:  # same key, other parent link: one file per key
                    self._unlink(self._path(old.name))
                self._index_add(key, _DiskEntry(name, len(data), time.time(), block.parent))
            return True
        except OSError as e:
            logger.warning("kvboost disk tier: write of %s failed: %s", path, e)
            with self._lock:
                self._counters["write_errors"] += 1
            self._unlink(tmp)
            return False

    def _write_temp(self, tmp: Path, data: bytes) -> None:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())

    def _fsync_dir(self, d: Path) -> None:
        if not self._fsync:
            return
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    def delete(self, key: CacheKey) -> bool:
        with self._lock:
            entry = self._refresh(key)
            if entry is None:
                return False
            self._index_drop(key)
            return self._unlink(self._path(entry.name)) or True

    def clear(self) -> None:
        """Delete this model's and namespace's entries; other tenants' and models' directories are untouched."""
        with self._lock:
            for shard in os.scandir(self._dir):
                if not (_SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                    continue
                for e in os.scandir(shard.path):
                    if _ENTRY.fullmatch(e.name):
                        self._unlink(Path(e.path))
            self._index.clear()
            self._shard_keys.clear()
            self._listed.clear()
            self._children.clear()
            self._heap.clear()
            self._bytes = 0

    def resize(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        with self._lock:
            self._max_bytes = int(max_bytes)
            self._evict_for(0)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._index), "bytes": self._bytes, "max_bytes": self._max_bytes,
                    **self._counters}

    # -- internals (lock held) -----------------------------------------------------------------------------
    def _touch(self, key: CacheKey, entry: _DiskEntry) -> None:
        entry.last_access = time.time()
        self._push(key, entry)

    def _push(self, key: CacheKey, entry: _DiskEntry) -> None:
        # Lazy deletion: a new record supersedes the old one, which is skipped when popped. Rebuild the heap
        # when stale records outnumber live ones, so it stays O(entries).
        self._seq += 1
        entry.seq = self._seq
        heapq.heappush(self._heap, (entry.last_access, entry.seq, key))
        if len(self._heap) > 2 * len(self._index) + 1024:
            self._heap = [(e.last_access, e.seq, k) for k, e in self._index.items()]
            heapq.heapify(self._heap)

    def _index_add(self, key: CacheKey, entry: _DiskEntry) -> None:
        self._index_drop(key)
        self._index[key] = entry
        self._shard_keys[key.hex()[:2]].add(key)
        self._bytes += entry.nbytes
        if entry.parent is not None:
            self._children[entry.parent].add(key)
        self._push(key, entry)

    def _index_drop(self, key: CacheKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._shard_keys[key.hex()[:2]].discard(key)
        self._bytes -= entry.nbytes
        if entry.parent is not None:
            kids = self._children.get(entry.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[entry.parent]
        return True

    def _evict_for(self, size: int, *, replacing: CacheKey | None = None) -> None:
        """Delete least recently used files until ``size`` more bytes fit: O(log n) per eviction."""
        prev = self._index.get(replacing) if replacing is not None else None
        old = prev.nbytes if prev is not None else 0
        spared: list[tuple[float, int, CacheKey]] = []
        while self._heap and self._bytes - old + size > self._max_bytes:
            rec = heapq.heappop(self._heap)
            entry = self._index.get(rec[2])
            if entry is None or entry.seq != rec[1]:
                continue  # stale record
            if rec[2] == replacing:
                spared.append(rec)
                continue
            self._index_drop(rec[2])
            self._counters["evictions"] += 1
            self._unlink(self._path(entry.name))
        for rec in spared:
            heapq.heappush(self._heap, rec)

    @staticmethod
    def _same_file(path: Path, ino: int) -> bool:
        """Is ``path`` still the file we read? (Not deleted or replaced meanwhile.)"""
        try:
            return os.stat(path, follow_symlinks=False).st_ino == ino
        except OSError:
            return False

    def _discard(self, key: CacheKey, path: Path, ino: int | None, reason: str) -> None:
        """Delete a bad entry — unless it was replaced by a fresh file since we read it (``ino`` differs)."""
        with self._lock:
            self._counters["corrupt"] += 1
            self._counters["misses"] += 1
            entry = self._index.get(key)
            if entry is not None and self._path(entry.name) == path:
                self._index_drop(key)
            if ino is None or self._same_file(path, ino):
                self._unlink(path)
        self._log_drop(f"{self._namespace}/{path.name}", reason)

"""Disk tier: one safetensors file per entry, named by the key's hex, under a byte budget.

Crash safety: a write goes to a temp file in the same directory, is flushed and fsynced, then
``os.replace``d over the final name and the directory is fsynced, so a reader sees either the old entry, the
new one, or none — never half a file. A writer killed mid-write leaves only a temp file, removed at the next
start. Anything that still fails verification (truncated, checksum mismatch, foreign fingerprint) is a miss,
is deleted and is logged; nothing here raises on a bad entry.

The index (sizes, access times, parent links) is rebuilt at start from the files' headers only. Entries
another process writes into the same directory are found on ``get`` (the file is looked up by name) and join
the index then; the byte budget is this process's view of the directory.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock
from kvboost_core.store.serialize import HEADER_LIMIT, CorruptEntry, check_meta, dumps, loads, read_header

logger = logging.getLogger("kvboost")

_ENTRY = re.compile(r"^[0-9a-f]{32}$")
_TEMP = re.compile(r"^\.([0-9a-f]{32})\.(\d+)\.[0-9a-f]+\.tmp$")
_STALE_TEMP_S = 3600.0  # a temp file this old is abandoned even if its writer's pid was reused


@dataclass(slots=True)
class _DiskEntry:
    nbytes: int
    last_access: float  # wall clock: mtime at scan, then time of last get/put
    parent: CacheKey | None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class DiskStore:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int, fingerprint: str | None = None, *,
                 namespace: str | None = None, fsync: bool = True) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._max_bytes = int(max_bytes)
        self._fingerprint = fingerprint
        self._namespace = namespace
        self._fsync = fsync
        self._index: dict[CacheKey, _DiskEntry] = {}
        self._children: defaultdict[CacheKey, set[CacheKey]] = defaultdict(set)
        self._bytes = 0
        self._counters = {"hits": 0, "misses": 0, "corrupt": 0, "evictions": 0, "write_errors": 0}
        self._lock = threading.RLock()
        self._clean_temp_files()
        self._scan()

    @property
    def root(self) -> Path:
        return self._root

    # -- startup -------------------------------------------------------------------------------------------
    def _clean_temp_files(self) -> None:
        now = time.time()
        for p in self._root.iterdir():
            m = _TEMP.match(p.name)
            if m is None:
                continue
            try:
                stale = now - p.stat().st_mtime > _STALE_TEMP_S
                if stale or not _pid_alive(int(m.group(2))):
                    p.unlink()
            except OSError:
                pass  # already gone, or not ours to remove

    def _scan(self) -> None:
        for p in self._root.iterdir():
            if not _ENTRY.match(p.name):
                continue
            key = CacheKey(bytes.fromhex(p.name))
            try:
                with open(p, "rb") as f:
                    st = os.fstat(f.fileno())
                    head = f.read(8)
                    hlen = int.from_bytes(head, "little") if len(head) == 8 else 0
                    if hlen < HEADER_LIMIT:  # read the header only, never the tensors
                        head += f.read(hlen)
                header, size = read_header(head)
                if size != st.st_size:
                    raise CorruptEntry(f"file is {st.st_size} bytes, header declares {size} (truncated?)")
                meta = header["__metadata__"]
                check_meta(meta, key, self._fingerprint)
            except CorruptEntry as e:
                self._discard(key, p, None, str(e))
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._discard(key, p, None, f"unreadable header: {e}")
                continue
            parent = CacheKey(bytes.fromhex(meta["parent"])) if meta.get("parent") else None
            self._index_add(key, _DiskEntry(st.st_size, st.st_mtime, parent))
        with self._lock:
            self._evict_for(0)  # the budget may have shrunk since the last run

    # -- reads ---------------------------------------------------------------------------------------------
    def _path(self, key: CacheKey) -> Path:
        return self._root / key.hex()

    def get(self, key: CacheKey) -> KVBlock | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._index_drop(key)
                self._counters["misses"] += 1
            return None
        except OSError as e:
            logger.warning("kvboost disk tier: cannot read %s: %s", path, e)
            with self._lock:
                self._counters["misses"] += 1
            return None
        try:
            block = loads(data, key=key, fingerprint=self._fingerprint)
        except CorruptEntry as e:
            self._discard(key, path, ino, str(e))
            return None
        with self._lock:
            if self._namespace is not None and block.namespace != self._namespace:
                self._counters["misses"] += 1
                return None
            entry = self._index.get(key)
            if entry is None and self._same_file(path, ino):  # another process wrote it since our scan
                self._index_add(key, _DiskEntry(len(data), time.time(), block.parent))
                self._evict_for(0, keep=key)
            elif entry is not None:
                entry.last_access = time.time()
            self._counters["hits"] += 1
        return block

    def contains(self, key: CacheKey) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._path(key).exists()

    def children(self, parent: CacheKey) -> list[CacheKey]:
        with self._lock:
            return list(self._children.get(parent, ()))

    # -- writes --------------------------------------------------------------------------------------------
    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool:
        """Write-through store; ``pin`` is accepted for the interface and ignored (pinning is a memory-tier
        notion). False when the entry is bigger than the budget or the write failed (logged)."""
        if self._namespace is not None and block.namespace != self._namespace:
            raise ValueError(f"block namespace {block.namespace!r} != store namespace {self._namespace!r}")
        if self._fingerprint is not None and block.fingerprint != self._fingerprint:
            raise ValueError("block fingerprint does not match the disk store's fingerprint")
        data = dumps(key, block)
        if len(data) > self._max_bytes:
            self.delete(key)  # superseded: never serve the value this put replaces (as MemoryStore)
            return False
        path = self._path(key)
        tmp = self._root / f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            self._write_temp(tmp, data)
            with self._lock:
                self._evict_for(len(data), replacing=key)
                os.replace(tmp, path)
                self._fsync_dir()
                self._index_drop(key)
                self._index_add(key, _DiskEntry(len(data), time.time(), block.parent))
            return True
        except OSError as e:
            logger.warning("kvboost disk tier: write of %s failed: %s", path, e)
            with self._lock:
                self._counters["write_errors"] += 1
            try:
                tmp.unlink()
            except OSError:
                pass
            return False

    def _write_temp(self, tmp: Path, data: bytes) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())

    def _fsync_dir(self) -> None:
        if not self._fsync:
            return
        fd = os.open(self._root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: CacheKey) -> bool:
        with self._lock:
            known = self._index_drop(key)
            try:
                self._path(key).unlink()
                return True
            except FileNotFoundError:
                return known

    def clear(self) -> None:
        with self._lock:
            for p in self._root.iterdir():
                if _ENTRY.match(p.name):
                    try:
                        p.unlink()
                    except OSError:
                        pass
            self._index.clear()
            self._children.clear()
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

    # -- internals -----------------------------------------------------------------------------------------
    def _index_add(self, key: CacheKey, entry: _DiskEntry) -> None:
        with self._lock:
            self._index_drop(key)
            self._index[key] = entry
            self._bytes += entry.nbytes
            if entry.parent is not None:
                self._children[entry.parent].add(key)

    def _index_drop(self, key: CacheKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        if entry.parent is not None:
            kids = self._children.get(entry.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[entry.parent]
        return True

    def _evict_for(self, size: int, *, replacing: CacheKey | None = None, keep: CacheKey | None = None) -> None:
        """Delete least recently used files until ``size`` more bytes fit (lock held)."""
        prev = self._index.get(replacing) if replacing is not None else None
        old = prev.nbytes if prev is not None else 0
        if self._bytes - old + size <= self._max_bytes:
            return
        for key in sorted(self._index, key=lambda k: self._index[k].last_access):
            if self._bytes - old + size <= self._max_bytes:
                break
            if key in (replacing, keep):
                continue
            self._index_drop(key)
            self._counters["evictions"] += 1
            try:
                self._path(key).unlink()
            except OSError:
                pass

    @staticmethod
    def _same_file(path: Path, ino: int) -> bool:
        """Is ``path`` still the file we read? (Not deleted or replaced meanwhile.)"""
        try:
            return os.stat(path).st_ino == ino
        except OSError:
            return False

    def _discard(self, key: CacheKey, path: Path, ino: int | None, reason: str) -> None:
        """Delete a bad entry — unless it was replaced by a fresh file since we read it (``ino`` differs)."""
        with self._lock:
            self._counters["corrupt"] += 1
            self._counters["misses"] += 1
            self._index_drop(key)
            try:
                if ino is None or self._same_file(path, ino):
                    path.unlink()
            except OSError:
                pass
        logger.warning("kvboost disk tier: dropped %s: %s", path.name, reason)

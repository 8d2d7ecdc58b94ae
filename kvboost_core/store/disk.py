"""Disk tier: one safetensors file per entry, under a byte budget, in a directory of its own model and tenant.

Layout: ``root/<fingerprint>/<namespace>/<key hex[:2]>/<key hex>[.<parent key hex>]``. Each (model, namespace)
pair owns one subdirectory: start-up, ``clear()``, eviction and clean-up never look outside it, so tenants and
models can share a root. The 256 shards keep directories small. The parent link is part of the file name so
that the index (sizes, access times, parent links) is rebuilt at start from a directory listing and one
``lstat`` per file, without opening any entry (the bookkeeping: :mod:`.disk_index`).

Trust: the store's directory is opened once, component by component without following symlinks, and every
shard and file below it is reached through directory descriptors (:mod:`.safe_io`): a model, namespace or shard
directory that is a symlink is never followed (construction refuses one with a ValueError; later it is
skipped), so ``clear()`` and eviction never reach another tenant's files. A file is opened with
``O_NOFOLLOW | O_NONBLOCK`` (a symlink or a FIFO named like an entry cannot redirect or block a read), must be
a regular file no bigger than the entry cap whose header declares exactly its size and, given the model's
:class:`~kvboost_core.store.base.KVGeometry`, tensors of its shape (checked before the payload is read), and
is then checked by :func:`~kvboost_core.store.serialize.parse_entry` (MAC, key, namespace, model, structure).
The cap is ``max_entry_bytes``, lowered to what the geometry's longest chunk can take
(:func:`~kvboost_core.store.serialize.entry_cap`). A file that fails is a miss, is deleted, and is logged
once per key; one that may be another reader's (a MAC this reader cannot check, a file over the cap, a longer
chunk) is a miss, counted as ``skipped`` and left alone.

Crash safety: a write goes to a temp file in the same shard, is flushed and fsynced, then ``os.replace``d over
the final name and the shard is fsynced, so a reader sees the old entry, the new one, or none. A writer killed
mid-write leaves only a temp file, removed when its shard is next scanned.

Other processes: a key missing from the index triggers a re-listing of its shard when the shard directory
changed since it was last listed, so entries another process wrote are found; the byte budget is this
process's view of the directory.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
import uuid
import weakref
from pathlib import Path

from kvboost_core.keys import CacheKey
from kvboost_core.store.base import KVBlock, KVGeometry
from kvboost_core.store.disk_index import DiskEntry, DiskIndex
from kvboost_core.store.safe_io import open_store_dir, pid_alive, read_entry_file, subdir
from kvboost_core.store.serialize import CorruptEntry, ForeignEntry, dumps, entry_cap, parse_entry
from kvboost_core.store.trust import DropLog, resolve_secret, validate_fingerprint, validate_namespace

logger = logging.getLogger("kvboost")

_ENTRY = re.compile(r"([0-9a-f]{32})(?:\.([0-9a-f]{32}))?")
_SHARD = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.([0-9a-f]{32})\.(\d+)\.[0-9a-f]+\.tmp")
_STALE_TEMP_S = 3600.0  # a temp file this old is abandoned even if its writer's pid was reused
_SETTLE_NS = 50_000_000  # a listing this soon after the shard's mtime may have missed a same-tick change
DEFAULT_MAX_ENTRY_BYTES = 1 << 30


def _entry_name(key: CacheKey, parent: CacheKey | None) -> str:
    return key.hex() if parent is None else f"{key.hex()}.{parent.hex()}"


class DiskStore:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int, fingerprint: str, *,
                 namespace: str = "default", secret: str | bytes | None = None, fsync: bool = True,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, geometry: KVGeometry | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if max_entry_bytes < 8:
            raise ValueError(f"max_entry_bytes must be >= 8, got {max_entry_bytes}")
        self._fingerprint = validate_fingerprint(fingerprint)
        self._namespace = validate_namespace(namespace)
        self._secret = resolve_secret(secret)
        self._root = Path(root)
        self._dir = self._root / self._fingerprint / self._namespace
        self._fd = open_store_dir(self._root, (self._fingerprint, self._namespace))  # ValueError: a symlink
        self._closer = weakref.finalize(self, os.close, self._fd)
        self._geometry = geometry
        self._max_bytes = int(max_bytes)
        self._max_entry_bytes = min(int(max_entry_bytes), entry_cap(geometry) if geometry else max_entry_bytes)
        self._fsync = fsync
        self._index = DiskIndex()  # sizes, parent links, LRU order: rebuilt from the listing, no file opened
        self._listed: dict[str, tuple[int, int]] = {}  # shard -> (its mtime_ns, wall ns) when last listed
        self._counters = {"hits": 0, "misses": 0, "corrupt": 0, "skipped": 0, "evictions": 0, "write_errors": 0}
        self._lock = threading.RLock()
        self._log_drop = DropLog(logger, "disk")
        with self._lock:
            for e in os.scandir(self._fd):
                if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                    self._list_shard(e.name, bulk=True)
            self._index.heapify()  # once, not one push per file
            self._evict_for(0)  # the budget may have shrunk since the last run

    @property
    def root(self) -> Path:
        return self._root

    @property
    def directory(self) -> Path:
        """This model's and namespace's own subdirectory: the only one this store reads, writes or clears."""
        return self._dir

    def close(self) -> None:
        """Release the directory descriptor (also done when the store is garbage collected)."""
        self._closer()

    # -- listing (lock held) -------------------------------------------------------------------------------
    def _list_shard(self, shard: str, *, bulk: bool = False) -> None:
        """(Re)build the index of one shard from its listing: one lstat per new file, no file opened.
        ``bulk`` (start-up): heap records are appended unordered; the caller heapifies once at the end."""
        with subdir(self._fd, shard) as fd:  # None: gone, or a symlink (never followed)
            try:
                mtime = os.fstat(fd).st_mtime_ns if fd is not None else 0
                listing = list(os.scandir(fd)) if fd is not None else []
            except OSError:
                listing, mtime = [], 0
            self._index_listing(shard, fd, listing, mtime, bulk)

    def _index_listing(self, shard: str, fd: int | None, listing: list[os.DirEntry[str]], mtime: int,
                       bulk: bool) -> None:
        self._listed[shard] = (mtime, time.time_ns())
        now, seen = time.time(), set()
        keys = self._index.shard_keys(shard)
        for e in listing:
            m = _ENTRY.fullmatch(e.name)
            if m is None:
                if _TEMP.fullmatch(e.name) and fd is not None:
                    self._clean_temp(e, fd, now)
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
            if not stat.S_ISREG(st.st_mode) or st.st_size < 8:
                self._discard(key, e.name, None, "not a regular file of a plausible size")
                continue
            if st.st_size > self._max_entry_bytes:
                continue  # over this reader's cap, maybe another engine's (longer chunks): neither read nor deleted
            parent = CacheKey(bytes.fromhex(m.group(2))) if m.group(2) else None
            entry = DiskEntry(e.name, st.st_size, st.st_mtime, parent)
            if known is not None or not bulk:
                self._index.add(key, entry)
            else:  # start-up fast path (240k files): heap records appended, heapified once by the caller
                self._index.add_unordered(key, entry)
        if not bulk:  # a re-listing: drop what someone else deleted
            for key in keys - seen:
                self._index.drop(key)

    def _clean_temp(self, e: os.DirEntry[str], fd: int, now: float) -> None:
        m = _TEMP.fullmatch(e.name)
        assert m is not None
        try:
            stale = now - e.stat(follow_symlinks=False).st_mtime > _STALE_TEMP_S
            if stale or not pid_alive(int(m.group(2))):
                os.unlink(e.name, dir_fd=fd)
        except OSError:
            pass  # already gone, or not ours to remove

    def _refresh(self, key: CacheKey) -> DiskEntry | None:
        """Index entry for ``key``, re-listing its shard first when the shard changed since its last listing."""
        entry = self._index.get(key)
        if entry is not None:
            return entry
        shard = key.hex()[:2]
        try:
            st = os.stat(shard, dir_fd=self._fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):  # a symlink planted as a shard: never listed
            return None
        mtime = st.st_mtime_ns
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
            name = entry.name
        path = self._path(name)
        ino = None
        try:
            with subdir(self._fd, name[:2]) as fd:
                if fd is None:
                    raise FileNotFoundError(path)
                data, ino = read_entry_file(name, self._max_entry_bytes, dir_fd=fd, geometry=self._geometry)
            block = parse_entry(data, key=key, namespace=self._namespace, fingerprint=self._fingerprint,
                                secret=self._secret, geometry=self._geometry)
        except FileNotFoundError:
            with self._lock:
                if self._index.get(key) is entry:
                    self._index.drop(key)
                self._counters["misses"] += 1
            return None
        except ForeignEntry as e:
            with self._lock:
                self._counters["skipped"] += 1
                self._counters["misses"] += 1
            self._log_drop(f"{self._namespace}/{name}", f"skipped, not deleted: {e}")
            return None
        except CorruptEntry as e:
            self._discard(key, name, ino, str(e))
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
            return self._index.children(parent)

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
        tmp = f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        with subdir(self._fd, name[:2], create=True) as fd:
            try:
                if fd is None:
                    raise NotADirectoryError(f"{path.parent} is a symlink or not a directory")
                self._write_temp(fd, tmp, data)
                with self._lock:
                    self._evict_for(len(data), replacing=key)
                    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                    if self._fsync:
                        os.fsync(fd)
                    old = self._index.get(key)
                    if old is not None and old.name != name:  # same key, other parent link: one file per key
                        self._unlink(old.name)
                    self._index.add(key, DiskEntry(name, len(data), time.time(), block.parent))
                return True
            except OSError as e:
                logger.warning("kvboost disk tier: write of %s failed: %s", path, e)
                with self._lock:
                    self._counters["write_errors"] += 1
                if fd is not None:
                    self._unlink(tmp, fd)
                return False

    def _write_temp(self, dir_fd: int, tmp: str, data: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o644, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())

    def _unlink(self, name: str, dir_fd: int | None = None) -> bool:
        """Unlink ``name`` in its shard, through the shard's descriptor (never a path through a symlink)."""
        if dir_fd is not None:
            try:
                os.unlink(name, dir_fd=dir_fd)
                return True
            except OSError:
                return False
        with subdir(self._fd, name[:2]) as fd:
            return fd is not None and self._unlink(name, fd)

    def delete(self, key: CacheKey) -> bool:
        with self._lock:
            entry = self._refresh(key)
            if entry is None:
                return False
            self._index.drop(key)
            return self._unlink(entry.name) or True

    def clear(self) -> None:
        """Delete this model's and namespace's entries; other tenants' and models' directories are untouched."""
        with self._lock:
            for shard in os.scandir(self._fd):
                if not (_SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                    continue
                with subdir(self._fd, shard.name) as fd:  # None: swapped for a symlink meanwhile
                    for e in os.scandir(fd) if fd is not None else ():
                        if _ENTRY.fullmatch(e.name):
                            self._unlink(e.name, fd)
            self._index.clear()
            self._listed.clear()

    def resize(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        with self._lock:
            self._max_bytes = int(max_bytes)
            self._evict_for(0)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._index), "bytes": self._index.nbytes, "max_bytes": self._max_bytes,
                    **self._counters}

    # -- internals (lock held) -----------------------------------------------------------------------------
    def _touch(self, key: CacheKey, entry: DiskEntry) -> None:
        self._index.touch(key, entry, time.time())

    def _evict_for(self, size: int, *, replacing: CacheKey | None = None) -> None:
        """Delete least recently used files until ``size`` more bytes fit: O(log n) per eviction."""
        for entry in self._index.evict(size, self._max_bytes, replacing=replacing):
            self._counters["evictions"] += 1
            self._unlink(entry.name)

    def _discard(self, key: CacheKey, name: str, ino: int | None, reason: str) -> None:
        """Delete a bad entry — unless it was replaced by a fresh file since we read it (``ino`` differs)."""
        with self._lock:
            self._counters["corrupt"] += 1
            self._counters["misses"] += 1
            entry = self._index.get(key)
            if entry is not None and entry.name == name:
                self._index.drop(key)
            with subdir(self._fd, name[:2]) as fd:
                if fd is not None:
                    try:
                        same = ino is None or os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino == ino
                    except OSError:
                        same = False
                    if same:
                        self._unlink(name, fd)
        self._log_drop(f"{self._namespace}/{name}", reason)

"""Disk tier start-up over many entry files, per-put eviction cost at 20k entries (heap vs the former full
sort), and the cost of the full-weight model fingerprint on the Qwen2.5-0.5B shape.

    python benchmarks/bench_disk_startup.py                      # 240k files, 20k-entry eviction
    python benchmarks/bench_disk_startup.py --entries 24000 --fingerprint

Start-up files are tiny fakes (the same 64 bytes each, named like entries): start-up lists the store's own
shard directories and lstat()s each file; it never opens one, so their content does not matter. Timings are
wall clock on whatever machine runs this (page cache warm: the files were just written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvboost_core.keys import CacheKey, Fingerprint  # noqa: E402
from kvboost_core.store import DensePayload, DiskStore, KVBlock, MemoryStore  # noqa: E402

FP = Fingerprint("ab" * 16)


def _key(i: int) -> CacheKey:
    return CacheKey(i.to_bytes(16, "big"))


def _block(i: int) -> KVBlock:
    kv = torch.zeros(1, 1, 1, 4)
    return KVBlock((i,), DensePayload(kv, kv.clone()), 0, FP, "default")


def _floor_s(base: Path) -> float:
    """What no index can beat without skipping the stat: list every shard and lstat every file."""
    t0 = time.perf_counter()
    for d in os.scandir(base):
        for e in os.scandir(d.path):
            e.stat(follow_symlinks=False)
    return time.perf_counter() - t0


def bench_startup(n: int, tmp: str | None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvboost-startup-", dir=tmp))
    try:
        base = DiskStore(root, 1 << 60, FP, fsync=False).directory
        t0 = time.perf_counter()
        for s in range(256):
            (base / f"{s:02x}").mkdir()
        junk = b"\0" * 64
        for _ in range(n):
            name = os.urandom(16).hex()
            fd = os.open(base / name[:2] / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, junk)
            os.close(fd)
        create_s = time.perf_counter() - t0
        opens, cpu = [], []
        for _ in range(2):
            t0, c0 = time.perf_counter(), time.process_time()
            store = DiskStore(root, 1 << 60, FP, fsync=False)
            opens.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # on a shared machine wall time includes waiting for a core
            assert store.stats()["entries"] == n
        # a miss stats the key's shard; the first miss after the shard changed re-lists it (~n/256 names)
        t0 = time.perf_counter()
        for _ in range(2000):
            store.get(CacheKey(os.urandom(16)))
        miss_us = (time.perf_counter() - t0) / 2000 * 1e6
        return {"files": n, "dir": str(root.parent), "create_s": round(create_s, 2),
                "startup_s": [round(x, 3) for x in opens], "startup_cpu_s": [round(x, 3) for x in cpu],
                "floor_scandir_lstat_s": round(_floor_s(base), 3),
                "miss_us": round(miss_us, 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SortEvictDisk(DiskStore):
    """The former eviction: sort the whole index by last access on every put that has to evict."""

    def _evict_for(self, size: int, *, replacing: CacheKey | None = None) -> None:
        prev = self._index.get(replacing) if replacing is not None else None
        old = prev.nbytes if prev is not None else 0
        if self._bytes - old + size <= self._max_bytes:
            return
        for key in sorted(self._index, key=lambda k: self._index[k].last_access):
            if self._bytes - old + size <= self._max_bytes:
                break
            if key == replacing:
                continue
            entry = self._index[key]
            self._index_drop(key)
            self._counters["evictions"] += 1
            self._unlink(self._path(entry.name))


class SortEvictMemory(MemoryStore):
    """The former memory-tier eviction: sort every unpinned entry by priority on each evicting put."""

    def _make_room(self, size: int) -> bool:
        if self._bytes + size <= self._max_bytes:
            return True
        victims = sorted((m for m in self._meta.values() if not m.pinned), key=self._policy.priority)
        for meta in victims:
            if self._bytes + size <= self._max_bytes:
                break
            self._remove(meta.key)
            self._evictions += 1
        return self._bytes + size <= self._max_bytes


def _time_puts(store: Any, start: int, puts: int) -> float:
    blocks = [_block(start + i) for i in range(puts)]
    t0 = time.perf_counter()
    for i, b in enumerate(blocks):
        store.put(_key(start + i), b)
    return (time.perf_counter() - t0) / puts * 1000


def bench_eviction(n: int, puts: int) -> dict[str, Any]:
    out: dict[str, Any] = {"entries": n, "puts_timed": puts}
    for label, cls in (("disk_sort_before", SortEvictDisk), ("disk_heap_after", DiskStore)):
        root = tempfile.mkdtemp(prefix="kvboost-evict-")
        try:
            probe = DiskStore(Path(root) / "probe", 1 << 40, FP, fsync=False)
            probe.put(_key(0), _block(0))
            size = probe.stats()["bytes"]
            store = cls(Path(root) / "s", n * size, FP, fsync=False)  # holds exactly n entries
            for i in range(n):
                store.put(_key(i), _block(i))
            assert store.stats()["entries"] == n and store.stats()["evictions"] == 0
            out[f"{label}_ms_per_put"] = round(_time_puts(store, n, puts), 3)
            assert store.stats()["evictions"] == puts and store.stats()["entries"] == n
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for label, mcls in (("memory_sort_before", SortEvictMemory), ("memory_heap_after", MemoryStore)):
        size = _block(0).nbytes
        mem = mcls(n * size)
        for i in range(n):
            mem.put(_key(i), _block(i))
        out[f"{label}_ms_per_put"] = round(_time_puts(mem, n, puts), 4)
        assert mem.stats()["evictions"] == puts
    return out


def bench_fingerprint() -> dict[str, Any]:
    from kvboost_core.keys import model_fingerprint
    from kvboost_rag.app.bench.ttft import build_model

    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        model, tok = build_model("qwen2.5-0.5b", None, dtype=dtype)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        t0 = time.perf_counter()
        model_fingerprint(model, tok)
        out[str(dtype).removeprefix("torch.")] = {"weight_bytes": nbytes,
                                                  "fingerprint_s": round(time.perf_counter() - t0, 3)}
        del model
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=240_000, help="entry files for the start-up run (0 skips)")
    ap.add_argument("--evict-entries", type=int, default=20_000, help="entries in the eviction run (0 skips)")
    ap.add_argument("--puts", type=int, default=500, help="evicting puts timed per store")
    ap.add_argument("--tmp", default=None, help="parent directory of the start-up files (e.g. /dev/shm)")
    ap.add_argument("--fingerprint", action="store_true", help="also time model_fingerprint on the 0.5B shape")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    if args.entries:
        result["startup"] = bench_startup(args.entries, args.tmp)
        print(json.dumps({"startup": result["startup"]}), flush=True)
    if args.evict_entries:
        result["eviction"] = bench_eviction(args.evict_entries, args.puts)
        print(json.dumps({"eviction": result["eviction"]}), flush=True)
    if args.fingerprint:
        result["fingerprint"] = bench_fingerprint()
        print(json.dumps({"fingerprint": result["fingerprint"]}), flush=True)


if __name__ == "__main__":
    main()

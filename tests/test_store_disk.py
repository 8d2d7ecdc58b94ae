"""Disk tier: restart, corruption, foreign model, crash during writes, budget, and the factory."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvboost_core.keys import CacheKey, Fingerprint
from kvboost_core.quant import quantize_payload
from kvboost_core.store import DensePayload, DiskStore, KVBlock, MemoryStore, TieredStore, build_store
from kvboost_core.store.serialize import CorruptEntry, dumps, parse_entry

FP = Fingerprint("ab" * 16)
REPO = Path(__file__).resolve().parents[1]


def key(i: int) -> CacheKey:
    return CacheKey(i.to_bytes(16, "big"))


def make_block(i: int, n: int = 16, *, bits: int | None = None, parent: CacheKey | None = None,
               fp: str = FP, ns: str = "default") -> KVBlock:
    """Deterministic in ``i``: a reader can rebuild and compare what a writer stored."""
    g = torch.Generator().manual_seed(i)
    dense = DensePayload(torch.randn(2, 2, n, 8, generator=g).bfloat16(),
                         torch.randn(2, 2, n, 8, generator=g).bfloat16())
    payload = quantize_payload(dense, bits) if bits else dense
    ids = tuple(range(i, i + n))
    return KVBlock(ids, payload, base_position=3 * i, fingerprint=Fingerprint(fp), namespace=ns,
                   kind="prefix" if parent else "content", parent=parent)


def loads(data: bytes, *, key: CacheKey, fingerprint: str = FP, namespace: str = "default",
          secret: bytes | None = None) -> KVBlock:
    return parse_entry(data, key=key, namespace=namespace, fingerprint=fingerprint, secret=secret)


def entry_files(store: DiskStore) -> list[Path]:
    """The entry files in the store's own subdirectory (root/<fingerprint>/<namespace>/<shard>/...)."""
    return sorted(p for p in store.directory.rglob("*") if p.is_file() and not p.name.startswith("."))


def entry_path(store: DiskStore, k: CacheKey) -> Path:
    (path,) = [p for p in entry_files(store) if p.name.startswith(k.hex())]
    return path


def same(a: KVBlock, b: KVBlock) -> bool:
    ka, va = a.payload.to_dense(torch.float32, "cpu")
    kb, vb = b.payload.to_dense(torch.float32, "cpu")
    return (a.token_ids == b.token_ids and a.base_position == b.base_position and a.kind == b.kind
            and a.parent == b.parent and torch.equal(ka, kb) and torch.equal(va, vb))


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_serialize_roundtrip(bits: int | None) -> None:
    b = make_block(5, 37, bits=bits, parent=key(77))
    back = loads(dumps(key(5), b), key=key(5), fingerprint=FP)
    assert same(b, back) and type(back.payload) is type(b.payload)
    if bits is not None:  # the pre-RoPE flag travels with the entry (it decides how keys are placed)
        assert back.payload.keys_pre_rope is False
        pre = dataclasses.replace(b, payload=dataclasses.replace(b.payload, keys_pre_rope=True))
        assert loads(dumps(key(5), pre), key=key(5), fingerprint=FP).payload.keys_pre_rope is True
    with pytest.raises(CorruptEntry):
        loads(dumps(key(5), b), key=key(6))  # served under another key


def test_restart_hits_and_rebuilds_index(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 10_000_000, FP)
    parent = key(100)
    for i in range(5):
        assert s.put(key(i), make_block(i, bits=(None, 8, 4)[i % 3], parent=parent))
    s2 = DiskStore(tmp_path, 10_000_000, FP)
    assert sorted(s2.children(parent)) == [key(i) for i in range(5)]
    assert s2.stats()["entries"] == 5 and s2.stats()["bytes"] == s.stats()["bytes"]
    for i in range(5):
        got = s2.get(key(i))
        assert got is not None and same(got, make_block(i, bits=(None, 8, 4)[i % 3], parent=parent))
    assert s2.get(key(42)) is None


def _corrupt_case(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, restart: bool) -> None:
    s = DiskStore(tmp_path, 10_000_000, FP)
    s.put(key(1), make_block(1))
    path = entry_path(s, key(1))
    damage(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvboost"):
        reader = DiskStore(tmp_path, 10_000_000, FP) if restart else s
        assert reader.get(key(1)) is None
    assert not path.exists()
    assert any("dropped" in r.getMessage() for r in caplog.records)


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip_one_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: only the checksum can tell
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("restart", [False, True])
def test_truncated_file_is_a_miss_and_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                               restart: bool) -> None:
    _corrupt_case(tmp_path, caplog, _truncate, restart)


@pytest.mark.parametrize("restart", [False, True])
def test_flipped_byte_is_a_miss_and_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             restart: bool) -> None:
    _corrupt_case(tmp_path, caplog, _flip_one_byte, restart)


def test_garbage_and_empty_files(tmp_path: Path) -> None:
    d = DiskStore(tmp_path, 1_000_000, FP).directory / "00"
    d.mkdir()
    (d / ("00" + key(1).hex()[2:])).write_bytes(b"")
    (d / ("00" + key(2).hex()[2:])).write_bytes(os.urandom(300))
    (d / "notes.txt").write_text("not ours")
    s = DiskStore(tmp_path, 1_000_000, FP)
    assert s.get(key(1)) is None and s.get(key(2)) is None
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_foreign_fingerprint_is_a_miss_and_kept(tmp_path: Path) -> None:
    other_fp = "other" * 4
    other = DiskStore(tmp_path, 1_000_000, other_fp)
    other.put(key(1), make_block(1, fp=other_fp))
    mine = DiskStore(tmp_path, 1_000_000, FP)  # another model's subdirectory: neither read nor deleted
    assert mine.get(key(1)) is None and entry_files(other)
    # planted in my directory (copied over): the header says another model, so a miss, and deleted
    plant = mine.directory / key(1).hex()[:2] / key(1).hex()
    plant.parent.mkdir()
    plant.write_bytes(entry_path(other, key(1)).read_bytes())
    assert DiskStore(tmp_path, 1_000_000, FP).get(key(1)) is None and not plant.exists()
    with pytest.raises(ValueError):
        mine.put(key(3), make_block(3, fp=other_fp))


def test_namespace_isolation(tmp_path: Path) -> None:
    DiskStore(tmp_path, 1_000_000, FP, namespace="a").put(key(1), make_block(1, ns="a"))
    assert DiskStore(tmp_path, 1_000_000, FP, namespace="b").get(key(1)) is None
    assert DiskStore(tmp_path, 1_000_000, FP, namespace="a").get(key(1)) is not None


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    size = len(dumps(key(0), make_block(0)))
    s = DiskStore(tmp_path, 3 * size + 10, FP)
    for i in range(3):
        s.put(key(i), make_block(i))
        time.sleep(0.01)
    assert s.get(key(0)) is not None  # key 0 becomes the most recent
    s.put(key(3), make_block(3))
    assert s.stats()["bytes"] <= s.stats()["max_bytes"]
    assert s.contains(key(0)) and not s.contains(key(1)) and s.contains(key(3))
    assert len(entry_files(s)) == 3
    assert not DiskStore(tmp_path, size - 1, FP).put(key(9), make_block(9))  # bigger than the budget
    assert len(entry_files(s)) == 0  # ... and the smaller budget evicted everything at start


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_store_disk import key, make_block
    from kvboost_core.store import DiskStore
    s = DiskStore({root!r}, 10**9, {fp!r})
    i = 0
    while True:  # bigger blocks so that a kill often lands mid-write
        s.put(key(i % 40), make_block(i % 40, n=512, bits=(None, 8, 4)[i % 3]))
        print(i, flush=True)
        i += 1
""")


def test_sigkill_during_writes_never_serves_a_corrupt_entry(tmp_path: Path) -> None:
    code = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path), fp=FP)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        for _ in range(10 + 15 * round_):  # wait for some completed writes, then kill at a random point
            if not proc.stdout.readline():
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the kill rarely lands inside a write; plant what one would leave: a half-written temp file
        half = dumps(key(7), make_block(7, n=512))
        shard = DiskStore(tmp_path, 10**9, FP).directory / key(7).hex()[:2]
        shard.mkdir(exist_ok=True)
        (shard / f".{key(7).hex()}.{proc.pid}.deadbeef.tmp").write_bytes(half[: len(half) // 2])
        store = DiskStore(tmp_path, 10**9, FP)
        assert not [p for p in tmp_path.rglob("*.tmp")]
        hits = 0
        for i in range(40):
            got = store.get(key(i))
            if got is not None:
                hits += 1
                assert any(same(got, make_block(i, n=512, bits=b)) for b in (None, 8, 4))
        assert hits > 0


def test_factory(tmp_path: Path) -> None:
    kw = {"max_bytes": 1_000_000, "fingerprint": FP, "namespace": "default"}
    assert isinstance(build_store("memory", **kw), MemoryStore)
    t = build_store(f"disk:{tmp_path}?max_bytes=5MB", **kw)
    assert isinstance(t, TieredStore) and [type(x) for x in t.tiers] == [MemoryStore, DiskStore]
    assert t.stats()["disk.max_bytes"] == 5_000_000
    t2 = build_store([f"disk:{tmp_path}", "memory"], **kw)
    assert isinstance(t2, TieredStore) and isinstance(t2.tiers[0], MemoryStore)
    mine = MemoryStore(10)
    assert build_store(mine, **kw) is mine
    for bad in ("mem", "disk:", f"disk:{tmp_path}?budget=1", 42, [], ["memory", "memory"], ["memory", 3]):
        with pytest.raises(ValueError, match="accepted forms"):
            build_store(bad, **kw)


def test_tiered_promotes_from_disk(tmp_path: Path) -> None:
    mem = MemoryStore(1_000_000)
    t = TieredStore([mem, DiskStore(tmp_path, 10_000_000, FP)])
    assert t.put(key(1), make_block(1), pin=True)
    mem.clear()  # cold memory: the disk tier serves and the block comes back into memory
    assert t.get(key(1)) is not None and mem.contains(key(1))
    tiny = TieredStore([MemoryStore(10), DiskStore(tmp_path, 10_000_000, FP)])
    assert tiny.get(key(1)) is not None  # promotion does not fit: still a hit
    assert t.delete(key(1)) and t.get(key(1)) is None
    assert t.stats()["misses"] == 1


def test_other_writers_entries_are_found_and_their_deletes_seen(tmp_path: Path) -> None:
    mine = DiskStore(tmp_path, 10**8, FP, fsync=False)
    other = DiskStore(tmp_path, 10**8, FP, fsync=False)  # another process on the same directory
    parent = key(500)
    for i in range(6):
        assert other.put(key(i), make_block(i, parent=parent if i % 2 else None))
    for i in range(6):  # not in my index: found by re-listing the key's shard
        got = mine.get(key(i))
        assert got is not None and same(got, make_block(i, parent=parent if i % 2 else None))
    assert sorted(mine.children(parent)) == [key(1), key(3), key(5)]
    assert mine.stats()["entries"] == 6
    assert other.delete(key(3)) and mine.get(key(3)) is None
    mine.contains(key(999))  # a miss in the shard of keys 0..5 re-lists it: key 3's deletion is seen
    assert key(3) not in mine.children(parent) and mine.stats()["entries"] == 5

"""Entries a reader must refuse without crashing a request, and must not delete when they may be another
reader's (issue 26): shapes that do not fit the model, planted oversized files, symlinked directories,
entries keyed under a secret the reader does not hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import CORPUS
from helpers import docs_prompt, engine_for
from test_store_disk import FP, entry_files, entry_path, key, make_block, same

from kvboost_core.store import DensePayload, DiskStore, KVBlock, KVGeometry, safe_io
from kvboost_core.store.serialize import dumps, entry_cap

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, max_tokens=16, dtype=torch.bfloat16)


def _dense(L: int = 2, H: int = 2, n: int = 16, D: int = 8, dtype: torch.dtype = torch.bfloat16) -> DensePayload:
    g = torch.Generator().manual_seed(L * 1000 + H * 100 + n * 10 + D)
    return DensePayload(torch.randn(L, H, n, D, generator=g).to(dtype), torch.randn(L, H, n, D, generator=g).to(dtype))


def _forge(store: DiskStore, k, payload: DensePayload) -> Path:
    """What anyone with write access can do without a secret: a well-formed, correctly hashed entry."""
    n = payload.num_tokens
    block = KVBlock(tuple(range(n)), payload, 0, FP, "default")
    assert store.put(k, make_block(1))  # a genuine entry first, so that the file is indexed
    path = entry_path(store, k)
    path.write_bytes(dumps(k, block))
    return path


@pytest.mark.parametrize("why,payload", [
    ("one layer too many", _dense(L=3)), ("one KV head", _dense(H=1)), ("head_dim 4", _dense(D=4)),
    ("float64", _dense(dtype=torch.float64)),
])
def test_entry_of_another_shape_is_a_miss_and_deleted(tmp_path: Path, why: str, payload: DensePayload) -> None:
    store = DiskStore(tmp_path, 10**8, FP, geometry=GEOM)
    path = _forge(store, key(1), payload)
    assert store.get(key(1)) is None, why
    assert not path.exists(), why
    assert store.stats()["corrupt"] == 1


def test_chunk_longer_than_this_engines_is_skipped_not_deleted(tmp_path: Path) -> None:
    """A longer chunk may be another engine's (a larger chunk_size on the same model): never served, kept."""
    store = DiskStore(tmp_path, 10**8, FP, geometry=GEOM)
    path = _forge(store, key(1), _dense(n=17))
    assert store.get(key(1)) is None and path.exists()
    assert store.stats()["skipped"] == 1 and store.stats()["corrupt"] == 0


def test_cap_follows_the_geometry_and_nothing_past_a_bad_header_is_read(tmp_path: Path, monkeypatch) -> None:
    cap = entry_cap(GEOM)
    assert cap < 2 * 1024**2  # 2 layers x 2 heads x 16 tokens x 8 channels: a header's slack plus a few KB
    store = DiskStore(tmp_path, 10**9, FP, geometry=GEOM)
    assert store.put(key(1), make_block(1)) and store.put(key(2), make_block(2))
    big = entry_path(store, key(1))
    big.write_bytes(dumps(key(1), KVBlock(tuple(range(20_000)), _dense(n=20_000, dtype=torch.float32), 0, FP,
                                          "default")))  # ~5 MB, consistent, correctly hashed
    wrong = entry_path(store, key(2))
    wrong.write_bytes(dumps(key(2), KVBlock(tuple(range(16)), _dense(L=5), 0, FP, "default")))
    read: list[int] = []
    real = safe_io.read_exact
    monkeypatch.setattr(safe_io, "read_exact", lambda fd, n: (read.append(n), real(fd, n))[1])
    fresh = DiskStore(tmp_path, 10**9, FP, geometry=GEOM)
    assert fresh.get(key(1)) is None and big.exists()  # over the cap: not read at all, not deleted
    assert fresh.get(key(2)) is None and not wrong.exists()  # the header says 5 layers: the payload is not read
    assert sum(read) < 4096, read


def test_an_engine_never_fails_on_a_forged_entry_of_another_shape(tiny_llama, tokenizer, tmp_path: Path) -> None:
    """The audit's case: a forged 2-layer entry for a 3-layer model raised ValueError into every call and was
    promoted into the memory tier. Now it is a miss, deleted, and the answer is the cold engine's."""
    prompt = docs_prompt([CORPUS[1]], " Where was Alice born?")
    writer = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}")
    assert writer.warm(CORPUS[1]).warmed == 1
    disk = next(t for t in writer.store.tiers if isinstance(t, DiskStore))
    files = entry_files(disk)
    assert files
    for path in files:
        k = bytes.fromhex(path.name.split(".")[0])
        genuine = disk.get(k)
        assert genuine is not None
        dense_k, dense_v = genuine.payload.to_dense(torch.float32, "cpu")
        forged = KVBlock(genuine.token_ids, DensePayload(dense_k[:2], dense_v[:2]), genuine.base_position,
                         genuine.fingerprint, genuine.namespace, kind=genuine.kind)
        path.write_bytes(dumps(k, forged))  # type: ignore[arg-type]
    cold = engine_for(tiny_llama, tokenizer).prefill(prompt, store_prefix=False)
    reader = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}")
    for _ in range(2):  # the second call would find a promoted copy in the memory tier
        res = reader.prefill(prompt, store_prefix=False)
        assert res.stats["hits_content"] == 0
        assert torch.equal(res.last_logits, cold.last_logits)
    assert not any(p.exists() for p in files)


# -- symlinks -----------------------------------------------------------------------------------------------
def test_namespace_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    b = DiskStore(tmp_path, 10**7, FP, namespace="tenantB")
    assert b.put(key(1), make_block(1, ns="tenantB"))
    os.symlink(b.directory, tmp_path / FP / "tenantA")  # tenant A's directory is B's
    for budget in (0, 10**7):  # start-up eviction (budget 0) and clear() must not reach B's entries
        with pytest.raises(ValueError, match="symlink"):
            DiskStore(tmp_path, budget, FP, namespace="tenantA")
    assert b.get(key(1)) is not None and len(entry_files(b)) == 1


def test_fingerprint_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.symlink(other, tmp_path / FP)
    with pytest.raises(ValueError, match="symlink"):
        DiskStore(tmp_path, 10**7, FP)


def test_symlinked_shard_is_never_followed(tmp_path: Path) -> None:
    b = DiskStore(tmp_path, 10**7, FP, namespace="tenantB")
    assert b.put(key(1), make_block(1, ns="tenantB"))
    b_file = entry_path(b, key(1))
    a = DiskStore(tmp_path, 10**7, FP, namespace="tenantA")
    shard = key(1).hex()[:2]
    os.symlink(b.directory / shard, a.directory / shard)  # A's shard is B's
    assert a.get(key(1)) is None  # not listed through the link, so not read, not "corrupt", not deleted
    a.clear()
    DiskStore(tmp_path, 0, FP, namespace="tenantA")  # start-up eviction with no budget
    assert b_file.exists() and b.get(key(1)) is not None


def test_directory_swapped_for_a_symlink_after_start_is_not_followed(tmp_path: Path) -> None:
    b = DiskStore(tmp_path, 10**7, FP, namespace="tenantB")
    assert b.put(key(1), make_block(1, ns="tenantB"))
    a = DiskStore(tmp_path, 10**7, FP, namespace="tenantA")
    assert a.put(key(2), make_block(2, ns="tenantA"))
    os.rename(a.directory, tmp_path / "moved")
    os.symlink(b.directory, a.directory)
    a.clear()  # works on the directory it opened, wherever it now is
    assert b.get(key(1)) is not None
    assert not [p for p in (tmp_path / "moved").rglob("*") if p.is_file()]


# -- secrets --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reader_secret", [None, b"another secret"])
def test_keyed_entry_a_reader_cannot_check_is_skipped_not_deleted(tmp_path: Path, reader_secret, monkeypatch) -> None:
    monkeypatch.delenv("KVBOOST_STORE_SECRET", raising=False)
    writer = DiskStore(tmp_path, 10**7, FP, secret=b"the deployment secret")
    assert writer.put(key(1), make_block(1))
    path = entry_path(writer, key(1))
    reader = DiskStore(tmp_path, 10**7, FP, secret=reader_secret)
    for _ in range(3):
        assert reader.get(key(1)) is None
    assert path.exists() and reader.stats()["skipped"] == 3 and reader.stats()["corrupt"] == 0
    got = DiskStore(tmp_path, 10**7, FP, secret=b"the deployment secret").get(key(1))
    assert got is not None and same(got, make_block(1))


def test_unkeyed_entry_is_skipped_by_a_keyed_reader_and_a_damaged_one_deleted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVBOOST_STORE_SECRET", raising=False)
    plain = DiskStore(tmp_path, 10**7, FP)
    assert plain.put(key(1), make_block(1)) and plain.put(key(2), make_block(2))
    intact, damaged = entry_path(plain, key(1)), entry_path(plain, key(2))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    keyed = DiskStore(tmp_path, 10**7, FP, secret=b"s")
    assert keyed.get(key(1)) is None and intact.exists()  # another (secret-less) replica's entry: kept
    assert keyed.get(key(2)) is None and not damaged.exists()  # provably damaged: deleted

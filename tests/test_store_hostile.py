"""Hostile bytes in the disk and Redis tiers: fuzzed headers, bit flips, truncations, re-tagged forgeries,
special files. Every case must end as a miss (the entry removed) or a correct hit; nothing may raise."""

from __future__ import annotations

import json
import logging
import os
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _redis_fixture import RedisServer, redis_server, redis_url  # noqa: F401
from test_store_disk import FP, entry_path, key, make_block, same

from kvboost_core.store import DiskStore, KVBlock, RedisStore
from kvboost_core.store.serialize import _canonical, dumps
from kvboost_core.store.trust import entry_tag

N_FLIPS = 500  # bit flips, truncations, appended bytes
N_HEADER = 600  # structural header mutations (half of them re-tagged with the unkeyed hash)
K = key(7)
PARENT = key(70)


def _block(bits: int | None) -> KVBlock:
    return make_block(7, n=3, bits=bits, parent=PARENT)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (hlen,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + hlen]), data[8 + hlen:]


def _join(header: Any, body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


def _retag(header: Any, body: bytes) -> Any:
    """What a writer without the secret can always do: recompute the unkeyed tag over its forgery."""
    try:
        meta = header["__metadata__"]
        meta["tag"] = entry_tag(None, key=K, namespace="default", fingerprint=FP, header=_canonical(header),
                                data=body)
    except Exception:  # noqa: BLE001 - a header too broken to tag is sent as is
        pass
    return header


_WEIRD: list[Any] = ["", "a", "-1", "1e9", " 5", "+5", "99999999999999999999", "0x10", None, 5, [], {}, "\u00e9",
                     "ff" * 16, "zz" * 16, "1" * 64, True, -3, 1.5, ["a", "b"]]


def _mutate_header(header: dict[str, Any], rng: random.Random) -> Any:
    names = [n for n in header if n != "__metadata__"]
    meta = header["__metadata__"]
    op = rng.randrange(12)
    if op == 0:  # rename a metadata key
        k = rng.choice(sorted(meta))
        meta[k + rng.choice(["_", "X", ""]) + "x"] = meta.pop(k)
    elif op == 1:  # drop a metadata key
        meta.pop(rng.choice(sorted(meta)))
    elif op == 2:  # a metadata value of another type or an odd string
        meta[rng.choice(sorted(meta))] = rng.choice(_WEIRD)
    elif op == 3:  # bad offsets
        header[rng.choice(names)]["data_offsets"] = rng.choice(
            [["a", "b"], [], [0], [5, 2], [0, 10**12], [-1, 3], [0, 0], None, [1.0, 2.0], [True, False]])
    elif op == 4:  # a tensor record that is not a record
        header[rng.choice(names)] = rng.choice([5, "x", None, [], {"dtype": "F32"}])
    elif op == 5:
        header[rng.choice(names)]["dtype"] = rng.choice(["Z9", "F32", "I64", "U8", "BF16", "F64", "BOOL", 3])
    elif op == 6:
        header[rng.choice(names)]["shape"] = rng.choice([[], [-1], [10**9], [1, 1], "3", [3.0], [0], None])
    elif op == 7:  # drop, add or rename a tensor
        choice = rng.randrange(3)
        if choice == 0:
            header.pop(rng.choice(names))
        elif choice == 1:
            header["extra"] = dict(header[rng.choice(names)])
        else:
            header[rng.choice(names) + "2"] = header.pop(rng.choice(names))
    elif op == 8:
        header["__metadata__"] = rng.choice([None, [], "meta", 5, {"format": "2"}])
    elif op == 9:  # swap two tensors' records
        a, b = rng.sample(names, 2)
        header[a], header[b] = header[b], header[a]
    elif op == 10:
        return rng.choice([[], None, 5, "x", [header]])
    else:  # a valid-looking value of the right type but wrong content
        k = rng.choice(["kind", "payload", "parent", "context_digest", "namespace", "fingerprint", "key",
                        "base_position", "num_tokens", "format", "bits", "group_size", "head_dim"])
        meta[k] = rng.choice(["prefix", "content", "repaired", "dense", "quant", "0", "1", "4", "8", "16",
                              key(8).hex(), "other", "ab" * 16, "00" * 32, "2"])
    return header


def _cases(seed: int) -> Iterator[tuple[str, bytes, bool]]:
    """(label, bytes, exact): ``exact`` cases may only hit with the original block; re-tagged forgeries may
    hit with any block that is well formed (without a secret they are indistinguishable from a writer's)."""
    rng = random.Random(seed)
    goods = {bits: dumps(K, _block(bits)) for bits in (None, 8, 4)}
    for i in range(N_FLIPS):
        bits = (None, 8, 4)[i % 3]
        data = bytearray(goods[bits])
        op = rng.randrange(3)
        if op == 0:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[rng.randrange(len(data)):]
        else:
            data += os.urandom(rng.randint(1, 40))
        yield f"flip{i}/{bits}", bytes(data), True
    for i in range(N_HEADER):
        bits = (None, 8, 4)[i % 3]
        header, body = _split(goods[bits])
        mutated = _mutate_header(header, rng)
        retag = i % 2 == 1
        if retag:
            mutated = _retag(mutated, body)
        yield f"header{i}/{bits}/{'retag' if retag else 'raw'}", _join(mutated, body), not retag


def _check(label: str, got: KVBlock | None, exact: bool, bits: int | None) -> None:
    if got is None:
        return
    if exact:
        assert same(got, _block(bits)), label
    else:  # a forgery that parsed must still be a block the engine can use without crashing
        k, v = got.payload.to_dense(torch.float32, "cpu")
        assert k.shape == v.shape and k.shape[2] == len(got.token_ids), label


def _bits(label: str) -> int | None:
    b = label.split("/")[1]
    return None if b == "None" else int(b)


def _run_fuzz(write: Callable[[bytes], None], get: Callable[[], KVBlock | None],
              present: Callable[[], bool]) -> dict[str, int]:
    counts = {"cases": 0, "misses": 0, "hits": 0}
    for label, data, exact in _cases(seed=1234):
        write(data)
        got = get()  # must not raise
        _check(label, got, exact, _bits(label))
        counts["cases"] += 1
        if got is None:
            counts["misses"] += 1
            assert not present(), f"{label}: the bad entry is still there"
        else:
            counts["hits"] += 1
    return counts


def test_fuzz_disk(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10**8, FP, fsync=False)
    assert store.put(K, _block(None))
    path = entry_path(store, K)

    counts = _run_fuzz(path.write_bytes, lambda: store.get(K), path.exists)
    assert counts["cases"] >= 1000 and counts["misses"] > 900
    assert store.stats()["corrupt"] == counts["misses"]


@pytest.mark.redis
def test_fuzz_redis(redis_url: str) -> None:  # noqa: F811
    store = RedisStore(redis_url, namespace="default", fingerprint=FP)
    rkey = store._k(K)

    counts = _run_fuzz(lambda d: store._client.set(rkey, d), lambda: store.get(K),
                       lambda: bool(store._client.exists(rkey)))
    assert counts["cases"] >= 1000 and counts["misses"] > 900
    assert store.stats()["corrupt"] == counts["misses"] and store.stats()["errors"] == 0


@pytest.mark.redis
def test_poisoned_redis_values_from_the_probe(redis_url: str) -> None:  # noqa: F811
    """The probe's values that made every request raise: now misses, and unlinked."""
    store = RedisStore(redis_url, namespace="default", fingerprint=FP)
    header, body = _split(dumps(K, _block(None)))
    names = [n for n in header if n != "__metadata__"]
    variants = []
    for mutate in (lambda h: h.__setitem__("renamed", h.pop(names[0])),
                   lambda h: h[names[0]].__setitem__("data_offsets", ["a", "b"]),
                   lambda h: h[names[0]].__setitem__("data_offsets", []),
                   lambda h: h.__setitem__(names[0], 5)):
        h = json.loads(json.dumps(header))
        mutate(h)
        variants += [_join(h, body), _join(_retag(h, body), body)]
    for data in variants:
        store._client.set(store._k(K), data)
        for _ in range(3):  # the first lookup unlinks it; the next ones are plain misses
            assert store.get(K) is None
        assert not store._client.exists(store._k(K))


def test_bad_entry_is_logged_once_per_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path, 10**8, FP, fsync=False)
    caplog.set_level(logging.WARNING, logger="kvboost")
    for _ in range(3):  # the same key poisoned again and again (e.g. by a hostile writer)
        assert store.put(K, _block(None))
        path = entry_path(store, K)
        path.write_bytes(path.read_bytes()[:-1])
        assert store.get(K) is None and not path.exists()
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    assert store.stats()["corrupt"] == 3


# -- special files ---------------------------------------------------------------------------------------
def _plant(store: DiskStore, make: Callable[[Path], None], *, indexed: bool) -> Path:
    """Put a special file where the entry for K lives: after the store indexed a good entry there
    (``indexed``), or where the store has never seen one (found by re-listing the shard)."""
    if indexed:
        assert store.put(K, _block(None))
        path = entry_path(store, K)
        path.unlink()
    else:
        path = store.directory / K.hex()[:2] / K.hex()
        path.parent.mkdir(exist_ok=True)
    make(path)
    return path


SPECIALS: dict[str, Callable[[Path], None]] = {
    "fifo": os.mkfifo,
    "symlink_dev_zero": lambda p: p.symlink_to("/dev/zero"),
    "symlink_to_entry_elsewhere": lambda p: p.symlink_to(p.parent.parent / "elsewhere"),
    "directory": lambda p: p.mkdir(),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("kind", sorted(SPECIALS))
def test_special_files_are_misses_without_hanging(tmp_path: Path, kind: str, indexed: bool) -> None:
    store = DiskStore(tmp_path, 10**8, FP, fsync=False)
    (store.directory / "elsewhere").write_bytes(dumps(K, _block(None)))  # a valid entry, outside the shard
    path = _plant(store, SPECIALS[kind], indexed=indexed)
    assert store.get(K) is None and not store.contains(K)
    if kind != "directory":  # a directory cannot be unlinked; it is simply never indexed
        assert not os.path.lexists(path)
    reopened = DiskStore(tmp_path, 10**8, FP, fsync=False)  # start-up neither hangs nor indexes it
    assert reopened.get(K) is None and reopened.stats()["entries"] == 0


@pytest.mark.timeout(30)
def test_special_files_at_start_up(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10**8, FP, fsync=False)
    shard = store.directory / K.hex()[:2]
    shard.mkdir()
    os.mkfifo(shard / K.hex())
    (shard / key(8).hex()).symlink_to("/dev/zero")
    fresh = DiskStore(tmp_path, 10**8, FP, fsync=False)
    assert fresh.stats()["entries"] == 0 and sorted(shard.iterdir()) == []


def test_oversized_and_lying_files_are_not_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10**8, FP, fsync=False, max_entry_bytes=4096)
    assert store.put(K, _block(None))
    path = entry_path(store, K)
    with open(path, "r+b") as f:  # sparse: 1 GiB that would be read whole by a naive reader
        f.truncate(1 << 30)
    # over this engine's cap: never read or served, but kept (an engine with longer chunks may own it)
    assert store.get(K) is None and path.exists()
    assert store.put(K, _block(None))
    path = entry_path(store, K)
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])  # header length far past the file
    assert store.get(K) is None and not path.exists()
    assert store.put(K, _block(None)) and store.get(K) is not None


@pytest.mark.redis
def test_redis_values_of_another_type_are_bad_data_not_an_outage(redis_url: str) -> None:  # noqa: F811
    store = RedisStore(redis_url, namespace="default", fingerprint=FP)
    store._client.rpush(store._k(K), b"x")  # a list where an entry should be
    assert store.get(K) is None and not store._client.exists(store._k(K))
    store._client.set(store._kids(PARENT), b"not a set")
    assert store.children(PARENT) == [] and not store._client.exists(store._kids(PARENT))
    store._client.set(store._kids(PARENT), b"not a set")
    assert store.put(K, _block(None)) and store.children(PARENT) == [K]  # put repairs the children key
    store._client.sadd(store._kids(PARENT), b"zz", b"\xff\xfe", b"../" + K.hex().encode())
    assert store.children(PARENT) == [K] and store._client.scard(store._kids(PARENT)) == 1
    s = store.stats()
    assert s["errors"] == 0 and s["available"] == 1 and s["corrupt"] == 3


@pytest.mark.redis
def test_redis_value_over_the_cap_is_not_transferred(redis_url: str) -> None:  # noqa: F811
    store = RedisStore(redis_url, namespace="default", fingerprint=FP, max_entry_bytes=10_000)
    store._client.setrange(store._k(K), 50_000_000, b"x")  # a 50 MB value planted under our key
    # over the cap: never transferred or served (kept: an engine with longer chunks may own it)
    assert store.get(K) is None and store._client.exists(store._k(K))
    assert store.put(K, _block(None)) and store.get(K) is not None

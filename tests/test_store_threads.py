"""Eight threads hammering one TieredStore (memory + disk): no exceptions, every hit is what was put."""

from __future__ import annotations

import random
import threading
from pathlib import Path

from test_store_disk import FP, entry_files, key, make_block

from kvboost_core.store import DiskStore, MemoryStore, TieredStore

N_THREADS = 8
N_KEYS = 24
OPS = 250


def test_eight_threads_on_one_tiered_store(tmp_path: Path) -> None:
    # Each key always holds the same block, so any hit can be checked against make_block(i).
    blocks = [make_block(i, n=32, bits=(None, 8, 4)[i % 3], parent=key(1000 + i % 2)) for i in range(N_KEYS)]
    one = blocks[0].nbytes
    # budgets far below the working set: both tiers evict constantly while others read
    store = TieredStore([MemoryStore(6 * one), DiskStore(tmp_path, 12 * one, FP)])
    errors: list[BaseException] = []
    hits = [0] * N_THREADS
    start = threading.Barrier(N_THREADS)

    def worker(t: int) -> None:
        rng = random.Random(t)
        try:
            start.wait()
            for _ in range(OPS):
                i = rng.randrange(N_KEYS)
                op = rng.random()
                if op < 0.45:
                    store.put(key(i), blocks[i], pin=False)
                elif op < 0.9:
                    got = store.get(key(i))
                    if got is not None:
                        assert got.token_ids == blocks[i].token_ids and got.base_position == 3 * i
                        hits[t] += 1
                elif op < 0.95:
                    store.delete(key(i))
                else:
                    for child in store.children(key(1000 + i % 2)):
                        assert int.from_bytes(child, "big") % 2 == i % 2
                store.stats()
        except BaseException as e:  # noqa: B036 - surface anything from the thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors[0]
    assert sum(hits) > 0
    s = store.stats()
    assert s["memory.bytes"] <= s["memory.max_bytes"] and s["disk.bytes"] <= s["disk.max_bytes"]
    # the disk index agrees with the files, and every file left verifies
    fresh = DiskStore(tmp_path, 12 * one, FP)
    assert fresh.stats()["entries"] == len(entry_files(fresh))
    for i in range(N_KEYS):
        got = fresh.get(key(i))
        assert got is None or got.token_ids == blocks[i].token_ids
    assert fresh.stats()["corrupt"] == 0

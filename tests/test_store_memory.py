"""Memory tier: budget, pinning, importance eviction, namespaces, and a 10,000-operation property test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvboost_core.keys import CacheKey, Fingerprint
from kvboost_core.quant import quantize_payload
from kvboost_core.store import DensePayload, ImportancePolicy, KVBlock, LRUPolicy, MemoryStore
from kvboost_core.store.eviction import EntryMeta

FP = Fingerprint("f" * 32)


def key(i: int) -> CacheKey:
    return CacheKey(i.to_bytes(16, "big"))


def block(ids: tuple[int, ...], *, layers: int = 1, ns: str = "default", parent: CacheKey | None = None,
          dtype: torch.dtype = torch.float32) -> KVBlock:
    kv = torch.zeros(layers, 1, len(ids), 2, dtype=dtype)
    return KVBlock(token_ids=ids, payload=DensePayload(kv, kv.clone()), base_position=0, fingerprint=FP,
                   namespace=ns, parent=parent)


def test_put_get_children_stats() -> None:
    s = MemoryStore(10_000)
    p = key(99)
    assert s.put(key(1), block((1, 2, 3), parent=p))
    got = s.get(key(1))
    assert got is not None and got.token_ids == (1, 2, 3)
    assert s.children(p) == [key(1)] and s.contains(key(1))
    st_ = s.stats()
    assert st_["entries"] == 1 and st_["hits"] == 1 and st_["bytes"] <= st_["max_bytes"]
    assert s.delete(key(1)) and s.children(p) == [] and s.get(key(1)) is None


def test_put_that_cannot_fit_is_a_miss_not_an_error() -> None:
    b = block(tuple(range(10)))
    s = MemoryStore(b.nbytes - 1)
    assert s.put(key(1), b) is False
    s2 = MemoryStore(b.nbytes)
    s2.put(key(1), b, pin=True)
    assert s2.put(key(2), block(tuple(range(10)))) is False  # only the pinned entry fits
    assert s2.get(key(1)) is not None and s2.nbytes <= s2.max_bytes


def test_pinning_past_the_budget_is_a_value_error() -> None:
    b = block((1, 2))
    s = MemoryStore(int(b.nbytes * 1.5))
    s.put(key(1), b, pin=True)
    with pytest.raises(ValueError, match="pinn"):
        s.put(key(2), block((3, 4)), pin=True)
    with pytest.raises(ValueError):
        s.resize(b.nbytes - 1)  # below the pinned bytes
    # re-putting a pinned key with a block that no longer fits is a miss, and the superseded entry goes
    assert s.put(key(1), block(tuple(range(50)))) is False
    assert s.get(key(1)) is None and s.stats()["pinned_bytes"] == 0
    s.resize(b.nbytes - 1)
    assert s.nbytes == 0


def test_failed_replacement_drops_the_superseded_entry() -> None:
    """Found by the stateful test: a put that cannot fit must not leave the previous block served."""
    s = MemoryStore(block((1,)).nbytes)
    assert s.put(key(0), block((1,)))
    assert not s.put(key(0), block((1, 2, 3)))  # too big for the budget
    assert s.get(key(0)) is None and s.nbytes == 0


def test_namespace_mismatch() -> None:
    s = MemoryStore(10_000, namespace="a")
    with pytest.raises(ValueError):
        s.put(key(1), block((1,), ns="b"))
    assert s.get(key(1)) is None


def _meta(**kw: float) -> EntryMeta:
    base = {"key": key(0), "nbytes": 1000, "num_tokens": 100, "num_layers": 24, "hits": 0,
            "last_access": 100.0}
    base.update(kw)
    return EntryMeta(**base)  # type: ignore[arg-type]


def test_importance_policy_ordering() -> None:
    pol = ImportancePolicy(half_life_s=60.0)
    p = pol.priority
    assert p(_meta(hits=10)) > p(_meta(hits=0))  # frequency
    assert p(_meta(last_access=200.0)) > p(_meta(last_access=100.0))  # recency
    assert p(_meta(num_tokens=200)) > p(_meta(num_tokens=100))  # recompute cost
    assert p(_meta(nbytes=500)) > p(_meta(nbytes=1000))  # cheaper to keep
    # one doubling of hits is worth one half-life of idleness
    assert p(_meta(hits=1, last_access=40.0)) == pytest.approx(p(_meta(hits=0, last_access=100.0)), rel=1e-3)


def test_default_policy_keeps_quantized_and_hot_blocks() -> None:
    torch.manual_seed(0)
    n = 64
    dense = DensePayload(torch.randn(2, 1, n, 32), torch.randn(2, 1, n, 32))
    q = KVBlock(tuple(range(n)), quantize_payload(dense, 4), 0, FP, "default")
    d = KVBlock(tuple(range(n)), dense, 0, FP, "default")
    s = MemoryStore(d.nbytes + q.nbytes + 10)
    s.put(key(1), q)
    s.put(key(2), d)
    s.put(key(3), KVBlock(tuple(range(n)), quantize_payload(dense, 4), 0, FP, "default"))  # forces one out
    assert s.contains(key(1)) and not s.contains(key(2))  # same savings, more bytes: the dense one goes
    lru = MemoryStore(3 * block(tuple(range(4))).nbytes, LRUPolicy())
    for i in range(4):
        lru.put(key(i), block(tuple(range(4))))
    assert not lru.contains(key(0)) and lru.contains(key(3))


KEYS = st.integers(0, 11)


class MemoryMachine(RuleBasedStateMachine):
    """Random put/get/pin/unpin/delete/resize; the budget holds and a hit is always what was put last."""

    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryStore(2_000)
        self.model: dict[int, tuple[int, ...]] = {}  # what was last put under each key (may be evicted)

    @rule(k=KEYS, n=st.integers(0, 24), seed=st.integers(0, 10**6), pin=st.booleans())
    def put(self, k: int, n: int, seed: int, pin: bool) -> None:
        ids = tuple((seed + 7 * i) % 50_000 for i in range(n))
        try:
            ok = self.store.put(key(k), block(ids), pin=pin)
        except ValueError:
            assert pin  # only pinning may raise
            return
        if ok:
            self.model[k] = ids
        else:
            self.model.pop(k, None)

    @rule(k=KEYS)
    def get(self, k: int) -> None:
        got = self.store.get(key(k))
        if got is not None:
            assert got.token_ids == self.model[k]

    @rule(k=KEYS, pinned=st.booleans())
    def pin(self, k: int, pinned: bool) -> None:
        try:
            self.store.pin(key(k), pinned)
        except ValueError:
            assert pinned

    @rule(k=KEYS)
    def delete(self, k: int) -> None:
        self.store.delete(key(k))
        self.model.pop(k, None)

    @rule(budget=st.integers(0, 4_000))
    def resize(self, budget: int) -> None:
        try:
            self.store.resize(budget)
        except ValueError:
            assert budget < self.store.stats()["pinned_bytes"]

    @precondition(lambda self: self.store.nbytes > 0)
    @rule()
    def clear_some(self) -> None:
        self.store.resize(self.store.stats()["pinned_bytes"])  # evict every unpinned entry

    @invariant()
    def within_budget(self) -> None:
        s = self.store.stats()
        assert 0 <= s["pinned_bytes"] <= s["bytes"] <= s["max_bytes"]


TestMemoryMachine = MemoryMachine.TestCase
# ~105 runs x <=100 steps: about 10,000 random operations (some runs end early)
TestMemoryMachine.settings = settings(max_examples=105, stateful_step_count=100, deadline=None,
                                      suppress_health_check=list(HealthCheck), derandomize=True)

"""Two tenants and two models sharing one Redis server or one disk root: names that cannot act as globs or
paths, clears that touch only their own entries, and forged entries that are misses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from _redis_fixture import RedisServer, redis_server, redis_url  # noqa: F401
from test_store_disk import FP, entry_files, entry_path, key, make_block, same

from kvboost_core.config import EngineConfig
from kvboost_core.store import DiskStore, MemoryStore, RedisStore, TieredStore, build_store, redis_tier
from kvboost_core.store.redis_tier import glob_escape
from kvboost_core.store.serialize import dumps

BAD_NAMESPACES = ["*", "tenant?", "[t]enantA", "", "a/b", "..", ".", ".hidden", "a:b", "a b", "x" * 65, "é",
                  "tenant\\A", "a\nb", None, 5, b"tenantA"]
SECRET_A = b"deployment-secret-A"


@pytest.mark.parametrize("ns", BAD_NAMESPACES)
def test_bad_namespaces_are_refused_everywhere(ns: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="namespace"):
        EngineConfig(namespace=ns)  # type: ignore[arg-type]
    if ns is not None:  # None is the memory tier's "any namespace"
        with pytest.raises(ValueError, match="namespace"):
            MemoryStore(100, namespace=ns)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        DiskStore(tmp_path, 100, FP, namespace=ns)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        RedisStore("redis://127.0.0.1:1/0", namespace=ns, fingerprint=FP)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        build_store(f"disk:{tmp_path}", max_bytes=100, fingerprint=FP, namespace=ns)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # nothing was created on the way to the error


@pytest.mark.parametrize("ns", ["tenantA", "tenant-b", "t_1.2", "A" * 64, "0"])
def test_good_namespaces(ns: str) -> None:
    assert EngineConfig(namespace=ns).namespace == ns


def test_store_secret_is_repr_hidden_and_typed() -> None:
    cfg = EngineConfig(store_secret="s3cret-value")
    assert "s3cret-value" not in repr(cfg) and cfg.store_secret == "s3cret-value"
    for bad in ("", b"", 5):
        with pytest.raises(ValueError, match="store_secret"):
            EngineConfig(store_secret=bad)  # type: ignore[arg-type]


def test_glob_escape_matches_only_the_literal(redis_url: str) -> None:  # noqa: F811
    c = redis.Redis.from_url(redis_url)
    literals = ["a*b", "a?b", "a[b]c", "a\\b", "a]b"]
    for k in [*literals, "axb", "aXXb", "abc", "a\\\\b", "ab"]:
        c.set(k, b"1")
    for lit in literals:
        assert sorted(c.scan_iter(match=glob_escape(lit))) == [lit.encode()]


# -- Redis: two tenants -----------------------------------------------------------------------------------
def _fill(store: RedisStore | DiskStore, ns: str, n: int = 4) -> None:
    for i in range(n):
        assert store.put(key(i), make_block(i, ns=ns, parent=key(100)))


def _hits(store: RedisStore | DiskStore, ns: str, n: int = 4) -> int:
    got = [store.get(key(i)) for i in range(n)]
    return sum(g is not None and same(g, make_block(i, ns=ns, parent=key(100))) for i, g in enumerate(got))


def test_redis_clear_of_one_tenant_keeps_the_other(redis_url: str) -> None:  # noqa: F811
    a = RedisStore(redis_url, namespace="tenantA", fingerprint=FP, secret=SECRET_A)
    b = RedisStore(redis_url, namespace="tenantB", fingerprint=FP, secret=SECRET_A)
    ab = RedisStore(redis_url, namespace="tenant", fingerprint=FP, secret=SECRET_A)  # a prefix of both names
    _fill(a, "tenantA")
    _fill(b, "tenantB")
    _fill(ab, "tenant")
    b.clear()
    ab.clear()
    assert _hits(a, "tenantA") == 4 and a.children(key(100)) == [key(i) for i in range(4)]
    assert _hits(b, "tenantB") == 0 and _hits(ab, "tenant") == 0
    # even if a prefix held glob metacharacters (names cannot), clear would match it literally
    b._prefix = "kvboost:*:"
    b.clear()
    assert _hits(a, "tenantA") == 4


def test_redis_forged_entries_are_misses_and_unlinked(redis_url: str) -> None:  # noqa: F811
    """Forgeries are never served. Those that may be another reader's (an intact unkeyed entry, a MAC under
    another secret) are skipped and left in place; those that cannot be anyone's are unlinked."""
    a = RedisStore(redis_url, namespace="tenantA", fingerprint=FP, secret=SECRET_A)
    b = RedisStore(redis_url, namespace="tenantB", fingerprint=FP, secret=b"tenant-B-secret")
    forgeries = {
        "no secret": (dumps(key(1), make_block(1, ns="tenantA")), True),
        "another secret": (dumps(key(1), make_block(1, ns="tenantA"), secret=b"tenant-B-secret"), True),
        "a B entry copied to A's key": (dumps(key(1), make_block(1, ns="tenantB"), secret=SECRET_A), False),
    }
    for why, (data, kept) in forgeries.items():
        a._client.set(a._k(key(1)), data)
        assert a.get(key(1)) is None, why
        assert bool(a._client.exists(a._k(key(1)))) == kept, why
    assert b.put(key(2), make_block(2, ns="tenantB"))
    a._client.copy(b._k(key(2)), a._k(key(2)))  # B's genuine entry under A's key
    assert a.get(key(2)) is None and b.get(key(2)) is not None
    assert a.stats()["corrupt"] == 2 and a.stats()["skipped"] == 2
    assert a.put(key(1), make_block(1, ns="tenantA"))
    got = a.get(key(1))
    assert got is not None and same(got, make_block(1, ns="tenantA"))  # the genuine writer still works


def test_redis_without_secret_warns_once(redis_url: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KVBOOST_STORE_SECRET", raising=False)
    monkeypatch.setattr(redis_tier, "_warned_no_secret", False)
    caplog.set_level(logging.WARNING, logger="kvboost")
    RedisStore(redis_url, namespace="tenantA", fingerprint=FP)
    RedisStore(redis_url, namespace="tenantB", fingerprint=FP)
    RedisStore(redis_url, namespace="tenantC", fingerprint=FP, secret=SECRET_A)
    assert len([r for r in caplog.records if "not authenticated" in r.getMessage()]) == 1


def test_secret_from_env_through_build_store(redis_url: str, tmp_path: Path,  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBOOST_STORE_SECRET", SECRET_A.decode())
    kw = {"max_bytes": 10**6, "fingerprint": FP, "namespace": "tenantA"}
    env_store = build_store([f"disk:{tmp_path}", redis_url], **kw)
    assert isinstance(env_store, TieredStore) and env_store.put(key(1), make_block(1, ns="tenantA"))
    explicit = build_store([f"disk:{tmp_path}", redis_url], secret=SECRET_A, **kw)
    assert explicit.get(key(1)) is not None
    monkeypatch.delenv("KVBOOST_STORE_SECRET")
    for spec in (f"disk:{tmp_path}", redis_url):  # no secret: the keyed entries are not accepted
        assert build_store(spec, **kw).get(key(1)) is None


# -- disk: two tenants and two models under one root -------------------------------------------------------
def test_disk_clear_of_one_tenant_keeps_the_other(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, 10**7, FP, namespace="tenantA")
    b = DiskStore(tmp_path, 10**7, FP, namespace="tenantB")
    _fill(a, "tenantA")
    _fill(b, "tenantB")
    b.clear()
    assert _hits(DiskStore(tmp_path, 10**7, FP, namespace="tenantA"), "tenantA") == 4
    assert len(entry_files(a)) == 4 and entry_files(b) == []
    assert sorted(DiskStore(tmp_path, 10**7, FP, namespace="tenantA").children(key(100))) == [
        key(i) for i in range(4)]


def test_disk_second_model_keeps_the_first_models_entries(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 10**8, FP)
    for i in range(40):
        assert first.put(key(i), make_block(i))
    second_fp = "cd" * 16
    second = DiskStore(tmp_path, 10**8, second_fp)  # opens the same root: must not touch the first model
    assert second.stats()["entries"] == 0 and second.get(key(1)) is None
    assert second.put(key(1), make_block(1, fp=second_fp))
    second.clear()
    reopened = DiskStore(tmp_path, 10**8, FP)
    assert reopened.stats()["entries"] == 40
    assert all(reopened.get(key(i)) is not None for i in range(40))


def test_disk_forged_entries_are_misses_and_deleted(tmp_path: Path) -> None:
    """Never served; deleted unless they may be another reader's (unkeyed and intact, or keyed otherwise)."""
    a = DiskStore(tmp_path, 10**7, FP, namespace="tenantA", secret=SECRET_A)
    b = DiskStore(tmp_path, 10**7, FP, namespace="tenantB", secret=SECRET_A)
    assert a.put(key(1), make_block(1, ns="tenantA")) and b.put(key(1), make_block(1, ns="tenantB"))
    path = entry_path(a, key(1))
    forgeries = {
        "no secret": (dumps(key(1), make_block(1, ns="tenantA")), True),
        "another secret": (dumps(key(1), make_block(1, ns="tenantA"), secret=b"other"), True),
        "B's genuine file": (entry_path(b, key(1)).read_bytes(), False),
    }
    for why, (data, kept) in forgeries.items():
        path.write_bytes(data)
        assert a.get(key(1)) is None, why
        assert path.exists() == kept, why
    assert a.stats()["corrupt"] == 1 and a.stats()["skipped"] == 2 and b.get(key(1)) is not None


def test_disk_refuses_paths_outside_its_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        DiskStore(tmp_path, 100, "../escape")
    with pytest.raises(ValueError, match="namespace"):
        DiskStore(tmp_path, 100, FP, namespace="..")
    store = DiskStore(tmp_path / "root", 100, FP, namespace="tenantA")
    assert store.directory == tmp_path / "root" / FP / "tenantA"

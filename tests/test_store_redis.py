"""Redis tier against a real redis-server: cross-process hits, outages, namespaces, TTL, children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from _redis_fixture import RedisServer, redis_server, redis_url  # noqa: F401
from test_store_disk import FP, key, make_block, same

from kvboost_core.store import RedisStore, TieredStore, build_store
from kvboost_core.store.redis_tier import REQUIRED_COMMANDS, RedisClearError
from kvboost_core.store.serialize import dumps

pytestmark = pytest.mark.redis
REPO = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_store_disk import FP, key, make_block
    from kvboost_core.store import RedisStore
    s = RedisStore({url!r}, namespace="default", fingerprint=FP)
    for i in range({n}):
        assert s.put(key(i), make_block(i, bits=(None, 8, 4)[i % 3], parent=key(1000)))
""")


def test_hit_across_processes(redis_url: str) -> None:  # noqa: F811
    n = 12
    code = WRITER.format(tests=str(Path(__file__).parent), url=redis_url, n=n)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    s = RedisStore(redis_url, namespace="default", fingerprint=FP)
    for i in range(n):
        got = s.get(key(i))
        assert got is not None and same(got, make_block(i, bits=(None, 8, 4)[i % 3], parent=key(1000)))
    assert sorted(s.children(key(1000))) == [key(i) for i in range(n)]
    assert s.stats()["hits"] == n
    assert s.delete(key(0)) and key(0) not in s.children(key(1000))  # the SET is cleaned lazily


def test_server_stopped_mid_run_degrades_to_misses(redis_server: RedisServer) -> None:  # noqa: F811
    s = RedisStore(redis_server.url, namespace="default", fingerprint=FP, retry_after_s=0.0)
    assert s.put(key(1), make_block(1)) and s.get(key(1)) is not None
    redis_server.stop()
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert s.get(key(1)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per outage, not one per call
        assert s.put(key(2), make_block(2)) is False
        assert s.get(key(1)) is None and not s.contains(key(1)) and not s.delete(key(1))
        assert s.children(key(1)) == []
        with pytest.raises(RedisClearError, match="clear"):  # an explicit clear must not look like it worked
            s.clear()
    assert s.stats()["errors"] >= 5


def test_server_hanging_times_out(redis_server: RedisServer) -> None:  # noqa: F811
    s = RedisStore(redis_server.url, namespace="default", fingerprint=FP, socket_timeout=0.3)
    assert s.put(key(1), make_block(1))
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning):
            assert s.get(key(1)) is None
        assert s.put(key(2), make_block(2)) is False  # down: answered at once, no second timeout
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_namespace_isolation(redis_url: str) -> None:  # noqa: F811
    a = RedisStore(redis_url, namespace="tenant-a", fingerprint=FP)
    b = RedisStore(redis_url, namespace="tenant-b", fingerprint=FP)
    assert a.put(key(1), make_block(1, ns="tenant-a"))
    assert b.get(key(1)) is None and not b.contains(key(1))
    with pytest.raises(ValueError):
        b.put(key(2), make_block(2, ns="tenant-a"))
    # even an entry planted under B's prefix is refused when the block says it is A's
    b._client.set(b._k(key(3)), dumps(key(3), make_block(3, ns="tenant-a")))
    assert b.get(key(3)) is None
    b.clear()
    assert a.get(key(1)) is not None  # B's clear never touches A
    other_model = RedisStore(redis_url, namespace="tenant-a", fingerprint="cd" * 16)
    assert other_model.get(key(1)) is None


def test_ttl_expiry(redis_url: str) -> None:  # noqa: F811
    s = RedisStore(redis_url, namespace="default", fingerprint=FP, ttl_s=0.4)
    assert s.put(key(1), make_block(1, parent=key(9)))
    assert s.get(key(1)) is not None and s.children(key(9)) == [key(1)]
    time.sleep(0.6)
    assert s.get(key(1)) is None and s.children(key(9)) == []


def test_factory_builds_three_tiers(redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    store = build_store([f"{redis_url}?ttl=60", f"disk:{tmp_path}"], max_bytes=1_000_000, fingerprint=FP,
                        namespace="default")
    assert isinstance(store, TieredStore)
    assert [type(t).__name__ for t in store.tiers] == ["MemoryStore", "DiskStore", "RedisStore"]
    assert store.put(key(1), make_block(1))
    fresh = build_store([redis_url], max_bytes=1_000_000, fingerprint=FP, namespace="default")
    got = fresh.get(key(1))  # served by redis, promoted into the new memory tier
    assert got is not None and fresh.stats()["redis.served"] == 1 and fresh.tiers[0].contains(key(1))


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://:s3cret-pw@10.0.0.5:6380/2", "redis://***@10.0.0.5:6380/2"),
    ("rediss://alice:s3cret-pw@cache.example:6379/0?ttl=60", "rediss://***@cache.example:6379/0?ttl=60"),
    ("redis://10.0.0.5:6379/0?password=s3cret-pw&db=1", "redis://10.0.0.5:6379/0?password=***&db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_mask_url(url: str, masked: str) -> None:
    from kvboost_core.store.redis_tier import mask_url, scrub, url_secrets

    assert mask_url(url) == masked
    assert "s3cret-pw" not in scrub(f"error talking to {url}", url_secrets(url))


def test_credentials_never_reach_logs_or_warnings(redis_server: RedisServer, caplog) -> None:  # noqa: F811
    """A password in the URL: the outage warning names the server as redis://***@host:port/db; neither the
    warning, the log, nor the message of a bad URL carries the password (or the user name)."""
    from _redis_fixture import free_port

    secret = "s3cret-pw-9271"
    port = free_port()  # nothing listens: every call fails
    caplog.set_level("DEBUG", logger="kvboost")
    s = RedisStore(f"redis://carol:{secret}@127.0.0.1:{port}/0", namespace="default", fingerprint=FP)
    with pytest.warns(RuntimeWarning) as warned:
        assert s.get(key(1)) is None
    texts = [str(w.message) for w in warned] + [r.getMessage() for r in caplog.records]
    assert any(f"redis://***@127.0.0.1:{port}/0" in t for t in texts), texts
    assert not any(secret in t or "carol" in t for t in texts), texts
    # a real server refusing the credentials (redis-py's AuthenticationError text goes through the scrub too)
    caplog.clear()
    r = RedisStore(redis_server.url.replace("redis://", f"redis://carol:{secret}@"), namespace="default",
                   fingerprint=FP)
    with pytest.warns(RuntimeWarning) as warned:
        assert r.put(key(2), make_block(2)) is False
    texts = [str(w.message) for w in warned] + [r.getMessage() for r in caplog.records]
    assert texts and not any(secret in t for t in texts), texts
    with pytest.raises(ValueError) as bad:
        RedisStore(f"redis://carol:{secret}@127.0.0.1:notaport/0", namespace="default", fingerprint=FP)
    assert secret not in str(bad.value) and "***@" in str(bad.value)


# -- ACL users and explicit clears (issue 26) ----------------------------------------------------------------
def _user(redis_server: RedisServer, name: str, *rules: str) -> str:  # noqa: F811
    import redis

    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw-secret-1", "~kvboost:*", *rules)
    return f"redis://{name}:pw-secret-1@127.0.0.1:{redis_server.port}/0"


def test_user_without_eval_is_refused_at_start_naming_the_commands(redis_server: RedisServer) -> None:  # noqa: F811
    url = _user(redis_server, "noeval", "+@all", "-eval", "-evalsha")
    with pytest.raises(PermissionError, match="EVAL") as err:
        RedisStore(url, namespace="default", fingerprint=FP)
    assert "pw-secret-1" not in str(err.value)
    assert all(c in str(err.value) for c in REQUIRED_COMMANDS)  # the whole list, to fix the ACL in one go
    url = _user(redis_server, "nostrlen", "+@all", "-strlen")  # refused inside the tier's Lua script
    with pytest.raises(PermissionError, match="may not run STRLEN, GET;"):
        RedisStore(url, namespace="default", fingerprint=FP)


def test_the_documented_commands_are_enough(redis_server: RedisServer) -> None:  # noqa: F811
    rules = ["+" + c.lower().replace(" ", "|") for c in REQUIRED_COMMANDS]
    s = RedisStore(_user(redis_server, "minimal", *rules), namespace="default", fingerprint=FP)
    assert s.put(key(1), make_block(1, parent=key(9))) and s.put(key(2), make_block(2, parent=key(9)))
    got = s.get(key(1))
    assert got is not None and same(got, make_block(1, parent=key(9)))
    assert s.contains(key(1)) and sorted(s.children(key(9))) == [key(1), key(2)]
    s._client.set(s._k(key(3)), b"junk")
    assert s.get(key(3)) is None and not s._client.exists(s._k(key(3)))  # the compare-and-delete script
    assert s.delete(key(2))
    s.clear()
    assert s.get(key(1)) is None and s.stats()["errors"] == 0


def test_clear_in_the_down_window_still_tries_and_succeeds(redis_server: RedisServer) -> None:  # noqa: F811
    s = RedisStore(redis_server.url, namespace="default", fingerprint=FP, retry_after_s=60.0)
    assert s.put(key(1), make_block(1))
    s._down_until = time.monotonic() + 60  # as after a blip: requests answer misses without asking
    s.clear()
    assert not s._client.exists(s._k(key(1)))

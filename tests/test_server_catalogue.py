"""The shared document catalogue (kvboost_rag.app.server.catalogue) against a real redis-server: bounded per
namespace (entries and bytes, oldest evicted, readers' positions survive evictions) and per namespace (one
tenant never reads another's texts, and one tenant's evictions never touch another's)."""

from __future__ import annotations

import argparse

import pytest
from _redis_fixture import redis_server, redis_url  # noqa: F401

pytest.importorskip("redis")
pytestmark = pytest.mark.redis


def _cat(url: str, **kw):
    from kvboost_rag.app.server.catalogue import DocumentCatalogue

    return DocumentCatalogue(url, "fp1", **kw)


def test_entries_bound_evicts_oldest_and_readers_keep_their_place(redis_url):  # noqa: F811
    a, b = _cat(redis_url, max_entries=3), _cat(redis_url, max_entries=3)
    assert a.publish("default", ["d1", "d2"]) == 2
    assert b.pull("default") == ["d1", "d2"]  # b has read up to d2
    assert a.publish("default", ["d3", "d4", "d5"]) == 3  # d1 and d2 evicted
    assert a.stats("default") == {"entries": 3, "bytes": a.stats("default")["bytes"], "evicted": 2}
    assert b.pull("default") == ["d3", "d4", "d5"]  # no text skipped, none repeated
    assert _cat(redis_url).pull("default") == ["d3", "d4", "d5"]  # a new process sees only what is kept
    assert a.publish("default", ["d1"]) == 1  # evicted texts may be published again
    assert b.pull("default") == ["d1"]


def test_bytes_bound_and_oversized_documents(redis_url):  # noqa: F811
    cat = _cat(redis_url, max_bytes=200)
    entry = 32 + 1 + 50  # doc key (32 hex) + newline + text
    texts = [c * 50 for c in "abc"]
    assert cat.publish("default", texts) == 3
    st = cat.stats("default")
    assert st == {"entries": 2, "bytes": 2 * entry, "evicted": 1}  # 3 x 83 > 200: the oldest went
    assert _cat(redis_url).pull("default") == texts[1:]
    assert cat.publish("default", ["z" * 300]) == 0  # larger than the bound alone: not shared, nothing evicted
    assert cat.stats("default") == st


def test_namespaces_never_see_each_others_texts(redis_url):  # noqa: F811
    a, b = _cat(redis_url, max_entries=2), _cat(redis_url, max_entries=2)
    a.publish("tenant-a", ["secret of a"])
    b.publish("tenant-b", ["b1", "b2", "b3"])  # b's evictions ...
    assert b.pull("tenant-a") == ["secret of a"]  # ... never touch a's texts
    assert a.pull("tenant-b") == ["b2", "b3"] and a.pull("tenant-a") == ["secret of a"]
    assert _cat(redis_url).pull("tenant-c") == []
    for bad in ("*", "tenant-a:x", "", ".."):  # a namespace that could be a glob or another tenant's key part
        with pytest.raises(ValueError, match="namespace"):
            a.pull(bad)
        with pytest.raises(ValueError, match="namespace"):
            a.publish(bad, ["x"])


def test_bounds_validation_and_cli(redis_url):  # noqa: F811
    from kvboost_rag.app.server import main as server_main
    from kvboost_rag.app.server.factory import catalogue_bounds

    for kw in ({"max_entries": 0}, {"max_bytes": -1}, {"max_entries": True}, {"max_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            _cat(redis_url, **kw)
    p = argparse.ArgumentParser()
    server_main.add_arguments(p)
    args = p.parse_args(["--catalogue-max-docs", "50", "--catalogue-max-bytes", "1MiB"])
    assert catalogue_bounds(args) == {"max_entries": 50, "max_bytes": 1024**2}
    assert catalogue_bounds(p.parse_args([])) == {}
    with pytest.raises(SystemExit):
        p.parse_args(["--catalogue-max-bytes", "0"])
    help_text = p.format_help()
    assert "--catalogue-max-docs" in help_text and "oldest evicted first" in help_text

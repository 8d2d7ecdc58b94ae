"""Bench workload A with the optional PyPI peer ``kvboost`` (0.9.0): it runs beside our methods when
installed, its failures are recorded rather than raised, and without it the workload runs and says why."""

from __future__ import annotations

import sys

import pytest

from kvboost_rag.app.bench.peer import SKIP_REASON, peer_chunk_size

OURS = {"full", "prefix_cache", "cold", "none", "selective", "cacheblend", "exact_repeat"}


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model gains nothing from more threads, and one keeps these tests quick on a busy machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_tok():
    from kvboost_rag.app.bench.ttft import build_model

    return build_model("tiny", layers=2)


@pytest.fixture
def engine(model_tok):
    """A fresh engine (empty store) per test, on a shared model."""
    from kvboost_core.engine import KVEngine

    return KVEngine(*model_tok, max_cache_bytes="256MiB")


def _run(engine, sizes=(2,)):
    from kvboost_rag.app.bench.ttft import workload_a

    return workload_a(engine, list(sizes), rounds=1, doc_tokens=64, question_tokens=8)


def _ours_ok(out, sizes):
    for n in sizes:
        methods = out["sizes"][str(n)]["methods"]
        assert OURS <= set(methods)
        assert all(methods[m]["ttft_median_s"] > 0 for m in OURS)
        assert methods["cold"]["reuse_ratio"] == 0 and methods["exact_repeat"]["reuse_ratio"] > 0.9
        assert methods["cacheblend"]["reuse_ratio"] > 0.5 and "top1_agree" in methods["cacheblend"]


def test_chunk_size_fills_preamble_and_documents():
    assert peer_chunk_size(32, 512) == 32 and peer_chunk_size(128, 512) == 128
    assert peer_chunk_size(256, 1024) == 128  # capped at its own default
    assert peer_chunk_size(32, 64) == 32 and peer_chunk_size(33, 512) == 1


def test_peer_runs_beside_ours(engine):
    pytest.importorskip("kvboost")
    out = _run(engine, (2, 4))
    _ours_ok(out, (2, 4))
    peer = out["peer"]
    assert isinstance(peer, dict) and peer["method"].startswith("kvboost-")
    if "error" in peer:  # a failure on this setup is a result: recorded, never raised
        assert isinstance(peer["error"], str) and peer["error"]
        return
    name = peer["method"]
    assert peer["mode"] == "chunk_kv_reuse" and peer["recompute_strategy"] == "cacheblend"
    assert peer["warm_s"] > 0 and "cache_hits" in peer["cache_stats"]
    for n in ("2", "4"):
        entry = out["sizes"][n]
        s = entry["methods"][name]
        assert s["ttft_median_s"] > 0 and s["speedup_vs_full"] > 0 and 0 <= s["top1_agree"] <= 1
        assert s["reuse_ratio"] > 0.5  # the warmed documents were found (documents start on chunk boundaries)
        assert s["reported_ttft_median_s"] < s["ttft_median_s"]  # its own figure leaves the repair out
        ratio = s["ttft_median_s"] / entry["methods"]["cacheblend"]["ttft_median_s"]
        assert entry["ours_cacheblend_vs_peer_cacheblend"] == pytest.approx(ratio)
        assert out["ours_cacheblend_vs_peer_cacheblend"][n] == pytest.approx(ratio)


def test_peer_failure_is_recorded(engine, monkeypatch):
    pytest.importorskip("kvboost")
    from kvboost_rag.app.bench import peer as bench_peer

    def boom(self, text, ids):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(bench_peer.Peer, "first_token", boom)
    out = _run(engine)
    _ours_ok(out, (2,))
    assert out["peer"]["error"].endswith("RuntimeError: simulated failure")
    assert not any(m.startswith("kvboost-") for m in out["sizes"]["2"]["methods"])
    assert "ours_cacheblend_vs_peer_cacheblend" not in out


def test_without_kvboost_the_workload_records_the_skip(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvboost", None)  # `import kvboost` now raises ImportError
    out = _run(engine)
    _ours_ok(out, (2,))
    assert out["peer"] == SKIP_REASON == "kvboost not installed (pip install 'kvboost-rag[bench]')"
    assert set(out["sizes"]["2"]["methods"]) == OURS
    assert "ours_cacheblend_vs_peer_cacheblend" not in out["sizes"]["2"]

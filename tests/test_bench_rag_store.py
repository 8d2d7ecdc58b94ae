"""bench rag refuses to measure reuse arms over a store that evicted the split's documents while warming them:
an evicted document is computed, not reused, and the block arm would then not be block reading at all (found on
dev2's 384 documents under the default 2 GiB budget)."""

from __future__ import annotations

import pytest

from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.bench import rag as bench_rag


def test_evictions_are_summed_through_nested_tier_stats():
    assert bench_rag._evictions({"evictions": 2, "tiers": [{"evictions": 1}], "disk": {"evictions": 3}}) == 5
    assert bench_rag._evictions({"entries": 4}) == 0


@pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is missing")
def test_a_store_too_small_for_the_split_stops_the_run():
    from kvboost_core.engine import KVEngine
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.loading import load_engine

    demo = load_engine("demo").engine
    small = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, demo.config.with_(max_cache_bytes=2_000_000, auto_calibrate=False)))
    with pytest.raises(RuntimeError, match="evicted .* --cache-bytes"):
        bench_rag.run(small, "tune", 4, 1, {}, 2)
    roomy = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, demo.config.with_(auto_calibrate=False)))
    assert bench_rag.run(roomy, "tune", 4, 1, {}, 2)["questions"] == 1

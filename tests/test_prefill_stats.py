"""A prefill's stats are one typed value (issue 34, item 3): kvboost_core.results.PrefillStats, whose counts
partition the prompt, with a read-only mapping view for the flat reports built on it."""

from __future__ import annotations

import dataclasses

import pytest

from kvboost_core import Segment, cache_counts
from kvboost_core.engine import KVEngine
from kvboost_core.results import PrefillStats
from kvboost_rag.tiny import tiny_model_and_tokenizer

DOCS = ["Alice was born in Portvale and works as a chemist.", "The capital of Norland is Essberg, a harbour."]


@pytest.fixture(scope="module")
def engine() -> KVEngine:
    eng = KVEngine(*tiny_model_and_tokenizer(), chunk_size=16, boundary_window=4, sink_tokens=2)
    eng.warm(DOCS)
    return eng


def test_a_prefill_returns_typed_stats_whose_counts_partition_the_prompt(engine: KVEngine) -> None:
    prompt = [Segment(text=d, cacheable=True) for d in reversed(DOCS)] + [Segment(text=" Who is Alice?")]
    for repair in ("none", "cacheblend", "full"):
        st = engine.prefill(prompt, repair=repair, store_prefix=False).stats
        assert isinstance(st, PrefillStats) and st.repair == repair
        parts = st.reused_exact + st.reused_block + st.reused_approx + st.reused_repaired + st.recomputed + st.computed
        assert parts == st.prompt_tokens == len(engine.tokenize_ids(prompt))
        assert st.prefill_s >= st.forward_s > 0 and len(st.tokens_per_layer) == engine.driver.num_layers
    assert st.recomputed > 0 and st.reused_approx == 0  # full: every re-placed token computed again


def test_the_mapping_view_reads_as_the_flat_reports_expect(engine: KVEngine) -> None:
    st = engine.prefill("one two three four", store_prefix=False).stats
    flat = dict(st)
    assert flat == st.as_dict() and flat["prompt_tokens"] == st.prompt_tokens == st["prompt_tokens"]
    assert "canonical_prefix_tokens" not in flat and st.get("canonical_prefix_tokens", -1) == -1  # None: absent
    with pytest.raises(KeyError):
        st["cached_tokens"]  # not a field: read cached tokens through cache_counts
    assert cache_counts(st) == cache_counts(flat)
    assert {f.name for f in dataclasses.fields(PrefillStats)} >= set(flat)

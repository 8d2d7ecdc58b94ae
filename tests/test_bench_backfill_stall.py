"""The backfill-stall benchmark's pure parts (issue 33): its summary and table. The run itself is a benchmark
(benchmarks/bench_backfill_stall.py); its check on the demo model runs below only where the demo model is."""

from __future__ import annotations

import pytest

from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.bench import backfill_stall as bs


def _row(extra: float, pending: bool, longest: float) -> dict:
    return {"delay_s": 0.2, "idle_ttft_s": 1.0, "during_ttft_s": 1.0 + extra, "extra_s": extra,
            "backfill_pending": pending, "steps": 3, "max_step_s": longest, "step_s_mean": longest / 2,
            "backfill_tokens": 900, "backfill_computed": 880, "backfill_cpu_s": 1.0}


def test_summary_counts_only_rounds_that_arrived_mid_backfill():
    s = bs.summarize([_row(0.3, True, 0.5), _row(0.1, True, 0.5), _row(9.0, False, 0.5)])
    assert s["rounds"] == 3 and s["rounds_mid_backfill"] == 2
    assert s["extra_s_max"] == 0.3 and s["within_one_step"] is True
    assert bs.summarize([_row(0.6, True, 0.5)])["within_one_step"] is False  # it can fail
    table = bs.markdown_table({"rows": [_row(0.6, True, 0.5)], "summary": bs.summarize([_row(0.6, True, 0.5)])})
    assert "MORE than one step" in table and "+0.60 s" in table


@pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is missing")
def test_the_benchmark_runs_on_the_demo_model(tmp_path):
    out = tmp_path / "stall.json"
    assert bs.main(["--model", "demo", "--chat-k", "4", "--probe-k", "2", "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert len(result["rows"]) == len(bs.DELAYS) and all(r["steps"] >= 1 for r in result["rows"])
    assert any(r["backfill_pending"] for r in result["rows"])

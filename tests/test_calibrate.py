"""Per-model CacheBlend calibration: the search, the kvboost.json defaults file, and the shipped calibration."""

from __future__ import annotations

import json

import pytest
import torch

from kvboost_core import Segment
from kvboost_core.engine import KVEngine
from kvboost_core.tuning.calibrate import DEFAULTS_FILE, calibrate, cost, grid, load_defaults, save_defaults
from kvboost_rag.app import demo_data as dd


@pytest.fixture(scope="module")
def tiny():
    from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer(layers=4)
    facts = synthetic_facts(6)
    eng = KVEngine(model, tok, sink_tokens=2)
    eng.warm(facts)
    # documents re-placed in a new order: their cached KV misses their new neighbours
    prompts = [[Segment(text=f, cacheable=True) for f in order] + [Segment(text=" Who is it?")]
               for order in (facts[3::-1], facts[5:1:-1])]
    return eng, prompts, model, tok


def test_grid_is_cheapest_first_and_below_the_last_layer():
    g = grid(4)
    costs = [cost(c, r, 4) for c, r in g]
    assert costs == sorted(costs)
    assert g[0] == (1, 0.15)  # the engine default is the cheapest setting tried
    assert all(1 <= c <= 2 for c, _ in g)  # check layer 3 of 4 would recompute every layer
    assert cost(1, 0.15, 24) == pytest.approx((1 + 0.15 * 23) / 24)


def test_grid_reaches_the_ratios_a_model_may_need():
    """SmolLM2 needs r=0.7; a grid stopping at 0.5 could never choose it. 1.0 (full recompute) once."""
    g = grid(30)
    assert {0.7, 1.0} <= {r for _, r in g}
    assert [p for p in g if p[1] == 1.0] == [(1, 1.0)]
    assert g[-1] == (1, 1.0)  # the dearest


def test_save_defaults_refuses_a_missed_target(tmp_path):
    from kvboost_core.tuning.calibrate import Calibration

    missed = Calibration(0.5, 1, False, 0.01, 0.95, ())
    with pytest.raises(ValueError, match="no setting met the target"):
        save_defaults(tmp_path, missed)
    assert not (tmp_path / DEFAULTS_FILE).exists()


def test_loose_target_stops_at_the_cheapest_setting(tiny):
    eng, prompts, *_ = tiny
    cal = calibrate(eng, prompts, max_kl=1e9, min_top1=0.0)
    assert cal.met and (cal.check_layer, cal.recompute_ratio) == grid(4)[0] and len(cal.trials) == 1


def test_unreachable_target_returns_the_lowest_kl_and_says_so(tiny):
    eng, prompts, *_ = tiny
    cal = calibrate(eng, prompts, max_kl=0.0, min_top1=1.0, settings=[(1, 0.15), (2, 0.5)])
    assert not cal.met and len(cal.trials) == 2
    best = min(cal.trials, key=lambda t: t.mean_kl)
    assert (cal.check_layer, cal.recompute_ratio) == (best.check_layer, best.recompute_ratio)
    # more recomputation is closer to full prefill: the search has something real to trade
    assert cal.trials[1].mean_kl < cal.trials[0].mean_kl
    assert cal.trials[1].recomputed_share > cal.trials[0].recomputed_share


def test_bad_arguments(tiny):
    eng, prompts, *_ = tiny
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate(eng, [])
    with pytest.raises(ValueError, match="max_kl"):
        calibrate(eng, prompts, max_kl=-1)


def test_defaults_file_round_trip_and_from_pretrained(tiny, tmp_path):
    eng, prompts, model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert load_defaults(tmp_path) == {}
    cal = calibrate(eng, prompts, max_kl=1e9, min_top1=0.0, settings=[(2, 0.3)])
    path = save_defaults(tmp_path, cal)
    assert path.name == DEFAULTS_FILE and json.loads(path.read_text())["calibration"]["met"] is True
    loaded = KVEngine.from_pretrained(str(tmp_path), device="cpu")
    assert (loaded.config.check_layer, loaded.config.recompute_ratio) == (2, 0.3)
    explicit = KVEngine.from_pretrained(str(tmp_path), device="cpu", recompute_ratio=0.2)  # arguments win
    assert (explicit.config.check_layer, explicit.config.recompute_ratio) == (2, 0.2)


@pytest.mark.parametrize("body,match", [("{not json", "not valid JSON"), ('{"engine": 3}', "'engine' object"),
                                        ('{"engine": {"store": "disk:/x"}}', "unsupported engine settings")])
def test_bad_defaults_file_is_a_clear_error(tmp_path, body, match):
    (tmp_path / DEFAULTS_FILE).write_text(body)
    with pytest.raises(ValueError, match=match):
        load_defaults(tmp_path)


@pytest.mark.skipif(not (dd.DEMO_MODEL_DIR / DEFAULTS_FILE).exists(), reason="no calibrated demo model")
def test_shipped_demo_calibration_holds(report):
    """The demo model's kvboost.json setting meets its recorded target on fresh prompts; where it is costlier than
    the engine default, the default does not (why it was chosen)."""
    from kvboost_rag.app.loading import fidelity_prompts, load_engine

    saved = json.loads((dd.DEMO_MODEL_DIR / DEFAULTS_FILE).read_text())["calibration"]
    torch.set_num_threads(1)
    loaded = load_engine("demo")
    docs, prompts = fidelity_prompts(loaded, 30)
    prompts = prompts[20:]  # not the 20 it was calibrated on
    loaded.engine.warm(docs)
    # an unreachable target makes it measure both settings
    cal = calibrate(loaded.engine, prompts, max_kl=0.0, min_top1=1.0,
                    settings=[(1, 0.15), (saved["check_layer"], saved["recompute_ratio"])])
    default, shipped = cal.trials
    report.append(f"demo model cacheblend on 10 held-out fidelity prompts: default mean KL {default.mean_kl:.3f}, "
                  f"calibrated (check layer {saved['check_layer']}, ratio {saved['recompute_ratio']}) "
                  f"{shipped.mean_kl:.3f}")
    assert shipped.mean_kl <= 2 * saved["max_kl"]
    if (saved["check_layer"], saved["recompute_ratio"]) != (1, 0.15):
        assert default.mean_kl > saved["max_kl"]  # calibration chose a costlier setting: the default must fail

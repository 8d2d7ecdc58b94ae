"""Calibration on first use (kvboost_core.tuning.autocalib) and the explicit ``KVEngine.calibrate``."""

from __future__ import annotations

import json

import pytest
import torch

from kvboost_core.engine import KVEngine
from kvboost_core.segments import Segment
from kvboost_core.tuning import autocalib

DOCS = [
    "Alice works at the Zentrix Institute as a chemist. She was born in Portvale in 1987 and likes boats.",
    "The capital of Norland is Essberg. Essberg has a large harbour, an old castle and three bridges.",
    "Bob repairs bicycles in a small shop. His shop opens at nine and closes at five every weekday.",
    "Rivers flow to the sea and mountains rise above the clouds. Birds sing at dawn in the valley.",
    "The quick brown fox jumps over the lazy dog. It was a sunny day and the fields were green.",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(autocalib, "cache_dir", lambda: tmp_path / "calibration")
    return tmp_path / "calibration"


@pytest.fixture(scope="module")
def model_tok(tokenizer):
    from conftest import make_tiny_model

    return make_tiny_model("llama", vocab_size=len(tokenizer), layers=4), tokenizer


def test_probe_prompts_rotate_documents_and_end_in_a_foreign_tail():
    docs = [[i] * 20 for i in range(5)]
    ps = autocalib.probe_prompts(docs, lead=[99, 98], n=4)
    assert len(ps) == 4 and all(list(p[0].token_ids) == [99, 98] for p in ps)
    for p in ps:
        body = [s.token_ids[0] for s in p[1:-1]]
        assert len(body) == autocalib.PER_PROMPT and len(set(body)) == len(body)
        assert p[-1].token_ids[0] not in body and len(p[-1].token_ids) == autocalib.TAIL_TOKENS
    assert len({tuple(s.token_ids[0] for s in p[1:-1]) for p in ps}) == 4  # different orders / neighbours
    with pytest.raises(ValueError, match="at least 4 documents"):
        autocalib.probe_prompts(docs[:3])


def test_first_use_calibrates_once_applies_and_caches(model_tok, cache, caplog):
    model, tok = model_tok
    eng = KVEngine(model, tok, auto_calibrate=True, sink_tokens=2, calibration_budget_s=1e-6)
    assert eng.calibration is None
    eng.warm(DOCS[:2])  # not enough documents yet
    assert eng.calibration is None
    with caplog.at_level("INFO", logger="kvboost_core.calibration"):
        eng.warm(DOCS[2:])
    cal = eng.calibration
    assert cal is not None and cal["source"] == "measured" and cal["trials"]
    assert (eng.config.recompute_ratio, eng.config.check_layer) == (cal["recompute_ratio"], cal["check_layer"])
    assert "calibrated CacheBlend" in caplog.text
    # said before it runs, at a level a default logging setup shows: it runs inside the caller's warm()
    starts = [r for r in caplog.records if "on first use" in r.getMessage()]
    assert starts and starts[0].levelname == "WARNING"
    assert caplog.records.index(starts[0]) < next(i for i, r in enumerate(caplog.records)
                                                  if "calibrated CacheBlend" in r.getMessage())
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["recompute_ratio"] == cal["recompute_ratio"]
    # a second engine on the same model applies the cached result at construction, measuring nothing
    again = KVEngine(model, tok, auto_calibrate=True, sink_tokens=2)
    assert again.calibration["source"] == "cached"
    assert again.config.recompute_ratio == eng.config.recompute_ratio
    # ... but settings that change what calibration measures are a different cache entry
    other = KVEngine(model, tok, auto_calibrate=True, sink_tokens=2, chunk_size=64)
    assert other.calibration is None


def test_the_search_respects_its_time_budget(model_tok, cache):
    model, tok = model_tok
    eng = KVEngine(model, tok, sink_tokens=2)
    cal = eng.calibrate(DOCS, budget_s=1e-6)
    assert len(cal.trials) == 1  # the first setting is always measured, then the budget stops the search


def test_explicit_calibrate_with_an_unreachable_target_picks_the_lowest_kl(model_tok, cache):
    model, tok = model_tok
    eng = KVEngine(model, tok, sink_tokens=2)
    cal = eng.calibrate(DOCS, max_kl=0.0, min_top1=1.0, budget_s=600)
    assert not cal.met and len(cal.trials) == len(autocalib.RATIOS) * 2
    best = min(cal.trials, key=lambda t: t.mean_kl)
    assert (eng.config.recompute_ratio, eng.config.check_layer) == (best.recompute_ratio, best.check_layer)
    # more recomputation is closer to full prefill on this model: the search had something real to trade
    kl = {(t.check_layer, t.recompute_ratio): t.mean_kl for t in cal.trials}
    assert kl[(2, 0.7)] < kl[(1, 0.15)]


def test_bad_calls_are_clear_errors(model_tok, cache):
    model, tok = model_tok
    eng = KVEngine(model, tok)
    with pytest.raises(ValueError, match="at least 4 warmed documents"):
        eng.calibrate()
    with pytest.raises(TypeError, match="docs must be a list"):
        eng.calibrate("one text")
    with pytest.raises(ValueError, match="calibration_budget_s"):
        KVEngine(model, tok, calibration_budget_s=0)
    with pytest.raises(TypeError, match="auto_calibrate"):
        KVEngine(model, tok, auto_calibrate="yes")


def test_a_damaged_cache_entry_is_measured_again(model_tok, cache):
    model, tok = model_tok
    eng = KVEngine(model, tok, auto_calibrate=True, sink_tokens=2)
    cache.mkdir(parents=True)
    (cache / f"{autocalib.settings_key(eng)}.json").write_text('{"recompute_ratio": 7}')
    again = KVEngine(model, tok, auto_calibrate=True, sink_tokens=2, calibration_budget_s=1e-6)
    assert again.calibration is None  # ignored with a warning, not applied and not raised
    again.warm(DOCS)
    assert again.calibration["source"] == "measured"


def test_from_pretrained_turns_it_on_only_without_shipped_or_chosen_settings(model_tok, tmp_path, monkeypatch,
                                                                              cache):
    model, tok = model_tok
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("KVBOOST_AUTO_CALIBRATE", "1")
    assert KVEngine.from_pretrained(str(tmp_path / "m"), device="cpu").config.auto_calibrate
    assert not KVEngine.from_pretrained(str(tmp_path / "m"), device="cpu", recompute_ratio=0.3).config.auto_calibrate
    monkeypatch.setenv("KVBOOST_AUTO_CALIBRATE", "0")
    assert not KVEngine.from_pretrained(str(tmp_path / "m"), device="cpu").config.auto_calibrate


def test_calibrated_setting_meets_its_target_on_stories(stories, cache):
    """On the trained model the chosen setting's own measurement is what the result says it is."""
    from conftest import STORY_DOCS

    model, tok = stories
    torch.manual_seed(0)
    eng = KVEngine(model, tok, auto_calibrate=True)
    eng.warm(STORY_DOCS)
    cal = eng.calibration
    assert cal is not None and cal["source"] == "measured"
    chosen = next(t for t in cal["trials"]
                  if (t["check_layer"], t["recompute_ratio"]) == (cal["check_layer"], cal["recompute_ratio"]))
    if cal["met"]:
        assert chosen["mean_kl"] <= cal["max_kl"] and chosen["top1_agree"] >= cal["min_top1"]
    # re-measured independently through the public prefill path: the same figures
    probes = autocalib.probe_prompts([eng.tokenize_ids([Segment(text=d)], add_special_tokens=False)[:192]
                                      for d in STORY_DOCS[:autocalib.MAX_DOCS]], eng._warm_prefix)
    from kvboost_core.tuning.fidelity import compare_logits

    kls = [compare_logits(eng.full_prefill_logits(eng.tokenize_ids(p)), eng.prefill(
        p, store_prefix=False, reuse_repaired=False).last_logits)["kl"] for p in probes]
    assert sum(kls) / len(kls) == pytest.approx(chosen["mean_kl"], rel=1e-3, abs=1e-6)


def test_a_calibration_never_changes_a_call_that_already_started(model_tok, cache):
    """Calibration applies to calls that start after it (issue 34, item 5): a call builds its RepairSpec once,
    at its start (kvboost_core.call_options), so a stream created before the swap runs on the old settings
    throughout, and the next call on the new ones."""
    from kvboost_core.tuning.calibrate import Calibration

    model, tok = model_tok
    eng = KVEngine(model, tok, chunk_size=16, boundary_window=4, sink_tokens=2, repair="cacheblend",
                   recompute_ratio=0.3, check_layer=1)
    eng.warm(DOCS[:3])
    prompt = [Segment(text=d, cacheable=True) for d in DOCS[:3]] + [Segment(text=" Who repairs bicycles?")]
    before = eng.generate(prompt, max_new_tokens=3, store_prefix=False)
    stream = eng.stream(prompt, max_new_tokens=3, store_prefix=False)  # started: its options are built
    autocalib.apply(eng, Calibration(0.9, 2, True, 0.1, 0.9, ()), "measured")
    assert (eng.config.recompute_ratio, eng.config.check_layer) == (0.9, 2)
    text = "".join(stream)
    assert stream.result is not None and text == before.text
    assert stream.result.stats["recompute_ratio"] == 0.3
    assert torch.equal(stream.result.first_logits, before.first_logits)
    after = eng.generate(prompt, max_new_tokens=3, store_prefix=False)
    assert after.stats["recompute_ratio"] == 0.9

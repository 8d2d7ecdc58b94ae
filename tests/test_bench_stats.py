"""The quality benchmark's uncertainty: paired bootstrap, McNemar's exact test, Wilson intervals, and the
first-sentence comparison of answers."""

from __future__ import annotations

import math

import pytest

from kvboost_rag.app.bench.rag import first_sentence
from kvboost_rag.app.bench.stats import mcnemar_p, paired_accuracy, paired_bootstrap, wilson


def test_paired_bootstrap_interval_covers_the_difference_and_shrinks_with_n():
    ref = [True] * 50 + [False] * 50
    got = [True] * 45 + [False] * 5 + [True] * 2 + [False] * 48  # 5 lost, 2 gained: -3 points
    d, lo, hi = paired_bootstrap(ref, got, rounds=4000)
    assert d == pytest.approx(-0.03)
    assert lo < d < hi and lo < 0 < hi
    d4, lo4, hi4 = paired_bootstrap(ref * 4, got * 4, rounds=4000)
    assert d4 == pytest.approx(d) and (hi4 - lo4) < (hi - lo) * 0.7  # 4x the questions: about half the width
    same = paired_bootstrap(ref, ref, rounds=500)
    assert same == (0.0, 0.0, 0.0)  # identical outcomes: no uncertainty in the difference


def test_paired_bootstrap_is_paired():
    # every question flips: unpaired resampling would see two 50% accuracies; paired sees -100 points
    ref = [True, False] * 20
    got = [False, True] * 20
    d, lo, hi = paired_bootstrap(ref, got, rounds=2000)
    assert d == 0.0 and lo < -0.2 and hi > 0.2
    assert paired_bootstrap([True] * 40, [False] * 40, rounds=200) == (-1.0, -1.0, -1.0)


def test_mcnemar_exact_p():
    assert mcnemar_p([True] * 10, [True] * 10) == 1.0
    # 6 discordant pairs all one way: p = 2 * 0.5**6
    ref = [True] * 6 + [False] * 4
    got = [False] * 6 + [False] * 4
    assert mcnemar_p(ref, got) == pytest.approx(2 * 0.5 ** 6)
    # b=1, c=3 of 4 discordant: p = 2 * (C(4,0) + C(4,1)) / 16 = 0.625
    ref = [True, False, False, False, True, True]
    got = [False, True, True, True, True, True]
    assert mcnemar_p(ref, got) == pytest.approx(0.625)


def test_wilson_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    lo, hi = wilson(100, 100)
    assert hi == 1.0 and lo == pytest.approx(0.963, abs=1e-3)  # never a zero-width interval at 100%
    with pytest.raises(ValueError, match="n must be"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 4)


def test_paired_accuracy_counts_kept_lost_gained():
    ref = [True, True, True, True, False, False]
    got = [True, True, True, False, True, False]
    pa = paired_accuracy(ref, got, rounds=500)
    assert (pa.lost, pa.gained, pa.n) == (1, 1, 6)
    assert pa.kept_right == pytest.approx(0.75) and pa.diff == 0.0
    assert math.isnan(paired_accuracy([False, False], [True, False], rounds=50).kept_right)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_accuracy([True], [True, False])


def test_first_sentence_ends_after_a_number():
    a = "The first skating race held on Lake Essary was held in 1899. It was won by a farmer."
    b = "The first skating race held on Lake Essary was held in 1899. The ice was thick that year."
    assert first_sentence(a) == first_sentence(b) == "the first skating race held on lake essary was held in 1899"
    assert first_sentence("It costs 3.5 crowns. Cheap.") == "it costs 3.5 crowns"


def _rows(setting, correct, questions=None):
    from kvboost_rag.app.bench.rag import Row

    qs = questions or [f"q{i}" for i in range(len(correct))]
    return [Row(q, "gold", setting, "answer", c, True, True, 0.0, True, 0.0, 1.0, 1.0) for q, c in zip(qs, correct)]


def test_block_cost_is_paired_with_the_adapted_models_own_full_prefill():
    from kvboost_rag.app.bench.rag import ADAPTED_FULL, summaries

    base = [True, False, False, True, False, False]
    own = [True, True, True, True, False, False]
    block = [True, True, False, False, False, True]
    out = summaries({"full": _rows("full", base), ADAPTED_FULL: _rows(ADAPTED_FULL, own),
                     "block": _rows("block", block)})
    vs_base, cost = out["block"]["extra"]["paired"], out["block"]["extra"]["block_cost"]
    assert vs_base["reference_accuracy"] == pytest.approx(2 / 6) and vs_base["diff"] == pytest.approx(1 / 6)
    assert cost["reference_accuracy"] == pytest.approx(4 / 6) and cost["diff"] == pytest.approx(-1 / 6)
    assert (cost["lost"], cost["gained"]) == (2, 1)
    assert "block_cost" not in summaries({"full": _rows("full", base), "block": _rows("block", block)})["block"]["extra"]
    with pytest.raises(ValueError, match="not paired"):
        summaries({"full": _rows("full", base), ADAPTED_FULL: _rows(ADAPTED_FULL, own, list("abcdef")),
                   "block": _rows("block", block)})

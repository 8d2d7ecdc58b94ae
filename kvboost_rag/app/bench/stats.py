"""Uncertainty for the quality benchmark: paired bootstrap, McNemar's exact test and Wilson intervals.

Every accuracy figure is a difference against full prefill on the *same* questions, so its uncertainty is
paired: resampling questions (with replacement) keeps each question's two outcomes together. At 100 questions
the 95% interval of an accuracy difference is about ±7 points; a claim of "within 1 point" needs the lower
bound, not the point estimate. Stdlib only, deterministic in ``seed``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def _check_pairs(ref: Sequence[bool], got: Sequence[bool]) -> None:
    if len(ref) != len(got):
        raise ValueError(f"paired outcomes must have equal lengths, got {len(ref)} and {len(got)}")
    if not ref:
        raise ValueError("need at least one paired outcome")


def paired_bootstrap(ref: Sequence[bool], got: Sequence[bool], *, rounds: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Accuracy difference ``mean(got) - mean(ref)`` and its percentile bootstrap interval (questions
    resampled with replacement, pairs kept together)."""
    _check_pairs(ref, got)
    n = len(ref)
    diffs = [int(g) - int(r) for r, g in zip(ref, got)]
    rng = random.Random(seed)
    stats = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    lo = stats[int((1 - level) / 2 * rounds)]
    hi = stats[min(rounds - 1, int((1 + level) / 2 * rounds))]
    return sum(diffs) / n, lo, hi


def mcnemar_p(ref: Sequence[bool], got: Sequence[bool]) -> float:
    """Two-sided exact McNemar p-value: a binomial test on the discordant pairs (1.0 when there are none)."""
    _check_pairs(ref, got)
    b = sum(1 for r, g in zip(ref, got) if r and not g)  # right under the reference only
    c = sum(1 for r, g in zip(ref, got) if g and not r)
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True, slots=True)
class PairedAccuracy:
    """One setting's accuracy against the reference on the same questions."""

    n: int
    accuracy: float
    reference_accuracy: float
    diff: float  # accuracy - reference accuracy
    diff_lo: float  # paired bootstrap 95% interval of diff
    diff_hi: float
    mcnemar_p: float
    kept_right: float  # of the questions the reference gets right, the share this setting also gets right
    lost: int  # right under the reference, wrong here
    gained: int  # wrong under the reference, right here

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_accuracy(ref: Sequence[bool], got: Sequence[bool], *, rounds: int = 10_000, seed: int = 0
                    ) -> PairedAccuracy:
    diff, lo, hi = paired_bootstrap(ref, got, rounds=rounds, seed=seed)
    right = [g for r, g in zip(ref, got) if r]
    lost = sum(1 for r, g in zip(ref, got) if r and not g)
    gained = sum(1 for r, g in zip(ref, got) if g and not r)
    n = len(ref)
    return PairedAccuracy(n, sum(got) / n, sum(ref) / n, diff, lo, hi, mcnemar_p(ref, got),
                          sum(right) / len(right) if right else float("nan"), lost, gained)


def rate_with_ci(flags: Sequence[bool]) -> dict[str, float]:
    """A rate and its Wilson 95% interval."""
    n = len(flags)
    k = sum(1 for f in flags if f)
    lo, hi = wilson(k, n)
    return {"rate": k / n, "lo": lo, "hi": hi, "n": n}


def pct_ci(diff: float, lo: float, hi: float) -> str:
    """``-3.1 [-7.0, +0.8]`` in points."""
    return f"{diff * 100:+.1f} [{lo * 100:+.1f}, {hi * 100:+.1f}]"

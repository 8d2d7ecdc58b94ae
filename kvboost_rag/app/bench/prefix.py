"""The longest shared token prefix: what exact-prefix caching (vLLM APC, SGLang) can reuse of a new prompt.

The baselines of the TTFT and multi-turn benchmarks keep a few earlier sequences with their HF caches; a new
prompt reuses the cache of whichever shares the longest identical run of leading token ids with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from kvboost_core.chunking import common_prefix

__all__ = ["common_prefix", "longest_prefix"]

T = TypeVar("T")


def longest_prefix(entries: Iterable[tuple[Sequence[int], T]], ids: Sequence[int]) -> tuple[int, T | None]:
    """``(n, value)`` of the entry ``(sequence, value)`` whose sequence shares the longest prefix with ``ids``
    (``n`` ids; the earliest such entry on a tie), or ``(0, None)`` when none shares a first id. ``n`` may be
    all of ``ids``: a caller that must compute the last prompt token caps it at ``len(ids) - 1`` itself."""
    best_n: int = 0
    best: T | None = None
    for seq, value in entries:
        n = common_prefix(seq, ids)
        if n > best_n:
            best_n, best = n, value
    return best_n, best

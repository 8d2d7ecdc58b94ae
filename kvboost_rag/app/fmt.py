"""Shared formatting of measured figures, so every command and benchmark prints them the same way.

A speedup is always full / reuse, written as a ratio of at least one with its direction: 1.27x faster, or
1.27x slower when reuse took longer (never "0.79x faster", which reads as a gain).
"""

from __future__ import annotations

import math


def speedup(full_s: float, reuse_s: float) -> str:
    """``"N.NNx faster"`` when ``reuse_s`` <= ``full_s``, else ``"N.NNx slower"`` (reuse_s / full_s).

    Both are durations in seconds, of the same work measured side by side; they must be finite and > 0.
    The direction is decided on the printed digits, so equal-looking ratios never read "1.00x slower".
    """
    for name, value in (("full_s", full_s), ("reuse_s", reuse_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite duration > 0 seconds, got {value!r}")
    from kvboost_core.results import speedup_text  # the one wording rule, the engine's verify table's too

    return speedup_text(reuse_s / full_s)


def ratio_speedup(ratio: float) -> str:
    """The same wording for a ratio already computed as full / reuse (a results file's ``speedup``)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"ratio must be a number, got {type(ratio).__name__}")
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"ratio must be finite and > 0, got {ratio!r}")
    return speedup(ratio, 1.0)


def seconds(s: float) -> str:
    """A duration for humans: milliseconds below one second, else seconds with one decimal."""
    return f"{s * 1e3:.0f} ms" if s < 1.0 else f"{s:.1f} s"


__all__ = ["ratio_speedup", "seconds", "speedup"]

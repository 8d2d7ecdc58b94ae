"""The benchmarks behind ``kvboost-rag bench``: :mod:`.ttft` (TTFT side by side, the entry point), :mod:`.rag`
(real-model RAG answers, ``bench rag``), :mod:`.quality` (answer quality beside the timings) and :mod:`.peer`
(the PyPI ``kvboost`` package run on the same prompts). Importing this package loads nothing heavy; it holds
:func:`write_json`, the one writer of every benchmark's JSON result, and :func:`median_ms`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def median_ms(fn: Callable[[], Any], rounds: int, warmup: int = 1) -> float:
    """Median wall milliseconds of ``rounds`` calls of ``fn`` after ``warmup`` untimed ones."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def write_json(path: str | None, result: Any) -> None:
    """Write a benchmark's result to ``path`` as ``benchmarks/results/`` keeps it (indent 1); no path: nothing."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(result, f, indent=1)

"""How the chat demo (:mod:`kvboost_rag.app.demo_chat`) times things, and says how far to trust the times.

A single TTFT on a shared CPU swings with whatever else runs: one turn with 90% exact reuse printed
"1.00x faster" once and "3.18x slower" once. So each TTFT is taken more than once where that is cheap, the
fastest run is reported (the one least disturbed), and the summary prints the machine's load and says plainly
when the timings are noisy.

- **The same number of runs both ways.** The fastest of three runs is faster than one run by luck alone, so
  a side is never repeated more than the other: the plain HF reference runs first, and only when its TTFT is
  under ``CHEAP_S`` do both sides get ``REPEATS - 1`` more one-token runs, alternating. A slow machine (where
  one full prefill of 1.7K tokens takes seconds) runs each call once, as before, and is told so.
- **Reuse side**: the extra runs are one-token calls of the same chat with ``store_prefix=False``, made *before*
  the answer's own call, so they store nothing (no prefix, no backfill) and find the store exactly as the
  answer's call does. A run counts only when its prompt ids and reuse stats equal the answer call's; a side
  left with fewer runs cuts the other to as many.
- **Full prefill side**: plain HF is stateless; its extra runs are the one-token prefill again.

Warming is reported as it goes (a bar on a terminal, plain lines in a log), and the summary says when it pays
off: about one prefill per document, paid once at ingestion, against what each question saves.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.app.fmt import seconds

REPEATS = 3  # timed runs per side at most: the answer's own call and up to two more
CHEAP_S = 1.0  # a side is repeated only while its last run took less than this
SPREAD = 1.5  # runs of one call further apart than this (slowest / fastest) mean the timings are noisy
WARM_SLICE = 8  # documents per progress line in a logged run (the default warming batch)


@dataclass(frozen=True, slots=True)
class Probe:
    """One timed run on the reuse side and what it did (only runs that did the same work are compared)."""

    ttft_s: float
    key: tuple[Any, ...]


def probe_key(chat: Any) -> tuple[Any, ...]:
    """What the last call of ``chat`` computed: its prompt ids and how much of it was reused, and how."""
    stats = chat.last_stats
    ids = tuple(chat.rag.last_result.prompt_token_ids)
    return (ids, float(stats.get("reuse_ratio", 0.0)), *(int(stats.get(k, 0)) for k in (
        "reused_approx", "reused_repaired", "reused_block")))


def reuse_probe(chat: Any, messages: Any) -> Probe:
    """One one-token run of ``messages`` that stores nothing (no prefix entry, no backfill)."""
    chat.invoke(messages, max_tokens=1, store_prefix=False)
    return Probe(float(chat.last_stats["ttft_s"]), probe_key(chat))


def extra_runs(full_first_s: float, n: int = REPEATS, cheap_s: float = CHEAP_S) -> int:
    """More runs each way: ``n - 1`` when one full prefill took under ``cheap_s``, else none."""
    return n - 1 if full_first_s < cheap_s else 0


def alternate(k: int, reuse: Callable[[], Probe], full: Callable[[], float]) -> tuple[list[Probe], list[float]]:
    """``k`` runs each way, alternating (so a burst of load hits both sides alike)."""
    probes: list[Probe] = []
    fulls: list[float] = []
    for _ in range(k):
        probes.append(reuse())
        fulls.append(full())
    return probes, fulls


def paired(reuse_first_s: float, key: tuple[Any, ...], probes: Sequence[Probe], full_runs: Sequence[float]
           ) -> tuple[list[float], list[float]]:
    """(reuse runs, full runs), as many each: the answer call's TTFT and the probes that did exactly its work,
    against the reference's runs (each list's first run is the answer's or the reference's own)."""
    reuse = [reuse_first_s] + [p.ttft_s for p in probes if p.key == key]
    k = min(len(reuse), len(full_runs))
    return reuse[:k], list(full_runs[:k])


def spread(runs: Sequence[float]) -> float:
    """Slowest / fastest run (1.0 for a single run)."""
    return max(runs) / min(runs) if runs and min(runs) > 0 else 1.0


# ---------------------------------------------------------------------------------------------- load
def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True, slots=True)
class Machine:
    cores: int
    threads: int  # torch's CPU threads
    load_start: float | None  # before the demo computed anything: the other processes' load
    load_now: float | None


def machine(load_start: float | None) -> Machine:
    import torch

    return Machine(os.cpu_count() or 1, torch.get_num_threads(), load_start, load_average())


def noise_lines(m: Machine, runs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> list[str]:
    """The load next to the table, how the TTFTs were taken, and whether they are noisy and why."""
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    counts = [len(r) for pair in runs for r in pair]
    lines = [f"TTFT: the fastest of up to {REPEATS} runs each way, as many runs both ways, alternating, in this "
             f"process (repeated only where one full prefill takes under {seconds(CHEAP_S)}); runs = per side.",
             f"Machine load: 1-min load average {fmt(m.load_now)} now, {fmt(m.load_start)} when the demo "
             f"started, on {m.cores} cores (torch uses {m.threads} thread{'s' if m.threads != 1 else ''})."]
    why = []
    if m.load_now is not None and m.load_now > m.cores:
        why.append(f"the load average ({m.load_now:.2f}) is above the core count ({m.cores}): other processes "
                   "take CPU time from the timed calls")
    worst = max((spread(r) for pair in runs for r in pair if len(r) > 1), default=1.0)
    if worst > SPREAD:
        why.append(f"repeated runs of one call differed by up to {worst:.2f}x")
    if why:
        lines.append("Timings are NOISY: " + "; ".join(why) + ". The TTFT and speedup columns can swing either "
                     "way from run to run; read them as rough, and see the measured figures (with their "
                     "intervals) for the real ratios.")
    elif counts and max(counts) == 1:
        lines.append(f"Each call ran once (every full prefill took {seconds(CHEAP_S)} or more, too slow to "
                     "repeat): one run per call cannot show noise, so read the speedups as rough.")
    else:
        lines.append(f"Timings look steady: load at or below the core count, repeated runs within {SPREAD}x of "
                     "each other.")
    return lines


# ---------------------------------------------------------------------------------------------- warming
def warm(chat: Any, texts: Sequence[str], progress: bool | None, log: Callable[[str], None] = print) -> Any:
    """``chat.warm_documents(texts)`` with progress: a bar on a terminal (stderr a TTY, or ``progress`` True),
    plain lines through ``log`` otherwise (a logged run), nothing with ``progress`` False. Same batches."""
    if progress is False or progress is True or sys.stderr.isatty() or not texts:
        return chat.warm_documents(list(texts), show_progress=progress)
    from kvboost_rag.warming import WarmReport

    t0, parts = time.perf_counter(), []
    for i in range(0, len(texts), WARM_SLICE):
        parts.append(chat.warm_documents(list(texts[i:i + WARM_SLICE]), show_progress=False))
        done, spent = min(i + WARM_SLICE, len(texts)), time.perf_counter() - t0
        left = spent / done * (len(texts) - done)
        log(f"  warming: {done}/{len(texts)} documents, {spent:.0f} s" + (f", about {left:.0f} s left"
                                                                            if done < len(texts) else ""))
    total = {f: sum(getattr(p, f) for p in parts) for f in ("documents", "warmed", "already_warm", "tokens", "bytes")}
    return WarmReport(**total, seconds=time.perf_counter() - t0)


WARM_PAYS = ("Warming costs about one prefill per document, paid once at ingestion (not per question); it pays "
             "off when documents are reused across questions: every later question that retrieves a warmed "
             "document skips most of its prefill. Documents read once are cheaper left cold.")


def payoff_lines(warm_s: float, documents: int, saved: Mapping[str, float]) -> list[str]:
    """When warming pays off here: its cost against the TTFT each retrieval question saved (full - reuse)."""
    if not saved or warm_s <= 0:
        return []
    total, n = sum(saved.values()), len(saved)
    head = f"Here warming the {documents} documents took {seconds(warm_s)}"
    if total <= 0:
        return [head + f"; the {n} retrieval question(s) saved no TTFT on these timings (reuse was not faster), "
                "so it did not pay off here: a loaded machine, or a model where the repair costs about a prefill."]
    per = total / n
    return [head + f"; the {n} retrieval question(s) saved {seconds(total)} of TTFT in all, {seconds(per)} each: "
            f"it pays off after about {math.ceil(warm_s / per)} questions that retrieve these documents."]


__all__ = ["CHEAP_S", "REPEATS", "SPREAD", "WARM_PAYS", "Machine", "Probe", "alternate", "extra_runs",
           "load_average", "machine", "noise_lines", "paired", "payoff_lines", "probe_key", "reuse_probe", "spread",
           "warm"]

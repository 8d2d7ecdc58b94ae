"""Calibration on first use: CacheBlend settings measured on the model's own warmed documents.

Why: how much repair re-placed document KV needs depends on the model (see :mod:`kvboost_core.tuning.calibrate`). A
model that ships a ``kvboost.json`` has its settings; any other model would otherwise run at the engine's
generic default. With ``auto_calibrate`` on (``KVEngine.from_pretrained`` turns it on for models without a
``kvboost.json``), the first ``warm`` that brings the engine to ``MIN_DOCS`` warmed documents runs
:func:`kvboost_core.tuning.calibrate.calibrate` on probe prompts built from a sample of them, bounded by
``calibration_budget_s``, applies the result to the engine's config and caches it on disk under the model's
fingerprint and the settings that shape it, so later processes apply it at construction without measuring.

Probe prompts hold ``PER_PROMPT`` warmed documents in rotated orders (each re-placed away from where it was
warmed, next to new neighbours) behind the engine's warm prefix, then a short tail: the first tokens of a
document not in the prompt, standing in for the question. The reference is a plain full prefill of the same ids.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvboost_core.segments import Segment
from kvboost_core.stages import TuningEngine
from kvboost_core.tuning.calibrate import Calibration, calibrate, grid

log = logging.getLogger("kvboost_core.calibration")

MIN_DOCS = 4  # warmed documents needed before a first-use calibration runs
MAX_DOCS = 12  # documents sampled for probe prompts (the first ones warmed)
PER_PROMPT = 3
N_PROMPTS = 6
TAIL_TOKENS = 8
MAX_DOC_TOKENS = 192  # longer documents are cut: probe cost stays bounded whatever the corpus
RATIOS = (0.15, 0.3, 0.5, 0.7)
MAX_KL = 0.01
MIN_TOP1 = 0.95


def probe_prompts(docs: Sequence[Sequence[int]], lead: Sequence[int] = (), n: int = N_PROMPTS,
                  per_prompt: int = PER_PROMPT, tail: int = TAIL_TOKENS) -> list[list[Segment]]:
    """``n`` prompts of ``per_prompt`` documents each, in rotated orders, with a tail from another document.

    ``lead`` (the engine's warm prefix) comes first, so each document sits behind the context it was warmed in.
    """
    docs = [list(d) for d in docs if len(d) > tail]
    if len(docs) < per_prompt + 1:
        raise ValueError(f"probe prompts need at least {per_prompt + 1} documents longer than {tail} tokens, "
                         f"got {len(docs)}")
    out = []
    for i in range(n):
        picked = [docs[(i * 2 + j) % len(docs)] for j in range(per_prompt)][:: -1 if i % 2 else 1]
        other = docs[(i * 2 + per_prompt) % len(docs)]
        segs = [Segment(token_ids=list(lead))] if lead else []
        segs += [Segment(token_ids=d, cacheable=True) for d in picked] + [Segment(token_ids=other[:tail])]
        out.append(segs)
    return out


def cache_dir() -> Path:
    from kvboost_core.zoo import cache_root

    return cache_root().parent / "calibration"


def settings_key(engine: TuningEngine) -> str:
    """The model's fingerprint and every setting that changes what calibration measures."""
    c = engine.config
    shaping = {"fingerprint": engine.fingerprint, "warm_prefix": list(engine.warm_prefix_ids), "select": c.select,
               "chunk_size": c.chunk_size, "boundary_window": c.boundary_window, "kv_bits": c.kv_bits,
               "kv_group_size": c.kv_group_size, "sink_tokens": c.sink_tokens, "overlap_k": c.overlap_k,
               "target": [MAX_KL, MIN_TOP1], "ratios": list(RATIOS)}
    return xxhash.xxh3_128_hexdigest(json.dumps(shaping, sort_keys=True).encode())


def load_cached(engine: TuningEngine) -> Calibration | None:
    """The cached calibration for this engine's model and settings; None if absent or unreadable."""
    path = cache_dir() / f"{settings_key(engine)}.json"
    try:
        return Calibration.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged cache entry is measured again
        log.warning("kvboost: ignoring unreadable calibration cache %s (%s)", path, exc)
        return None


def save_cached(engine: TuningEngine, cal: Calibration) -> Path | None:
    """Atomic write; a read-only cache directory is logged, not raised (the calibration still applies)."""
    path = cache_dir() / f"{settings_key(engine)}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cal-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cal.to_dict(), f, indent=2)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        log.warning("kvboost: could not cache the calibration in %s (%s)", path.parent, exc)
        return None


def apply(engine: TuningEngine, cal: Calibration, source: str) -> None:
    """Make ``cal``'s settings the engine's repair defaults, for the calls that start after this. A call already
    running (another thread's generate, a stream not exhausted yet) keeps the settings it started with: it built
    its RepairSpec once, at its start (:mod:`kvboost_core.call_options`), and reads no repair setting from the
    config after that. On first use this runs at the end of the ``warm()`` that sampled enough documents, after
    that warm's own work (which it never changes) and before the warm returns."""
    engine.config = engine.config.with_(**cal.defaults())
    engine.calibration = {"source": source, **cal.to_dict()}


class FirstUse:
    """Per-engine state: a sample of the warmed documents, and whether calibration on first use has run
    (``done`` from the start when it is off or a cached result was applied)."""

    __slots__ = ("docs", "lock", "done")

    def __init__(self, done: bool) -> None:
        self.docs: list[list[int]] = []
        self.lock = threading.Lock()
        self.done = done

    def observe(self, engine: TuningEngine, doc_ids: Sequence[Sequence[int]]) -> None:
        """Called after each ``warm``: sample the documents, and calibrate once enough are warmed."""
        if len(self.docs) >= MAX_DOCS and self.done:
            return
        with self.lock:
            room = max(MAX_DOCS - len(self.docs), 0)
            self.docs += [list(d[:MAX_DOC_TOKENS]) for d in doc_ids if len(d) > TAIL_TOKENS][:room]
            if self.done or len(self.docs) < MIN_DOCS:
                return
            self.done = True
            # never silently: this runs inside the caller's warm() and takes up to the budget
            log.warning("kvboost: calibrating CacheBlend for this model on first use, inside this warm() call "
                        "(up to %.0f s): it has no kvboost.json and is not a known model. Skip it with "
                        "recompute_ratio=... or KVBOOST_AUTO_CALIBRATE=0, or run engine.calibrate() ahead of "
                        "time (the result is cached)", engine.config.calibration_budget_s)
            run(engine, self.docs, budget_s=engine.config.calibration_budget_s)


def run(engine: TuningEngine, docs: Sequence[Sequence[int]], *, budget_s: float, prompts: Sequence[Any] | None = None,
        max_kl: float = MAX_KL, min_top1: float = MIN_TOP1, save: bool = True) -> Calibration:
    """Calibrate ``engine`` on probe prompts from ``docs`` (or on ``prompts``), apply and cache the result."""
    probes = list(prompts) if prompts is not None else probe_prompts(docs, engine.warm_prefix_ids)
    settings = grid(engine.driver.num_layers, RATIOS, max_check_layer=2)
    cal = calibrate(engine, probes, max_kl=max_kl, min_top1=min_top1, settings=settings, budget_s=budget_s)
    apply(engine, cal, "measured")
    path = save_cached(engine, cal) if save and prompts is None else None
    t = next(t for t in cal.trials if (t.check_layer, t.recompute_ratio) == (cal.check_layer, cal.recompute_ratio))
    log.info("kvboost: calibrated CacheBlend on %d probe prompts in %d trial(s): recompute_ratio %.2f, check "
             "layer %d (%s: mean KL %.4f, top-1 %.2f)%s", len(probes), len(cal.trials), cal.recompute_ratio,
             cal.check_layer, "target met" if cal.met else "target not met, lowest KL tried", t.mean_kl,
             t.top1_agree, f"; cached in {path}" if path else "")
    return cal

"""Per-model CacheBlend calibration: the cheapest repair setting that meets a fidelity target.

Why: how much cross-document attention a re-placed document misses depends on the model. On stories260K the
default (recompute ratio 0.15, check layer 1) leaves a mean KL of 0.0008 against full prefill; on the embedded
demo model, trained only on multi-document prompts, the same setting leaves 1.0 and r=0.5 with check layer 2
is needed. ``calibrate`` runs ``verify`` over a grid of (check layer, ratio) from cheapest to dearest and
returns the first that meets the target; ``save_defaults`` writes it as ``kvboost.json`` next to the
weights, and ``KVEngine.from_pretrained`` applies that file's settings as defaults (explicit arguments win).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvboost_core.stages import TuningEngine
from kvboost_core.zoo import DEFAULTS_FILE  # re-exported: the file's name lives with the zoo

log = logging.getLogger("kvboost_core.calibration")

# up to 1.0 (every re-placed token recomputed: full-prefill quality, no saving) so a model that needs 0.7, as
# SmolLM2 does, can be found by the search rather than reported as "no setting met the target"
RATIOS = (0.15, 0.3, 0.5, 0.7, 1.0)
# EngineConfig fields a defaults file may set (anything else is a caller error, not silently ignored)
_ALLOWED = {"recompute_ratio", "check_layer", "select", "chunk_size", "boundary_window", "sink_tokens",
            "overlap_k", "kv_bits", "kv_group_size"}


@dataclass(frozen=True, slots=True)
class Trial:
    check_layer: int
    recompute_ratio: float
    cost: float  # share of (token, layer) pairs of re-placed documents that are recomputed, estimated
    mean_kl: float
    top1_agree: float
    recomputed_share: float  # measured: recomputed prompt tokens / prompt tokens


@dataclass(frozen=True, slots=True)
class Calibration:
    recompute_ratio: float
    check_layer: int
    met: bool  # False: no setting of the grid met the target; the fields are then those of the lowest KL
    max_kl: float
    min_top1: float
    trials: tuple[Trial, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_dict` (raises KeyError/TypeError/ValueError on a malformed record)."""
        trials = tuple(Trial(**t) for t in d["trials"])
        cal = cls(float(d["recompute_ratio"]), int(d["check_layer"]), bool(d["met"]), float(d["max_kl"]),
                  float(d["min_top1"]), trials)
        if not 0 <= cal.recompute_ratio <= 1 or cal.check_layer < 0:
            raise ValueError(f"calibration out of range: {cal.defaults()}")
        return cal

    def defaults(self) -> dict[str, Any]:
        return {"recompute_ratio": self.recompute_ratio, "check_layer": self.check_layer}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trials": [asdict(t) for t in self.trials]}


def cost(check_layer: int, ratio: float, num_layers: int) -> float:
    """Layers below the check layer recompute every re-placed token, the check layer and those above
    ``ratio`` of them (the check layer's K/V-only pass over every token is small and left out)."""
    full = min(check_layer, num_layers)
    return (full + ratio * (num_layers - full)) / num_layers


def grid(num_layers: int, ratios: Sequence[float] = RATIOS, max_check_layer: int = 3) -> list[tuple[int, float]]:
    """(check layer, ratio) pairs, cheapest first; check layers stay below the last layer. Ratio 1.0 recomputes
    every layer whatever the check layer, so it is tried once (at the lowest check layer)."""
    layers = range(1, max(2, min(max_check_layer, num_layers - 2) + 1))
    pairs = [(c, r) for c in layers for r in ratios if r < 1.0 or c == layers[0]]
    return sorted(pairs, key=lambda p: (cost(p[0], p[1], num_layers), p[0]))


def calibrate(engine: TuningEngine, prompts: Sequence[Any], *, max_kl: float = 0.01, min_top1: float = 0.95,
              settings: Sequence[tuple[int, float]] | None = None, budget_s: float | None = None) -> Calibration:
    """Measure cacheblend against full prefill on ``prompts`` (documents warmed beforehand) for each setting,
    cheapest first; stop at the first with mean KL <= ``max_kl`` and top-1 agreement >= ``min_top1``.

    ``budget_s`` bounds the search: no new setting is tried once it is spent (the reference prefills count).
    When no tried setting meets the target, the result has ``met=False`` and the lowest-KL setting tried."""
    from kvboost_core.tuning.fidelity import compare_logits

    if not prompts:
        raise ValueError("calibrate needs at least one prompt with warmed documents in it")
    if max_kl < 0 or not 0 <= min_top1 <= 1:
        raise ValueError(f"max_kl must be >= 0 and min_top1 in [0, 1], got {max_kl!r}, {min_top1!r}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 or None, got {budget_s!r}")
    t0 = time.perf_counter()
    n_layers = engine.driver.num_layers
    # the reference once per prompt: a plain full prefill of exactly the ids the reuse path sees
    refs = [engine.full_prefill_logits(engine.tokenize_ids(p)) for p in prompts]
    trials: list[Trial] = []
    for check_layer, ratio in settings or grid(n_layers):
        if trials and budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        kls, top1, share = [], [], []
        for prompt, ref in zip(prompts, refs):
            # store_prefix / reuse_repaired off: nothing stored, no earlier repaired prefix served
            pre = engine.prefill(prompt, repair="cacheblend", recompute_ratio=ratio, check_layer=check_layer,
                                 store_prefix=False, reuse_repaired=False)
            c = compare_logits(ref, pre.last_logits)
            kls.append(c["kl"])
            top1.append(c["top1_agree"])
            share.append(pre.stats["recomputed"] / pre.stats["prompt_tokens"])
        trials.append(Trial(check_layer, ratio, round(cost(check_layer, ratio, n_layers), 4),
                            statistics.fmean(kls), statistics.fmean(top1), statistics.fmean(share)))
        t = trials[-1]
        if t.mean_kl <= max_kl and t.top1_agree >= min_top1:
            return Calibration(ratio, check_layer, True, max_kl, min_top1, tuple(trials))
    best = min(trials, key=lambda t: t.mean_kl)
    return Calibration(best.recompute_ratio, best.check_layer, False, max_kl, min_top1, tuple(trials))


def shipped_defaults(model_dir: str | os.PathLike[str], model: Any, tokenizer: Any) -> dict[str, Any]:
    """The engine defaults of these weights, the same whatever folder they were loaded from: the
    ``kvboost.json`` beside them when there is one (a calibration of this copy), else the shipped defaults of
    the zoo model they are (recognised by fingerprint, :func:`kvboost_core.zoo.recognise`), else {}."""
    if (Path(model_dir) / DEFAULTS_FILE).is_file():
        return load_defaults(model_dir)
    from kvboost_core import zoo

    known = zoo.recognise(model, tokenizer)
    if known is None:
        return {}
    found = zoo.shipped_defaults(known)
    log.info("kvboost: %s holds the weights of %s (same fingerprint); applying its shipped defaults %s",
             model_dir, known.name, found)
    return found


def load_defaults(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The engine settings in ``<model_dir>/kvboost.json`` (``{"engine": {...}}``), or {} without the file."""
    path = Path(model_dir) / DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or delete it") from exc
    engine = data.get("engine") if isinstance(data, dict) else None
    if not isinstance(engine, dict):
        raise ValueError(f"{path} must hold an object with an 'engine' object of EngineConfig settings")
    unknown = set(engine) - _ALLOWED
    if unknown:
        raise ValueError(f"{path}: unsupported engine settings {sorted(unknown)}; allowed: {sorted(_ALLOWED)}")
    return dict(engine)


def save_defaults(model_dir: str | os.PathLike[str], calibration: Calibration) -> Path:
    """Write ``kvboost.json`` (atomically) with the calibrated settings and the measurements behind them.

    Only a calibration that met its target is written (ValueError otherwise: a setting that failed the target
    must not become every later load's default). Other engine settings already in the file are kept."""
    if not calibration.met:
        raise ValueError(f"not writing {DEFAULTS_FILE}: no setting met the target (mean KL <= "
                         f"{calibration.max_kl}, top-1 >= {calibration.min_top1}); the best tried was "
                         f"{calibration.defaults()}")
    path = Path(model_dir) / DEFAULTS_FILE
    engine = {**load_defaults(model_dir), **calibration.defaults()}
    body = json.dumps({"engine": engine, "calibration": calibration.to_dict()}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kvboost-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

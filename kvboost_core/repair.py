"""Repair strategies as compute schedules.

- ``none``: compute only the tokens with no cached KV.
- ``selective``: also recompute the first ``overlap_k`` tokens after every seam (EPIC's LegoLink finding:
  the tokens right after a document boundary carry most of the error).
- ``cacheblend``: compute every re-placed token up to ``check_layer``, measure how far its fresh K/V moved
  from the cached K/V there, and keep recomputing only the top ``recompute_ratio`` in the layers above.
  With ``recheck_layer``, the kept tokens are scored again at that later layer and only the top
  ``recheck_ratio`` of the candidates keep running above it (progressive filtering: more tokens repaired in
  the lower layers for the same cost). A token dropped there is still approximate and counts as reused.
- ``full``: recompute every re-placed token (the reference; equals a full prefill).
Exact-prefix tokens are never recomputed (their KV is exact by construction) and cost nothing.
"""

from __future__ import annotations

import math

import torch

from kvboost_core.assembly import APPROX, FRESH, Plan
from kvboost_core.config import RepairSpec
from kvboost_core.model.forward import Schedule, Scorer


def _sq_dev(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    return (fresh - cached).pow(2).sum(dim=(0, 2))  # (H, n, D) -> (n,)


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.mean().clamp_min(1e-12)


def make_scorer(select: str, fresh_positions: torch.Tensor) -> Scorer:
    """Scores for CacheBlend's check layer; higher means recompute first."""
    # distance from each candidate to the next fresh token after it (the question usually)
    def closeness(positions: torch.Tensor) -> torch.Tensor:
        if fresh_positions.numel() == 0:
            return torch.ones_like(positions, dtype=torch.float32)
        nxt = torch.searchsorted(fresh_positions, positions).clamp_max(fresh_positions.numel() - 1)
        dist = (fresh_positions[nxt] - positions).clamp_min(1).float()
        return 1.0 / torch.sqrt(dist)

    def score(fk: torch.Tensor, ck: torch.Tensor, fv: torch.Tensor, cv: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        if select == "key":
            return _sq_dev(fk, ck)
        if select == "value":
            return _sq_dev(fv, cv)
        if select == "recency":
            return positions.float()
        dev = _normalized(_sq_dev(fk, ck)) + _normalized(_sq_dev(fv, cv))
        if select == "deviation":
            return dev
        if select == "deviation_recency":
            return dev * closeness(positions)
        raise ValueError(f"unknown select {select!r}")

    return score


def seam_starts(plan: Plan) -> list[int]:
    """Starts of re-placed runs. Consecutive chunks of one warmed document (contiguous, equal rotation delta)
    continue each other, so only a real change of neighbour counts as a seam."""
    seams = []
    prev = None
    for pl in sorted((p for p in plan.placements if not p.exact), key=lambda p: p.dst):
        if prev is None or prev.dst + prev.length != pl.dst or prev.delta != pl.delta:
            seams.append(pl.dst)
        prev = pl
    return seams


def build_schedule(plan: Plan, spec: RepairSpec, num_layers: int, device: torch.device) -> Schedule:
    status = torch.tensor(plan.status, dtype=torch.int8, device=device)
    total = status.numel()
    fresh = torch.nonzero(status == FRESH).flatten()
    approx = torch.nonzero(status == APPROX).flatten()
    last = torch.tensor([total - 1], device=device)  # its logits are the output: always computed
    base = torch.unique(torch.cat((fresh, last)), sorted=True)
    empty = base[:0]
    if spec.repair == "none" or approx.numel() == 0:
        return Schedule(base=base, candidates=empty)
    if spec.repair == "full":
        return Schedule(base=torch.unique(torch.cat((base, approx)), sorted=True), candidates=empty)
    if spec.repair == "selective":
        forced = [torch.arange(s, min(s + spec.overlap_k, total), device=device) for s in seam_starts(plan)]
        extra = torch.cat(forced) if forced else empty
        extra = extra[status[extra] == APPROX]
        return Schedule(base=torch.unique(torch.cat((base, extra)), sorted=True), candidates=empty)
    if spec.repair == "cacheblend":
        candidates = approx[~torch.isin(approx, base)]
        n_select = math.ceil(spec.recompute_ratio * candidates.numel())
        n_max = max(n_select, math.ceil(spec.max_recompute_ratio * candidates.numel()))
        check = min(spec.check_layer, num_layers - 1)
        recheck = None if spec.recheck_layer is None else min(spec.recheck_layer, num_layers - 1)
        return Schedule(base=base, candidates=candidates, check_layer=check, n_select=n_select,
                        scorer=make_scorer(spec.select, fresh), mass=spec.recompute_mass, n_max=n_max,
                        observers=spec.query_tokens, recheck_layer=recheck if recheck != check else None,
                        n_recheck=math.ceil(spec.recheck_ratio * candidates.numel()))
    raise ValueError(f"unknown repair {spec.repair!r}")

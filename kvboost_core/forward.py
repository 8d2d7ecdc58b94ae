"""The planned forward pass: run each layer only for the positions that need computing.

Every reuse strategy is one schedule for this loop. Positions not computed keep the K/V already placed in
the cache (exact or re-rotated); computed positions overwrite theirs in each layer they run through, and
attend with an exactly causal mask over the whole buffer. CacheBlend computes a wider set below its check
layer; at the check layer it computes only the K/V of that set (enough to score the deviation and to
leave fresh K/V for every candidate there), picks the tokens to keep recomputing, and runs the rest of the
check layer and every layer above for those alone: the saving is real rather than a copy of a full prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvboost_core.adapters import ModelAdapter, ScatterCache

# score(fresh_k, cached_k, fresh_v, cached_v, positions) -> (n,) higher = recompute first
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Schedule:
    base: torch.Tensor  # (n_b,) sorted positions computed in every layer (fresh tokens, forced repairs)
    candidates: torch.Tensor  # (n_c,) sorted reused positions CacheBlend may keep recomputing
    check_layer: int | None = None  # None: no selection, base alone runs through every layer
    n_select: int = 0
    scorer: Scorer | None = None


@dataclass(slots=True)
class ForwardTrace:
    tokens_per_layer: list[int] = field(default_factory=list)  # tokens through each whole layer
    kv_only_tokens: int = 0  # tokens whose K/V alone were computed at the check layer
    selected: torch.Tensor | None = None  # positions CacheBlend kept recomputing


def _masks(adapter: ModelAdapter, positions: torch.Tensor, length: int) -> list[torch.Tensor | None]:
    by_window: dict[int | None, torch.Tensor | None] = {}
    out = []
    for layer, window in enumerate(adapter.windows):
        if window not in by_window:
            by_window[window] = adapter.mask(positions, length, layer)
        out.append(by_window[window])
    return out


def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat((a, b)), sorted=True)


@torch.inference_mode()
def run_forward(adapter: ModelAdapter, ids: torch.Tensor, cache: ScatterCache, schedule: Schedule,
                length: int) -> tuple[torch.Tensor, ForwardTrace]:
    """Returns the last computed position's hidden state (1, 1, hidden) and a trace of the work done."""
    trace = ForwardTrace()
    check = schedule.check_layer if schedule.candidates.numel() else None
    positions = _union(schedule.base, schedule.candidates) if check is not None else schedule.base
    if positions.numel() == 0:
        raise RuntimeError("forward scheduled with no positions; the last prompt token must always be computed")
    hidden = adapter.embed(ids[positions])  # (1, n, hidden)
    cos_sin = adapter.rotary(hidden, positions)
    masks = _masks(adapter, positions, length)
    cache.length = length

    scores: dict[str, torch.Tensor] = {}
    scorer = schedule.scorer
    if check is not None and scorer is not None:
        cand_idx = torch.searchsorted(positions, schedule.candidates)  # where candidates sit in `positions`

        def on_update(layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
            if layer != check:
                return
            cached_k = cache.keys[layer][0, :, schedule.candidates].float()  # (H, n_c, D), before overwrite
            cached_v = cache.values[layer][0, :, schedule.candidates].float()
            fresh_k = k_new[0, :, cand_idx].float()
            fresh_v = v_new[0, :, cand_idx].float()
            scores["s"] = scorer(fresh_k, cached_k, fresh_v, cached_v, schedule.candidates)

        cache.on_update = on_update

    try:
        for layer in range(adapter.num_layers):
            cache.positions = positions
            if check is not None and layer == check:
                # K/V of every computed token (scored by on_update before they overwrite the cached ones),
                # then the whole layer for the kept tokens only, which attend to those fresh K/V.
                adapter.layer_kv(layer, hidden, masks[layer], cos_sin, positions, cache)
                trace.kv_only_tokens = int(positions.numel())
                cache.on_update = None
                keep = _select(schedule, scores.get("s"))
                trace.selected = keep
                new_positions = _union(schedule.base, keep)
                idx = torch.searchsorted(positions, new_positions)
                hidden = hidden[:, idx]  # (1, n', hidden): only these run through this layer and the ones above
                positions = new_positions
                cos_sin = (cos_sin[0][:, idx], cos_sin[1][:, idx])
                masks = _masks(adapter, positions, length)
                cache.positions = positions
            hidden = adapter.run_layer(layer, hidden, masks[layer], cos_sin, positions, cache)
            trace.tokens_per_layer.append(int(positions.numel()))
    finally:
        cache.on_update = None
        cache.positions = None
    return hidden[:, -1:], trace


def _select(schedule: Schedule, score: torch.Tensor | None) -> torch.Tensor:
    k = min(schedule.n_select, int(schedule.candidates.numel()))
    if k <= 0:
        return schedule.candidates[:0]
    if score is None:
        raise RuntimeError("CacheBlend selection ran without deviation scores")
    top = torch.topk(score, k, sorted=False).indices
    return torch.sort(schedule.candidates[top]).values


@torch.inference_mode()
def decode_step(adapter: ModelAdapter, all_ids: torch.Tensor, position: int, cache: ScatterCache) -> torch.Tensor:
    """Run the token at ``all_ids[position]``, attending to slots [0, position]. Returns logits (vocab,)."""
    pos = torch.tensor([position], device=all_ids.device)
    hidden, _ = run_forward(adapter, all_ids, cache, Schedule(base=pos, candidates=pos[:0]), position + 1)
    return adapter.logits(hidden)[0, -1]  # inside inference_mode (decorator): no autograd graph

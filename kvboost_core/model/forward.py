"""The planned forward pass: run each layer only for the positions that need computing.

Every reuse strategy is one schedule for this loop. Positions not computed keep the K/V already placed in
the cache (exact or re-rotated); computed positions overwrite theirs in each layer they run through, and
attend with an exactly causal mask over the whole buffer. CacheBlend computes a wider set below its check
layer; at the check layer it computes only the K/V of that set (enough to score the deviation and to
leave fresh K/V for every candidate there), picks the tokens to keep recomputing, and runs the rest of the
check layer and every layer above for those alone: the saving is real rather than a copy of a full prefill.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_core.model import attention, replay, slices
from kvboost_core.model.driver import ModelDriver, ScatterCache

# score(fresh_k, cached_k, fresh_v, cached_v, positions) -> (n,) higher = recompute first
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Schedule:
    base: torch.Tensor  # (n_b,) sorted positions computed in every layer (fresh tokens, forced repairs)
    candidates: torch.Tensor  # (n_c,) sorted reused positions CacheBlend may keep recomputing
    check_layer: int | None = None  # None: no selection, base alone runs through every layer
    n_select: int = 0  # at least this many candidates are kept
    scorer: Scorer | None = None
    # Adaptive selection: keep the fewest top-scored candidates whose scores sum to ``mass`` of the total,
    # at least ``n_select`` and at most ``n_max`` of them (mass 0: exactly ``n_select``).
    mass: float = 0.0
    n_max: int = 0
    # Query-aware selection: weight each candidate's score by the attention the last ``observers`` computed
    # positions (the question and the template's tail) pay it at the check layer. 0: off.
    observers: int = 0
    # Progressive selection (CacheBlend's gradual filtering, LMCache's check_layers): at ``recheck_layer``
    # (> check_layer) the kept candidates are scored again on that layer's deviation and only the top
    # ``n_recheck`` keep running above it. None: one check layer.
    recheck_layer: int | None = None
    n_recheck: int = 0

    def keeps_every_candidate(self) -> bool:
        """Whether every candidate is recomputed in every layer (nothing approximate is left to read)."""
        n_c = int(self.candidates.numel())
        if self.check_layer is None or n_c == 0 or self.n_select < n_c:
            return False
        return self.recheck_layer is None or self.n_recheck >= n_c


@dataclass(slots=True)
class ForwardTrace:
    tokens_per_layer: list[int] = field(default_factory=list)  # tokens through each whole layer
    kv_only_tokens: int = 0  # tokens whose K/V alone were computed at the check layer
    selected: torch.Tensor | None = None  # positions CacheBlend kept recomputing
    # Attention work per layer, in (query, key) pairs: the causal minimum for the rows computed (each reads
    # keys up to its own position) and what the kernels were asked to compute (whole query blocks' key spans,
    # or every key under the former dense mask). A cold SDPA prefill's fused causal kernel counts as causal.
    causal_pairs: list[int] = field(default_factory=list)
    computed_pairs: list[int] = field(default_factory=list)
    length: int = 0  # keys attended: [0, length)
    check_layers: list[int] = field(default_factory=list)  # layers that ran a K/V-only scoring pass
    # rows whose Q/K/V projections a check layer's whole-layer pass read from its scoring pass (not recomputed)
    replayed_tokens: int = 0


# The check layer's kept rows read their Q/K/V projections from its scoring pass (kvboost_core.model.replay); False
# projects them again (the former behaviour, kept as the reference the tests compare with).
REUSE_CHECK_PROJECTIONS = True
_RECORD = threading.local()  # .traces: a list every run_forward on this thread appends its trace to


@contextlib.contextmanager
def record_traces() -> Iterator[list[ForwardTrace]]:
    """Within the block, every planned forward on this thread appends its :class:`ForwardTrace` to the yielded
    list (benchmarks: the FLOP model reads the work actually scheduled)."""
    out: list[ForwardTrace] = []
    _RECORD.traces = out
    try:
        yield out
    finally:
        _RECORD.traces = None


def _pairs(positions: torch.Tensor, length: int, window: int | None, plan: Any) -> tuple[int, int]:
    """(causal, computed) query-key pairs of one layer's attention for ``positions``."""
    seen = positions + 1 if window is None else torch.clamp(positions + 1, max=window)
    causal = int(seen.sum())
    if isinstance(plan, attention.RowBlocks):
        return causal, sum((b.end - b.start) * (b.k_hi - b.k_lo) for b in plan.blocks)
    if plan is None:  # SDPA's causal kernel over a cold prefill
        return causal, causal
    return causal, int(positions.numel()) * length


def _masks(driver: ModelDriver, positions: torch.Tensor, length: int, impl: str) -> list[Any]:
    """Each layer's attention plan for ``positions``, built once per forward (per distinct window): None for a
    cold prefill under SDPA (its fused causal kernel), else :class:`RowBlocks` (causal query blocks), or with
    ``attention.BLOCK_ROWS == 0`` the former dense (1, 1, n, T) mask, kept as the reference."""
    full = positions.numel() == length and (length == 0 or int(positions[-1]) == length - 1)
    by_window: dict[int | None, Any] = {}
    out = []
    for window in driver.windows:
        if window not in by_window:
            if full and window is None and impl == "sdpa":
                by_window[window] = None
            elif attention.BLOCK_ROWS <= 0:
                by_window[window] = dense_mask(positions, length, window, impl=impl, dtype=driver.dtype)
            else:
                by_window[window] = attention.row_blocks(positions, length, window, impl=impl, dtype=driver.dtype)
        out.append(by_window[window])
    return out


def dense_mask(q_pos: torch.Tensor, length: int, window: int | None, *, impl: str, dtype: torch.dtype
               ) -> torch.Tensor:
    """The dense causal mask (1, 1, n, T) every computed row used to attend with: bool for SDPA, additive for
    eager. Each row reads all T keys; the reference the block attention is checked against."""
    allowed = attention.visible(q_pos, torch.arange(length, device=q_pos.device), window)  # (n, T)
    allowed = allowed.view(1, 1, *allowed.shape)  # (1, 1, n, T)
    return attention.additive(allowed, impl, dtype) if impl == "eager" else allowed


def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat((a, b)), sorted=True)


@torch.inference_mode()
def run_forward(driver: ModelDriver, ids: torch.Tensor, cache: ScatterCache, schedule: Schedule,
                length: int) -> tuple[torch.Tensor, ForwardTrace]:
    """Returns the last computed position's hidden state (1, 1, hidden) and a trace of the work done."""
    trace = ForwardTrace(length=length)
    recording: list[ForwardTrace] | None = getattr(_RECORD, "traces", None)
    if recording is not None:
        recording.append(trace)
    check = schedule.check_layer if schedule.candidates.numel() else None
    positions = _union(schedule.base, schedule.candidates) if check is not None else schedule.base
    if positions.numel() == 0:
        raise RuntimeError("forward scheduled with no positions; the last prompt token must always be computed")
    hidden = driver.embed(ids[positions])  # (1, n, hidden)
    cos_sin = driver.rotary(hidden, positions)
    config = driver.model.config
    impl = attention.base_impl(config)
    masks = _masks(driver, positions, length, impl)
    cache.length = length

    # Check layers in order, each with the positions it scores (the candidates still kept) and how it keeps.
    checks: list[int] = []
    if check is not None:
        checks.append(check)
        if schedule.recheck_layer is not None and schedule.recheck_layer > check:
            checks.append(min(schedule.recheck_layer, driver.num_layers - 1))
    cands = schedule.candidates
    projected: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    with attention.switched(config):
        try:
            for layer in range(driver.num_layers):
                cache.positions = positions
                if checks and layer == checks[0]:
                    checks.pop(0)
                    trace.check_layers.append(layer)
                    # K/V of every computed token (scored before they overwrite the cached ones), then the whole
                    # layer for the kept tokens only, which attend to those fresh K/V.
                    attn = driver.inner.layers[layer].self_attn
                    reuse = REUSE_CHECK_PROJECTIONS and driver.reader is None  # a reader gates projections per row
                    capturing: contextlib.AbstractContextManager[dict[str, torch.Tensor]] = (
                        replay.capture(attn) if reuse else contextlib.nullcontext({}))
                    with capturing as captured:
                        score = _check_scores(driver, layer, hidden, masks[layer], cos_sin, positions, cache,
                                              cands, schedule, observers=schedule.observers if layer == check else 0)
                    n_scored = int(positions.numel())
                    if layer == check:
                        trace.kv_only_tokens = int(positions.numel())
                        keep = _select(schedule, score)
                    else:  # a re-check narrows what the first check kept; no adaptive mass, no observers
                        keep = _top(cands, score, schedule.n_recheck)
                        trace.kv_only_tokens += int(positions.numel())
                    cands = keep
                    trace.selected = keep
                    new_positions = _union(schedule.base, keep)
                    idx = torch.searchsorted(positions, new_positions)
                    hidden = hidden[:, idx]  # (1, n', hidden): only these run through this layer and the ones above
                    positions = new_positions
                    cos_sin = (cos_sin[0][:, idx], cos_sin[1][:, idx])
                    masks = _masks(driver, positions, length, impl)
                    cache.positions = positions
                    if captured and all(t.shape[:2] == (1, n_scored) for t in captured.values()):
                        # the kept rows' Q/K/V projections were computed by the scoring pass: read them
                        projected = replay.replaying(attn, captured, idx)
                        trace.replayed_tokens += int(positions.numel())
                with projected:
                    hidden = driver.run_layer(layer, hidden, masks[layer], cos_sin, positions, cache)
                projected = contextlib.nullcontext()
                trace.tokens_per_layer.append(int(positions.numel()))
                _record(trace, recording, driver, layer, positions, length, masks[layer])
                slices.layer_done(int(positions.numel()), driver.num_layers)  # a sliced call may pause here
        finally:
            cache.on_update = None
            cache.positions = None
            if driver.reader is not None:  # later plain HF calls on this thread run the base model
                driver.reader.set_rows(positions, None)
    return hidden[:, -1:], trace


def _record(trace: ForwardTrace, recording: list[ForwardTrace] | None, driver: ModelDriver, layer: int,
            positions: torch.Tensor, length: int, plan: Any) -> None:
    if recording is not None:
        causal, computed = _pairs(positions, length, driver.windows[layer], plan)
        trace.causal_pairs.append(causal)
        trace.computed_pairs.append(computed)


def _check_scores(driver: ModelDriver, layer: int, hidden: torch.Tensor, mask: Any,
                  cos_sin: Any, positions: torch.Tensor, cache: ScatterCache, cands: torch.Tensor,
                  schedule: Schedule, observers: int) -> torch.Tensor | None:
    """Compute this layer's K/V for ``positions`` (written into the cache) and score ``cands`` (a subset of
    them) by how far their fresh K/V moved from the cached K/V. Returns (n_c,) scores, or None without a scorer."""
    scorer = schedule.scorer
    scores: dict[str, torch.Tensor] = {}
    captured: dict[str, torch.Tensor] = {}
    cand_idx = torch.searchsorted(positions, cands)  # where candidates sit in `positions`

    def on_update(at: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        if at != layer or scorer is None:
            return
        cached_k = cache.keys[at][0, :, cands].float()  # (H, n_c, D), before the overwrite
        cached_v = cache.values[at][0, :, cands].float()
        scores["s"] = scorer(k_new[0, :, cand_idx].float(), cached_k, v_new[0, :, cand_idx].float(), cached_v,
                             cands)

    cache.on_update = on_update
    hook = _capture_queries(driver, layer, captured) if observers else None
    try:
        driver.layer_kv(layer, hidden, mask, cos_sin, positions, cache)
    finally:
        cache.on_update = None
        if hook is not None:
            hook.remove()
    score = scores.get("s")
    if score is not None and "q" in captured:
        att = observer_attention(captured["q"], cache.keys[layer][0, :, :cache.length], positions, cos_sin, cands,
                                 observers)
        score = score * att  # the deviation the question actually reads
    return score


def _capture_queries(driver: ModelDriver, layer: int, out: dict[str, torch.Tensor]) -> Any:
    """Keep the check layer's query projection output (after its q-norm where the family has one)."""
    attn = driver.inner.layers[layer].self_attn
    module = getattr(attn, "q_norm", None) or attn.q_proj

    def hook(_mod: Any, _inp: Any, output: torch.Tensor) -> None:
        out["q"] = output

    return module.register_forward_hook(hook)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def observer_attention(q_raw: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, cos_sin: Any,
                       candidates: torch.Tensor, observers: int) -> torch.Tensor:
    """Mean attention (over heads and observers) that the last ``observers`` computed positions pay each
    candidate at this layer, over every key in [0, length) with a causal mask. Returns (n_c,) summing to <= 1.

    q_raw: (1, n, H*D) or (1, n, H, D) query projections of ``positions``; keys: (H_kv, T, D) rotated keys."""
    h_kv, length, d = keys.shape
    n = positions.numel()
    q = q_raw.reshape(n, -1, d).transpose(0, 1).float()  # (H, n, D)
    obs = torch.arange(max(0, n - observers), n, device=q.device)
    cos, sin = cos_sin[0][0, obs].float(), cos_sin[1][0, obs].float()  # (m, D)
    q = q[:, obs] * cos + _rotate_half(q[:, obs]) * sin  # (H, m, D) RoPE at the observers' positions
    groups = q.shape[0] // h_kv
    k = keys.float().repeat_interleave(groups, dim=0)  # (H, T, D)
    logits = q @ k.transpose(1, 2) / d**0.5  # (H, m, T)
    causal = attention.visible(positions[obs], torch.arange(length, device=q.device), None)  # (m, T)
    logits = logits.masked_fill(~causal, float("-inf"))
    att = torch.softmax(logits, dim=-1).mean(dim=(0, 1))  # (T,)
    return att[candidates]


def _select(schedule: Schedule, score: torch.Tensor | None) -> torch.Tensor:
    n_c = int(schedule.candidates.numel())
    k = min(schedule.n_select, n_c)
    if score is None:
        if k <= 0:
            return schedule.candidates[:0]
        raise RuntimeError("CacheBlend selection ran without deviation scores")
    if schedule.mass > 0 and n_c:
        ordered = torch.sort(score.clamp_min(0), descending=True).values
        share = torch.cumsum(ordered, 0) / ordered.sum().clamp_min(1e-12)
        need = int(torch.searchsorted(share, torch.tensor(schedule.mass, device=share.device))) + 1
        k = max(k, min(need, schedule.n_max or n_c, n_c))
    return _top(schedule.candidates, score, k)


def _top(candidates: torch.Tensor, score: torch.Tensor | None, k: int) -> torch.Tensor:
    """The ``k`` highest-scored candidates, sorted by position."""
    k = min(k, int(candidates.numel()))
    if k <= 0:
        return candidates[:0]
    if score is None:
        raise RuntimeError("CacheBlend selection ran without deviation scores")
    top = torch.topk(score, k, sorted=False).indices
    return torch.sort(candidates[top]).values


@torch.inference_mode()
def decode_step(driver: ModelDriver, all_ids: torch.Tensor, position: int, cache: ScatterCache) -> torch.Tensor:
    """Run the token at ``all_ids[position]``, attending to slots [0, position]. Returns logits (vocab,)."""
    pos = torch.tensor([position], device=all_ids.device)
    hidden, _ = run_forward(driver, all_ids, cache, Schedule(base=pos, candidates=pos[:0]), position + 1)
    return driver.logits(hidden)[0, -1]  # inside inference_mode (decorator): no autograd graph

"""Prefill: a prompt's KV assembled from the cache, repaired, and its next-token logits.

One call runs lookup (store entries for the prompt's chunks) -> place (re-rotated into a fresh cache) -> forward
(the repair schedule: what is recomputed, in which layers) -> stats (what was reused, exact or not) -> store the
prefix (the exact part as prefix entries, the rest as "repaired" when the config allows).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvboost_core.assembly import (
    APPROX,
    EXACT,
    FRESH,
    REPAIRED,
    Plan,
    chunk_prefix_keys,
    lookup,
    place,
    plan_chunks,
)
from kvboost_core.call_options import call_options
from kvboost_core.engine.base import EngineBase
from kvboost_core.keys import kv_precision
from kvboost_core.kv_encode import maybe_quantize
from kvboost_core.model.driver import ScatterCache
from kvboost_core.model.forward import Schedule, run_forward
from kvboost_core.repair import RepairSpec, build_schedule
from kvboost_core.results import AssembledCache, PrefillResult, PrefillStats
from kvboost_core.segments import TokenizedSegment
from kvboost_core.store import DensePayload, KVBlock


class PrefillMixin(EngineBase):
    """``prefill()`` and the steps it shares with warming and generation (cache buffers, stored blocks)."""

    def new_cache(self, capacity: int) -> ScatterCache:
        a = self.driver
        shape = (1, a.num_kv_heads, capacity, a.head_dim)
        if a.no_reuse:  # HF's own cache holds the KV; a zero-stride view keeps the capacity without the memory
            one = torch.empty(1, a.num_kv_heads, 1, a.head_dim, dtype=a.dtype, device=a.device).expand(shape)
            return ScatterCache([one] * a.num_layers, [one] * a.num_layers)
        # empty, not zeros: every slot below `length` is either placed or computed before it is read.
        keys = [torch.empty(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        values = [torch.empty(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        return ScatterCache(keys, values)

    def stored_block(self, cache: ScatterCache | AssembledCache, ids: Sequence[int], start: int, *, kind: str,
               parent: Any, digest: bytes = b"") -> KVBlock:
        end = start + len(ids)
        k = torch.stack([kb[0, :, start:end] for kb in cache.keys]).clone()  # (L, H, n, D)
        v = torch.stack([vb[0, :, start:end] for vb in cache.values]).clone()
        # The chunk at the sequence start holds the attention sink (BOS), whose outlier keys would widen every
        # channel's quantization range; it is a single chunk per prefix chain, so it stays dense.
        bits = None if start == 0 else self.config.kv_bits
        # Rotatable RoPE: quantize keys pre-RoPE (position 0); placement rotates them to where they land.
        rotary = self.driver.inner.rotary_emb if self.driver.layerwise and self.driver.rope.rerotatable else None
        payload = maybe_quantize(DensePayload(k, v), bits, self.config.kv_group_size, start=start,
                                 rotary_emb=rotary)
        return KVBlock(tuple(ids), payload, start, self.fingerprint, self.config.namespace, kind=kind,
                       parent=parent, context_digest=digest)

    def prompt_chunks(self, prompt: Any, add_special_tokens: bool | None
                       ) -> tuple[list[TokenizedSegment], int, list[Any]]:
        """The prompt's segments, token count and chunks; refuses an empty prompt or one over the context."""
        segs = self.tokenize(prompt, add_special_tokens)
        total = sum(len(s.token_ids) for s in segs)
        if total == 0:
            raise ValueError("the prompt is empty after tokenization; pass non-empty text")
        self._check_context(total)
        return segs, total, plan_chunks(segs, self.spans)

    def _prefill(self, prompt: Any, spec: RepairSpec, n_new: int, add_special_tokens: bool | None,
                 t0: float, prepared: tuple[list[TokenizedSegment], int, list[Any]] | None = None,
                 count: bool = True) -> tuple[PrefillResult, Plan, ScatterCache]:
        segs, total, chunks = prepared or self.prompt_chunks(prompt, add_special_tokens)
        t_tok = time.perf_counter()
        # Repaired (approximate) prefixes are served only where this engine stores them: never by default.
        allow_repaired = spec.repair != "full" and spec.reuse_repaired and self.config.store_repaired
        if self.driver.no_reuse:
            plan = Plan(token_ids=[t for s in segs for t in s.token_ids], chunks=chunks, status=[FRESH] * total,
                        misses=total)
        else:
            plan = lookup(self.store, segs, chunks, namespace=self.config.namespace, fingerprint=self.fingerprint,
                          spans_of=self.spans, sink_tokens=self.config.sink_tokens,
                          allow_approx=self.driver.rope.rerotatable, allow_repaired=allow_repaired,
                          precision=kv_precision(self.config.kv_bits, self.config.kv_group_size))
        t_lookup = time.perf_counter()
        ctx = self.driver.max_context or (total + n_new)
        cache = self.new_cache(max(total, min(total + n_new, ctx)))
        a = self.driver
        place(plan, cache.keys, cache.values, a.inner.rotary_emb if a.layerwise else None)
        t_place = time.perf_counter()
        ids_t = torch.tensor(plan.token_ids, device=a.device)
        if a.layerwise:
            schedule = build_schedule(plan, spec, a.num_layers, a.device)
            cache.gate_from = self._gate_from(plan, spec, schedule)
            with torch.inference_mode():
                hidden, trace = run_forward(a, ids_t, cache, schedule, total)
                logits = a.logits(hidden)[0, -1].float()
            final = schedule.base if trace.selected is None else torch.unique(torch.cat((schedule.base,
                                                                                        trace.selected)))
            per_layer, kv_only = trace.tokens_per_layer, trace.kv_only_tokens
        else:
            reused = min(plan.exact_len, total - 1)  # the last token's logits are the output: compute it
            logits = a.hf_prefill(ids_t, cache, reused).float()
            final = torch.arange(reused, total)
            per_layer, kv_only = [total - reused] * a.num_layers, 0
        t_fwd = time.perf_counter()
        stats = self.prefill_stats(plan, final, spec, per_layer)
        stats.reader, stats.check_kv_tokens = cache.gate_from is not None, kv_only
        stats.tokenize_s, stats.lookup_s, stats.assemble_s = t_tok - t0, t_lookup - t_tok, t_place - t_lookup
        stats.forward_s, stats.prefill_s = t_fwd - t_place, t_fwd - t0
        if count:  # a backfill step is not a request: stats() counts it apart
            self._counters.add(hits_exact=plan.hits_exact, hits_repaired=plan.hits_repaired,
                               hits_content=plan.hits_content, misses=plan.misses, prefills=1)
        result = PrefillResult(token_ids=list(plan.token_ids), last_logits=logits,
                               cache=AssembledCache(cache.keys, cache.values, total), stats=stats)
        return result, plan, cache

    def _gate_from(self, plan: Plan, spec: RepairSpec, schedule: Schedule) -> int | None:
        """Where the reader adapter starts: after the last re-placed (approximate) token, when the schedule may
        leave any of them unrecomputed; None (the base model throughout) otherwise, so exact and fully
        recomputed prompts are answered exactly as the base model answers them."""
        if self.reader is None or spec.repair == "full":
            return None
        approx = [i for i, s in enumerate(plan.status) if s in (APPROX, REPAIRED)]
        if not approx:
            return None
        if schedule.keeps_every_candidate():
            return None  # CacheBlend keeps every candidate: nothing approximate is read
        return approx[-1] + 1

    def prefill_stats(self, plan: Plan, final: torch.Tensor, spec: RepairSpec, per_layer: list[int]
                      ) -> PrefillStats:
        status = torch.tensor(plan.status, dtype=torch.int8)
        in_final = torch.zeros(len(plan.status), dtype=torch.bool)
        in_final[final.cpu()] = True
        total = len(plan.status)
        reused_exact = int(((status == EXACT) & ~in_final).sum())
        reused_approx = int(((status == APPROX) & ~in_final).sum())
        reused_repaired = int(((status == REPAIRED) & ~in_final).sum())  # an earlier repair's approximation
        computed = int((status == FRESH).sum())
        recomputed = total - reused_exact - reused_approx - reused_repaired - computed
        # Under a block adapter at repair="none", a re-placed document is exactly that model's block prefill
        # (kvboost_core.lora.block_prefill); with any recompute it is neither that nor a full prefill: approximate.
        reused_block = reused_approx if self.block is not None and spec.repair == "none" else 0
        reused_approx -= reused_block
        return PrefillStats(
            prompt_tokens=total, reused_exact=reused_exact, reused_block=reused_block, reused_approx=reused_approx,
            reused_repaired=reused_repaired, recomputed=recomputed, computed=computed,
            reuse_ratio=(reused_exact + reused_block + reused_approx + reused_repaired) / total, repair=spec.repair,
            recompute_ratio=spec.recompute_ratio, select=spec.select, recheck_layer=spec.recheck_layer,
            tokens_per_layer=per_layer, hits_exact=plan.hits_exact, hits_repaired=plan.hits_repaired,
            hits_content=plan.hits_content, misses=plan.misses)

    def _store_prefix(self, plan: Plan, cache: ScatterCache, spec: RepairSpec, enabled: bool | None) -> None:
        if not (self.config.store_prefix if enabled is None else enabled) or self.driver.no_reuse:
            return
        # KV is exact up to the first approximate position: a re-placed token that was not recomputed in
        # every layer with an exact context, or a repaired prefix hit. Chunks past it are stored as "repaired".
        frontier = len(plan.status)
        if spec.repair != "full":  # full recomputes every re-placed token and never serves repaired entries
            first_approx = next((i for i, s in enumerate(plan.status) if s == APPROX), frontier)
            frontier = min(first_approx, frontier if plan.repaired_from is None else plan.repaired_from)
        full_hits = {pl.dst for pl in plan.placements if pl.exact and pl.length == pl.block.num_tokens}
        for ch, (parent, key, digest) in zip(plan.chunks, chunk_prefix_keys(
                self.config.namespace, self.fingerprint, plan.token_ids, plan.chunks,
                precision=kv_precision(self.config.kv_bits, self.config.kv_group_size))):
            if ch.end <= plan.exact_len and ch.start in full_hits:
                continue  # stored already: it was the hit
            kind = "prefix" if ch.end <= frontier else "repaired"
            if kind == "repaired" and not self.config.store_repaired:
                break
            block = self.stored_block(cache, plan.token_ids[ch.start:ch.end], ch.start, kind=kind, parent=parent,
                                digest=digest)
            self.store.put(key, block)

    def prefill(self, prompt: Any, *, repair: str | None = None, recompute_ratio: float | None = None,
                select: str | None = None, check_layer: int | None = None,
                add_special_tokens: bool | None = None, store_prefix: bool | None = None,
                reuse_repaired: bool = True, recompute_mass: float | None = None,
                query_tokens: int | None = None, recheck_layer: int | None = None,
                recheck_ratio: float | None = None) -> PrefillResult:
        """Assemble the prompt's KV from the cache, repair it, and return the next-token logits.

        ``reuse_repaired=False`` ignores prefix entries stored from earlier repaired (approximate) prefills, so
        the call measures its own strategy; ``repair="full"`` always ignores them."""
        t0 = time.perf_counter()
        opts = call_options(self.config, self.driver.num_layers, dict(
            repair=repair, recompute_ratio=recompute_ratio, select=select, check_layer=check_layer,
            reuse_repaired=reuse_repaired, recompute_mass=recompute_mass, query_tokens=query_tokens,
            recheck_layer=recheck_layer, recheck_ratio=recheck_ratio, add_special_tokens=add_special_tokens,
            store_prefix=store_prefix))
        spec = opts.spec
        result, plan, cache = self._prefill(prompt, spec, 0, add_special_tokens, t0)
        self._store_prefix(plan, cache, spec, store_prefix)
        return result

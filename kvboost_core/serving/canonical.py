"""History-independent prefill: a prompt's KV, and so its output, depends only on the prompt and the warmed
documents, never on which earlier prompts left prefix entries in the store.

Why: :meth:`KVEngine._prefill` computes, in one forward pass, every position that no cache entry covers. Which
positions those are depends on the prefix entries earlier requests stored, and a position's K/V depends in its
last bits on how many positions are computed with it (BLAS and the attention kernel pick their blocking by
shape). So the same prompt got slightly different logits on a cold server and after requests that share its
head (measured on SmolLM2: up to 2.3e-5; enough to flip a greedy near-tie). A server whose answer depends on
which requests came before is not deterministic.

How: the plan is made from the prompt and the warmed documents alone (content hits), and the prompt is cut at
``p``, the start of the chunk holding the first re-placed document token (or the last prompt token). Every
whole chunk before ``p`` is *canonical*: computed on its own (one forward for that chunk's positions, over the
canonical KV before it), or loaded from the store where an earlier request stored exactly that (same chunk,
same chunks before it). Either way its KV is bitwise the same. The rest of the prompt then runs in one forward
whose positions depend only on the plan. Canonical chunks live on a prefix chain of their own (rooted apart from
the engine's ordinary prefix entries, whose KV comes from other computations); partial-chunk and "repaired"
prefix hits are not used. With ``kv_bits`` set, a computed canonical chunk is quantized and placed back before
it is used, exactly as a stored one would be served.

A chat's history (``exact_before``: the prompt up to the end of its last assistant message, see
:mod:`kvboost_core.engine.exact_history`) is never re-placed: its documents are computed like any other head token, so
the history's KV is the exact full-attention prefill in canonical chunks, bitwise the same whether a backfill
stored them or the prompt computes them now.

Cost: the prompt head is computed chunk by chunk (``chunk_size`` positions per forward) instead of in one pass;
the chunks between ``p`` and the question are unchanged. Nothing is lost on a warm head: it is one exact hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from kvboost_core.assembly import (
    APPROX,
    EXACT,
    FRESH,
    Chunk,
    Placement,
    Plan,
    chunk_prefix_keys,
    lookup,
    place,
)
from kvboost_core.keys import CacheKey, kv_precision, prefix_key, root_key
from kvboost_core.model.driver import ScatterCache
from kvboost_core.model.forward import Schedule, run_forward
from kvboost_core.repair import RepairSpec, build_schedule
from kvboost_core.results import AssembledCache, PrefillResult
from kvboost_core.segments import TokenizedSegment
from kvboost_core.stages import EngineStages
from kvboost_core.store.base import KVStore

_CHAIN = (-1,)  # no tokenizer emits -1: the canonical chain's root differs from the engine's prefix chain


def canonical_root(namespace: str, fingerprint: Any, precision: str) -> CacheKey:
    return prefix_key(root_key(namespace, fingerprint, precision=precision), _CHAIN)


class _ContentOnly:
    """The store as the plan may see it: warmed documents' content entries, no prefix entries."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def get(self, key: CacheKey) -> Any:
        block = self._store.get(key)
        return block if block is not None and block.kind == "content" else None

    def children(self, parent: CacheKey) -> list[CacheKey]:
        return []


@dataclass(slots=True)
class CanonicalPrefill:
    result: PrefillResult
    prefix_end: int  # p: positions [0, p) are canonical chunks
    hit_end: int  # positions [0, hit_end) came from stored canonical chunks
    to_store: list[tuple[CacheKey, Any]] = field(default_factory=list)  # (key, KVBlock) of computed chunks


class CanonicalJob:
    """One prompt's canonical prefill, in steps: construction plans and places (cheap), :meth:`advance` computes
    head chunks (as few as a budget of tokens allows, at least one), :meth:`finish` the rest. How the head is
    split over calls never changes a bit of the result: each head chunk is its own forward either way, which is
    what lets a scheduler interleave a long cold prompt's prefill with decode steps (chunked prefill)."""

    def __init__(self, engine: EngineStages, prompt: Any, spec: RepairSpec, add_special_tokens: bool | None,
                 *, build_blocks: bool, prepared: tuple[list[TokenizedSegment], int, list[Chunk]] | None = None,
                 exact_before: int = 0, capacity: int = 0, head_end: int | None = None) -> None:
        """``prepared``: the prompt's (segments, tokens, chunks), tokenized already. ``exact_before``: no
        document starting before this position is re-placed (a chat's history: computed exactly, in canonical
        chunks). ``capacity``: cache slots (at least the prompt's; decode needs more). ``head_end``: cut here
        instead (a chunk end; a backfill's canonical chunks)."""
        t0 = time.perf_counter()
        a = engine.driver
        if a.no_reuse or not a.layerwise:
            raise ValueError("canonical prefill needs a layer-wise model driver (a Llama-like RoPE family)")
        segs, total, chunks = prepared or engine.prompt_chunks(prompt, add_special_tokens)
        t_tok = time.perf_counter()
        cfg = engine.config
        view = cast(KVStore, _ContentOnly(engine.store))  # lookup reads get() and children() only
        precision = kv_precision(cfg.kv_bits, cfg.kv_group_size)  # the key space of this engine's stored KV
        if exact_before > 0:  # the history's documents are not re-placed: not looked up by content
            segs = [replace(s, cacheable=False) if s.start < exact_before else s for s in segs]
        plan = lookup(view, segs, chunks, namespace=cfg.namespace, fingerprint=engine.fingerprint,
                      spans_of=engine.spans, sink_tokens=cfg.sink_tokens, allow_approx=a.rope.rerotatable,
                      allow_repaired=False, precision=precision)
        ids = plan.token_ids
        first = min(next((i for i, s in enumerate(plan.status) if s == APPROX), total - 1), total - 1)
        p = max(ch.start for ch in chunks if ch.start <= first) if head_end is None else head_end
        head = [ch for ch in chunks if ch.end <= p]

        # stored canonical chunks, whole ones only, chained from the canonical root
        chain = chunk_prefix_keys(cfg.namespace, engine.fingerprint, ids, head, precision=precision,
                                  root=canonical_root(cfg.namespace, engine.fingerprint, precision))
        hits, hit_end = 0, 0
        for ch, (_, key, dig) in zip(head, chain):
            block = engine.store.get(key)
            if not (block is not None and block.kind == "prefix" and block.base_position == ch.start
                    and list(block.token_ids) == ids[ch.start:ch.end] and block.context_digest == dig):
                break
            plan.placements.append(Placement(block, 0, ch.start, ch.end - ch.start, exact=True))
            hit_end, hits = ch.end, hits + 1
        t_lookup = time.perf_counter()
        self._cache = engine.new_cache(max(total, capacity))
        place(plan, self._cache.keys, self._cache.values, a.inner.rotary_emb)
        t_place = time.perf_counter()
        self._engine, self._spec, self._build = engine, spec, build_blocks
        self._plan, self._ids, self._total, self.prefix_end, self.hit_end = plan, ids, total, p, hit_end
        self._todo = list(zip(head, chain))[hits:]  # head chunks still to compute, in order
        self._ids_t = torch.tensor(ids, device=a.device)
        self._to_store: list[tuple[CacheKey, Any]] = []
        self._times = (t_tok - t0, t_lookup - t_tok, t_place - t_lookup)  # tokenize, lookup, assemble
        self._forward_s = 0.0

    @property
    def n_prompt(self) -> int:
        return self._total

    @property
    def cache(self) -> ScatterCache:
        """The per-layer buffers the prompt's KV is written into (``capacity`` slots)."""
        return self._cache

    @property
    def done(self) -> bool:
        """Every head chunk is computed: :meth:`finish` runs the rest in one forward."""
        return not self._todo

    def advance(self, budget: int | None = None) -> bool:
        """Compute head chunks in order until ``budget`` tokens are computed (at least one chunk; None: all of
        them); returns :attr:`done`."""
        engine, a, cfg = self._engine, self._engine.driver, self._engine.config
        t0 = time.perf_counter()
        spent = 0
        with torch.inference_mode():
            while self._todo and (budget is None or spent == 0 or spent < budget):
                ch, (par, key, dig) = self._todo.pop(0)
                pos = torch.arange(ch.start, ch.end, device=a.device)
                run_forward(a, self._ids_t, self._cache, Schedule(base=pos, candidates=pos[:0]), ch.end)
                spent += ch.end - ch.start
                if self._build or cfg.kv_bits is not None:
                    block = engine.stored_block(self._cache, self._ids[ch.start:ch.end], ch.start, kind="prefix",
                                          parent=par, digest=dig)
                    if cfg.kv_bits is not None:  # serve it as a stored chunk would be served: quantized
                        one = Plan(token_ids=self._ids, chunks=[],
                                   placements=[Placement(block, 0, ch.start, ch.end - ch.start, exact=True)])
                        place(one, self._cache.keys, self._cache.values, a.inner.rotary_emb)
                    if self._build:
                        self._to_store.append((key, block))
        self._forward_s += time.perf_counter() - t0
        return self.done

    def finish_head(self) -> list[tuple[CacheKey, Any]]:
        """Every head chunk computed, nothing after it (a backfill's step): the computed chunks to store."""
        self.advance(None)
        out, self._to_store = self._to_store, []
        return out

    def finish(self) -> CanonicalPrefill:
        """The rest of the prompt in one forward (after any head chunks not computed yet): the result."""
        self.advance(None)
        engine, a, spec, plan = self._engine, self._engine.driver, self._spec, self._plan
        ids, total, p, hit_end = self._ids, self._total, self.prefix_end, self.hit_end
        t0 = time.perf_counter()
        with torch.inference_mode():
            sched_plan = Plan(token_ids=ids, chunks=plan.chunks, placements=plan.placements,
                              status=[EXACT] * p + plan.status[p:])
            schedule = build_schedule(sched_plan, spec, a.num_layers, a.device)
            hidden, trace = run_forward(a, self._ids_t, self._cache, schedule, total)
            logits = a.logits(hidden)[0, -1].float()
        self._forward_s += time.perf_counter() - t0

        head_computed = torch.arange(hit_end, p, device=schedule.base.device)
        final = torch.unique(torch.cat([head_computed, schedule.base]
                                       + ([trace.selected] if trace.selected is not None else [])))
        stats_plan = Plan(token_ids=ids, chunks=plan.chunks, placements=plan.placements,
                          status=[EXACT] * hit_end + [FRESH] * (p - hit_end) + plan.status[p:],
                          exact_len=hit_end, hits_exact=hit_end, hits_content=plan.hits_content,
                          misses=total - hit_end - plan.hits_content)
        per_layer = [n + (p - hit_end) for n in trace.tokens_per_layer]
        stats = engine.prefill_stats(stats_plan, final, spec, per_layer)
        # prefill_s: compute time (a chunked prefill's wall time also holds the decode steps between chunks)
        stats.check_kv_tokens, stats.canonical_prefix_tokens = trace.kv_only_tokens, p
        stats.tokenize_s, stats.lookup_s, stats.assemble_s = self._times
        stats.forward_s, stats.prefill_s = self._forward_s, sum(self._times) + self._forward_s
        engine.counters.add(hits_exact=hit_end, hits_repaired=0, hits_content=plan.hits_content,
                             misses=stats_plan.misses, prefills=1)
        result = PrefillResult(token_ids=list(ids), last_logits=logits,
                               cache=AssembledCache(self._cache.keys, self._cache.values, total), stats=stats)
        return CanonicalPrefill(result, p, hit_end, self._to_store)


def canonical_prefill(engine: EngineStages, prompt: Any, spec: RepairSpec, add_special_tokens: bool | None,
                      *, build_blocks: bool) -> CanonicalPrefill:
    """``engine``'s prefill of ``prompt`` with a history-independent plan (see the module docstring), in one go.
    ``build_blocks``: keep the computed canonical chunks' blocks for storing."""
    return CanonicalJob(engine, prompt, spec, add_special_tokens, build_blocks=build_blocks).finish()

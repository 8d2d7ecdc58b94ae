"""Planning which prompt positions come from the cache, and placing that KV into the assembled buffers.

Lookup order: the longest exact prefix first (prefix keys chained from the root; the last matching chunk may
match only partly), then content hits for cacheable segments anywhere after it. Every hit is verified against
the request; a mismatch is a miss, never a wrong KV: a content hit by its own tokens, a prefix hit by its own
tokens *and* a chained digest of every token before it (a key is a 128-bit hash; a collision, forced or
accidental, must not serve KV computed after a different context).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvboost_core.chunking import common_prefix
from kvboost_core.kernels.ops import place_block
from kvboost_core.keys import CacheKey, Fingerprint, content_key, prefix_key, root_key
from kvboost_core.rope import delta_cos_sin
from kvboost_core.segments import TokenizedSegment
from kvboost_core.store.base import PREFIX_KINDS, KVBlock, KVStore

# Per-position status. REPAIRED: served from a "repaired" prefix entry (an earlier repaired prefill's KV, an
# approximation; only when the engine is configured to store and serve them): reused as is, never counted exact.
FRESH, EXACT, APPROX, REPAIRED = 0, 1, 2, 3
_DIGEST_SEED = b"kvboost/context/1"


def chain_digest(previous: bytes, token_ids: Sequence[int]) -> bytes:
    """blake2b-128 of the previous chunk's digest and this chunk's tokens: digest_i names tokens [0, end_i).

    A different hash family from the keys (xxh3), so one collision cannot defeat both."""
    h = hashlib.blake2b(previous or _DIGEST_SEED, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())  # the keys' token encoding
    return h.digest()


@dataclass(frozen=True, slots=True)
class Chunk:
    start: int  # prompt positions [start, end)
    end: int
    segment: int


@dataclass(frozen=True, slots=True)
class Placement:
    """``length`` tokens of ``block`` from ``src`` go to prompt position ``dst``."""

    block: KVBlock
    src: int
    dst: int
    length: int
    exact: bool

    @property
    def delta(self) -> int:
        return self.dst - (self.block.base_position + self.src)


@dataclass(slots=True)
class Plan:
    token_ids: list[int]
    chunks: list[Chunk]
    placements: list[Placement] = field(default_factory=list)
    status: list[int] = field(default_factory=list)  # per position: FRESH, EXACT or APPROX
    exact_len: int = 0  # positions [0, exact_len) come from the prefix chain
    repaired_from: int | None = None  # first position served from a "repaired" (approximate) prefix entry
    hits_exact: int = 0  # tokens
    hits_repaired: int = 0  # tokens of the prefix served from "repaired" entries (from ``repaired_from``)
    hits_content: int = 0
    misses: int = 0


def plan_chunks(segments: Sequence[TokenizedSegment], spans_of: Callable[[Sequence[int]], list[tuple[int, int]]]
                ) -> list[Chunk]:
    chunks = []
    for si, seg in enumerate(segments):
        for a, b in spans_of(seg.token_ids):
            chunks.append(Chunk(seg.start + a, seg.start + b, si))
    return chunks


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """Maximal [a, b) runs of True."""
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def lookup(store: KVStore, segments: Sequence[TokenizedSegment], chunks: Sequence[Chunk], *, namespace: str,
           fingerprint: Fingerprint, spans_of: Callable[[Sequence[int]], list[tuple[int, int]]],
           sink_tokens: int, allow_approx: bool, allow_repaired: bool = True, precision: str) -> Plan:
    ids = [t for seg in segments for t in seg.token_ids]
    total = len(ids)
    plan = Plan(token_ids=ids, chunks=list(chunks), status=[FRESH] * total)
    kinds = PREFIX_KINDS if allow_repaired else ("prefix",)
    frontier: int | None = None  # start of the first repaired (approximate) prefix hit

    # 1) exact prefix through the prefix chain
    parent = root_key(namespace, fingerprint, precision=precision)
    covered = 0
    digest = b""  # chained digest of the request's tokens [0, ch.start)
    for ch in chunks:
        want = ids[ch.start:ch.end]
        block = store.get(prefix_key(parent, want))
        if (block is not None and block.kind in kinds and block.base_position == ch.start
                and list(block.token_ids) == want and block.context_digest == chain_digest(digest, want)):
            plan.placements.append(Placement(block, 0, ch.start, len(want), exact=True))
            if block.kind == "repaired" and frontier is None:
                frontier = ch.start
            covered = ch.end
            parent = prefix_key(parent, want)
            digest = block.context_digest
            continue
        # partial: a stored child of the same parent that shares a leading run with the request. Its digest
        # covers its own tokens after *our* prefix exactly when it was computed after the same tokens.
        best, best_n = None, 0
        for child in store.children(parent):
            cand = store.get(child)
            if cand is None or cand.kind not in kinds or cand.base_position != ch.start or cand.parent != parent:
                continue
            n = common_prefix(cand.token_ids, ids[ch.start:])
            if n > best_n and cand.context_digest == chain_digest(digest, cand.token_ids):
                best, best_n = cand, n
        if best is not None and best_n > 0:
            plan.placements.append(Placement(best, 0, ch.start, best_n, exact=True))
            covered = ch.start + best_n
            if best.kind == "repaired" and frontier is None:
                frontier = ch.start
        break
    plan.exact_len = covered
    plan.repaired_from = frontier
    exact_end = covered if frontier is None else frontier
    for p in range(covered):
        plan.status[p] = EXACT if p < exact_end else REPAIRED
    plan.hits_exact = exact_end
    plan.hits_repaired = covered - exact_end

    # 2) content hits for cacheable segments after the exact prefix
    floor = max(covered, sink_tokens)
    for seg in segments:
        if not seg.cacheable or seg.end <= floor or not allow_approx:
            continue
        ref = seg.source_ids if seg.source_ids is not None else seg.token_ids
        d = seg.source_offset if seg.source_ids is not None else 0
        for ra, rb in spans_of(ref):
            lo, hi = max(ra - d, 0), min(rb - d, len(seg.token_ids))  # segment indices this chunk covers
            if lo >= hi:
                continue
            block = store.get(content_key(namespace, fingerprint, ref[ra:rb], precision=precision))
            if block is None or block.kind != "content" or list(block.token_ids) != list(ref[ra:rb]):
                continue  # a key collision or another kind of entry: a miss
            usable = [seg.token_ids[i] == ref[i + d] and seg.start + i >= floor for i in range(lo, hi)]
            for a, b in _runs(usable):
                i0 = lo + a
                plan.placements.append(Placement(block, i0 + d - ra, seg.start + i0, b - a, exact=False))
                for p in range(seg.start + i0, seg.start + lo + b):
                    plan.status[p] = APPROX
                plan.hits_content += b - a
    plan.misses = total - plan.hits_exact - plan.hits_repaired - plan.hits_content
    return plan


def place(plan: Plan, keys: list[torch.Tensor], values: list[torch.Tensor], rotary_emb) -> None:
    """Write every placement's K/V into the per-layer buffers (1, H, T, D), dequantizing once and re-rotating
    keys that moved, in one fused pass per placement (native kernel when built, torch reference otherwise).

    A placement moves all its tokens by one delta, so its rotation is one cos/sin row: computed once per
    distinct delta (a document's chunks share theirs) and broadcast, not evaluated per token."""
    device = keys[0].device
    by_delta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for pl in plan.placements:
        cos = sin = None
        if getattr(pl.block.payload, "keys_pre_rope", False):
            # keys stored at position 0 (pre-RoPE quantization): rotate to the absolute target positions
            pos = torch.arange(pl.dst, pl.dst + pl.length, dtype=torch.long, device=device)
            cos, sin = delta_cos_sin(rotary_emb, pos)  # (n, R) fp32
        elif pl.delta != 0:
            if pl.delta not in by_delta:
                by_delta[pl.delta] = delta_cos_sin(rotary_emb, torch.tensor([pl.delta], device=device))  # (1, R)
            row_cos, row_sin = by_delta[pl.delta]
            cos = row_cos.expand(pl.length, -1).contiguous()  # (n, R): the kernels take dense rows
            sin = row_sin.expand(pl.length, -1).contiguous()
        place_block(pl.block.payload, pl.src, pl.length, keys, values, pl.dst, cos, sin)


def chunk_prefix_keys(namespace: str, fingerprint: Fingerprint, ids: Sequence[int],
                      chunks: Sequence[Chunk], *, precision: str, root: CacheKey | None = None
                      ) -> list[tuple[CacheKey, CacheKey, bytes]]:
    """(parent, key, context digest) of every chunk's prefix entry, in order, in ``precision``'s key space: the
    one walk of a prefix chain. ``root``: the chain's root (default: the engine's ordinary prefix chain; the
    canonical chain of :mod:`kvboost_core.serving.canonical` has its own)."""
    out, digest = [], b""
    parent = root_key(namespace, fingerprint, precision=precision) if root is None else root
    for ch in chunks:
        key = prefix_key(parent, ids[ch.start:ch.end])
        digest = chain_digest(digest, ids[ch.start:ch.end])
        out.append((parent, key, digest))
        parent = key
    return out

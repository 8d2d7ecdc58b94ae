"""Block prefill through the model's own HF forward: the reference a block adapter is trained and checked on.

A block-attention model (Block-Attention, TurboRAG, KVLink) reads a prompt as the engine serves documents at
``repair="none"``: each document is encoded on its own behind the warm lead-in, its keys are re-rotated to
where it lands, and every other token (the head, separators, the question, the answer) is computed in one
causal pass over everything before it. This module builds exactly that with plain HF calls and a
``DynamicCache``, with none of the engine's machinery (no ScatterCache, no store, no placement kernel), so it
serves two purposes:

- the **training forward** of ``kvboost-rag adapt --block``: it is differentiable, so gradients flow through
  the documents' encodings and their re-rotation;
- the **independent reference** that the engine's block-served output is checked against (tests, ``verify``,
  ``kvboost-rag bench rag``): equal logits and identical greedy answers, by construction.

Which tokens are placed follows the engine's lookup rule: the tokens of a cacheable segment (a warmed
document) at positions at or past ``sink_tokens`` come from the document's isolated encoding; everything else
is computed in the main pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Run:
    """Prompt positions ``[start, end)``: computed in the main pass (``doc is None``) or taken from the isolated
    encoding of ``doc`` (the document's ids, without the lead-in) from its token ``offset`` on."""

    start: int
    end: int
    doc: tuple[int, ...] | None = None
    offset: int = 0
    link: bool = False  # link slots after a document (kvboost_core.lora.block_links): computed, from a trained table


def block_runs(segments: Iterable[Any], sink_tokens: int) -> list[Run]:
    """The runs of a tokenized prompt (``TokenizedSegment``s in order), as the engine's lookup places them."""
    runs: list[Run] = []
    pos = 0
    for seg in segments:
        ids = tuple(seg.token_ids)
        if seg.start != pos:
            raise ValueError(f"segments must be contiguous: one starts at {seg.start}, expected {pos}")
        ref = tuple(seg.source_ids) if seg.source_ids is not None else ids
        d = seg.source_offset if seg.source_ids is not None else 0
        for i, tok in enumerate(ids):
            p = seg.start + i
            placed = seg.cacheable and p >= sink_tokens and 0 <= i + d < len(ref) and ref[i + d] == tok
            _extend(runs, p, ref if placed else None, i + d)
        pos = seg.start + len(ids)
    return runs


def _extend(runs: list[Run], p: int, doc: tuple[int, ...] | None, offset: int) -> None:
    last = runs[-1] if runs else None
    if last is not None and last.end == p and last.doc == doc and (
            doc is None or last.offset + (last.end - last.start) == offset):
        runs[-1] = Run(last.start, p + 1, doc, last.offset)
    else:
        runs.append(Run(p, p + 1, doc, offset if doc is not None else 0))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_keys(model: Any, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys ``k`` (B, H, n, D) computed at positions p moved to p + ``delta``: RoPE rotations compose, so this
    is one rotation by ``delta``."""
    if delta == 0:
        return k
    cos, sin = delta_cos_sin(model, torch.tensor([delta], device=k.device))
    return rerotate_keys(k, cos, sin)


def delta_cos_sin(model: Any, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (P, R) of rotations by ``delta`` (P,) positions, from the model's own rotary module with its
    attention scaling removed."""
    rotary = model.model.rotary_emb
    dummy = torch.empty(1, dtype=torch.float32, device=delta.device)
    cos, sin = rotary(dummy, position_ids=delta.view(1, -1))  # (1, P, R)
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    return cos[0].float() / scale, sin[0].float() / scale


def rerotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k (..., P, D) rotated per token by cos/sin (P, R) (or (1, R) for all tokens), R <= D."""
    rot = cos.shape[-1]
    kf = k.float()
    out = kf[..., :rot] * cos + _rotate_half(kf[..., :rot]) * sin
    if rot < k.shape[-1]:
        out = torch.cat((out, kf[..., rot:]), dim=-1)
    return out.to(k.dtype)


def encode_documents(model: Any, docs: Sequence[tuple[int, ...]], lead: Sequence[int]
                     ) -> dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each distinct document's per-layer (K, V), each (1, H, len(lead) + n, D), from one batched forward of
    ``lead + doc`` (:func:`encode_batch`)."""
    uniq = list(dict.fromkeys(docs))
    if not uniq:
        return {}
    layers = encode_batch(model, uniq, lead)
    out: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for i, d in enumerate(uniq):
        n = len(lead) + len(d)
        out[d] = [(layer.keys[i: i + 1, :, :n], layer.values[i: i + 1, :, :n]) for layer in layers]
    return out


def encode_batch(model: Any, uniq: Sequence[tuple[int, ...]], lead: Sequence[int]) -> list[Any]:
    """The cache layers (each with (B, H, W, D) ``keys`` and ``values``) of one forward of ``lead + doc`` for the
    B documents ``uniq``, right-padded to W (causal attention never lets a token see the padding after it)."""
    from transformers import DynamicCache

    width = len(lead) + max(len(d) for d in uniq)
    device = next(model.parameters()).device
    batch = torch.zeros(len(uniq), width, dtype=torch.long, device=device)
    for i, d in enumerate(uniq):
        batch[i, : len(lead) + len(d)] = torch.tensor([*lead, *d], device=device)
    cache = DynamicCache()
    positions = torch.arange(width, device=device).expand(len(uniq), width)
    model.model(input_ids=batch, position_ids=positions, cache=cache, use_cache=True)
    return list(cache.layers)  # full-attention layers


def block_forward(model: Any, ids: Sequence[int], runs: Sequence[Run], lead: Sequence[int], *,
                  logits_from: int | None = None, encoded: dict | None = None,
                  links: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """Logits (n_out, V) of positions ``logits_from``.. of ``ids`` (default: the last position) under block
    attention, and the HF cache after it. ``runs`` cover ``ids`` (the prompt; positions past the last run, such
    as teacher-forced answer tokens, are computed in the main pass). Differentiable. ``encoded``: a dict of
    document encodings (:func:`encode_documents`) to reuse across calls; missing documents are added to it.
    ``links``: (L, d) input embeddings of the link slots (runs with ``link=True``), where the prompt has them."""
    pieces, cache = _block_pass(model, ids, runs, lead, logits_from, encoded, hidden=False, links=links)
    return torch.cat(pieces).float(), cache


def block_hidden(model: Any, ids: Sequence[int], runs: Sequence[Run], lead: Sequence[int], *,
                 rows_from: int | None = None, encoded: dict | None = None,
                 links: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """As :func:`block_forward`, but the final (normed) hidden states (n_out, d) of those positions: the logits
    are ``model.lm_head`` of them. Distillation matches these against the teacher's (``kvboost-rag adapt``)."""
    pieces, cache = _block_pass(model, ids, runs, lead, rows_from, encoded, hidden=True, links=links)
    return torch.cat(pieces), cache


def _block_pass(model: Any, ids: Sequence[int], runs: Sequence[Run], lead: Sequence[int], start_at: int | None,
                encoded: dict | None, hidden: bool, links: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], Any]:
    from transformers import DynamicCache

    n = len(ids)
    covered = runs[-1].end if runs else 0
    if covered > n:
        raise ValueError(f"runs cover {covered} positions but ids has {n}")
    runs = [*runs, Run(covered, n)] if covered < n else list(runs)
    start = n - 1 if start_at is None else start_at
    wanted = [r.doc for r in runs if r.doc is not None]
    if encoded is None:
        encoded = encode_documents(model, wanted, lead)
    else:
        encoded.update(encode_documents(model, [d for d in wanted if d not in encoded], lead))
    device = next(model.parameters()).device
    cache = DynamicCache()
    pieces: list[torch.Tensor] = []
    for r in runs:
        if r.doc is not None:
            a = len(lead) + r.offset  # where these tokens sat in the isolated forward
            for layer, (k, v) in enumerate(encoded[r.doc]):
                length = r.end - r.start
                cache.update(shift_keys(model, k[:, :, a: a + length], r.start - a), v[:, :, a: a + length], layer)
            continue
        x = torch.tensor([list(ids[r.start: r.end])], device=device)
        pos = torch.arange(r.start, r.end, device=device).view(1, -1)
        keep = max(0, r.end - max(start, r.start))
        inp: dict[str, Any] = {"input_ids": x}
        if r.link:
            if links is None or links.shape[0] < r.end - r.start:
                raise ValueError(f"the prompt has {r.end - r.start} link slots at {r.start}; pass links of as many rows")
            inp = {"inputs_embeds": links[: r.end - r.start].unsqueeze(0).to(model.dtype)}
        if hidden:
            out = model.model(**inp, position_ids=pos, cache=cache, use_cache=True)
            if keep:
                pieces.append(out.last_hidden_state[0, -keep:])
        else:
            out = model(**inp, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=max(keep, 1))
            if keep:
                pieces.append(out.logits[0, -keep:])
    if not pieces:
        raise ValueError(f"logits_from={start} falls on placed document tokens only")
    return pieces, cache


@torch.inference_mode()
def block_greedy(model: Any, ids: Sequence[int], runs: Sequence[Run], lead: Sequence[int], max_new_tokens: int,
                 eos: set[int], encoded: dict | None = None, links: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[int]]:
    """First-token logits and the greedy continuation of ``ids`` under block attention, decoded on HF's cache."""
    from kvboost_core.model.driver import output_cache

    logits, cache = block_forward(model, ids, runs, lead, encoded=encoded, links=links)
    first = logits[-1]
    tokens = [int(first.argmax())]
    pos = len(ids)
    device = first.device
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                    position_ids=torch.tensor([[pos]], device=device), cache=cache, use_cache=True)
        cache = output_cache(out)
        tokens.append(int(out.logits[0, -1].argmax()))
        pos += 1
    return first, tokens

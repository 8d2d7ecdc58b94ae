"""Block prefill in one masked forward: the training fast path of :mod:`kvboost_core.lora.block_prefill`.

The reference construction (:func:`~kvboost_core.lora.block_prefill.block_hidden`) runs one HF forward per
computed run (the head, each separator, the question and answer) and re-rotates each document's keys layer by
layer. With k documents that is 2k+ forwards and 30k small rotations a training step: on a GPU the step is bound
by kernel launches and Python (2.3 s a step on an H200, the same as one CPU core), and on a CPU the per-call
overhead is a tenth of the step.

The same attention in one pass:

1. every distinct document is encoded in one batched forward behind the lead-in (as the reference does);
2. the placed tokens' keys and values for all layers are gathered from that batch with one index, and their keys
   re-rotated by their per-token position delta with one rotation: ``(L, 1, H, P, D)``;
3. all computed tokens (C of them) run in **one** forward over a cache that holds the P placed tokens, with an
   explicit (1, 1, C, P + C) mask: a computed token at position p sees every placed or computed token at a
   position <= p. That is the set of keys the reference's causal run-by-run pass gives it.

The result equals the reference up to float summation order (checked in ``tests/test_block_fused.py``). The
reference stays the independent construction the engine is checked against; this module is what training calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvboost_core.lora.block_prefill import Run, delta_cos_sin, encode_batch, rerotate_keys
from kvboost_core.model.attention import additive, visible


@dataclass(frozen=True, slots=True)
class StackedDocs:
    """Distinct documents encoded behind the lead-in: keys and values (L, B, H, W, D) of the right-padded batch
    ``lead + doc``, and each document's batch row."""

    keys: torch.Tensor
    values: torch.Tensor
    row: dict[tuple[int, ...], int]
    lead: int  # len(lead): a document token's isolated position is lead + its index


def encode_stacked(model: Any, docs: Sequence[tuple[int, ...]], lead: Sequence[int]) -> StackedDocs:
    """One batched forward of ``lead + doc`` for every distinct document (block_prefill.encode_batch), stacked."""
    uniq = list(dict.fromkeys(docs))
    if not uniq:
        raise ValueError("encode_stacked needs at least one document")
    layers = encode_batch(model, uniq, lead)
    keys = torch.stack([layer.keys for layer in layers])  # (L, B, H, W, D)
    values = torch.stack([layer.values for layer in layers])
    return StackedDocs(keys, values, {d: i for i, d in enumerate(uniq)}, len(lead))


def fused_block_hidden(model: Any, ids: Sequence[int], runs: Sequence[Run], lead: Sequence[int], *,
                       rows_from: int, docs: StackedDocs | None = None,
                       links: torch.Tensor | None = None) -> torch.Tensor:
    """The final (normed) hidden states (n_out, d) of the computed positions >= ``rows_from``, as
    :func:`~kvboost_core.lora.block_prefill.block_hidden` gives them, from one main forward. Differentiable.
    ``docs``: the documents' encodings to reuse (:func:`encode_stacked`; encoded here when None). ``links``:
    (n, d) input embeddings of the link slots (runs with ``link=True``), where the prompt has them."""
    from transformers import DynamicCache

    n = len(ids)
    covered = runs[-1].end if runs else 0
    if covered > n:
        raise ValueError(f"runs cover {covered} positions but ids has {n}")
    runs = [*runs, Run(covered, n)] if covered < n else list(runs)
    placed = [r for r in runs if r.doc is not None]
    device = next(model.parameters()).device
    cache = DynamicCache()
    ppos = torch.zeros(0, dtype=torch.long, device=device)
    if placed:  # (with none, this is the model's plain causal forward)
        if docs is None:
            docs = encode_stacked(model, [r.doc for r in placed], lead)  # type: ignore[misc]
        missing = [r.doc for r in placed if r.doc not in docs.row]
        if missing:
            raise ValueError(f"docs lacks {len(missing)} of this prompt's documents; encode them with encode_stacked")
        # placed tokens: batch row, isolated index, prompt position  (P,)
        brow = torch.tensor([docs.row[r.doc] for r in placed for _ in range(r.end - r.start)],  # type: ignore[index]
                            device=device)
        src = torch.tensor([docs.lead + r.offset + i for r in placed for i in range(r.end - r.start)], device=device)
        ppos = torch.tensor([p for r in placed for p in range(r.start, r.end)], device=device)
        cos, sin = delta_cos_sin(model, ppos - src)
        # two advanced indices around a slice: the index dim goes first, (P, L, H, D) -> (L, H, P, D)
        keys = rerotate_keys(docs.keys[:, brow, :, src].permute(1, 2, 0, 3), cos, sin)
        values = docs.values[:, brow, :, src].permute(1, 2, 0, 3)
        for layer in range(keys.shape[0]):
            cache.update(keys[layer].unsqueeze(0), values[layer].unsqueeze(0), layer)

    computed = [(r, i) for r in runs if r.doc is None for i in range(r.end - r.start)]  # (run, index in it), C
    cpos = torch.tensor([r.start + i for r, i in computed], device=device)  # (C,)
    cids = torch.tensor([[ids[r.start + i] for r, i in computed]], device=device)
    embeds = model.get_input_embeddings()(cids)  # (1, C, d)
    link_at = [c for c, (r, _) in enumerate(computed) if r.link]
    if link_at:
        link_row = [i for r, i in computed if r.link]
        if links is None or links.shape[0] <= max(link_row):
            raise ValueError(f"the prompt has runs of up to {max(link_row) + 1} link slots; pass links of as many rows")
        embeds = embeds.index_put((torch.zeros(len(link_at), dtype=torch.long, device=device),
                                   torch.tensor(link_at, device=device)),
                                  links[torch.tensor(link_row, device=device)].to(embeds.dtype))
    key_pos = torch.cat((ppos, cpos))  # (P + C,)
    dtype = embeds.dtype
    # (1, 1, C, P + C): the package's one causal rule, as the model's own eager masks write it
    mask = additive(visible(cpos, key_pos, None), "eager", dtype)[None, None]
    out = model.model(inputs_embeds=embeds, position_ids=cpos.view(1, -1), attention_mask=mask, cache=cache,
                      use_cache=True)
    keep = cpos >= rows_from
    if not bool(keep.any()):
        raise ValueError(f"rows_from={rows_from} falls on placed document tokens only")
    return out.last_hidden_state[0, keep]

"""Batch-invariant decode kernels: a row's result depends on the row alone, not on the rows computed with it.

Torch picks its CPU kernels, and so the summation order of a row's reductions, by the shape of the whole call:

- BLAS chooses its GEMM kernel by the number of rows (on CPU fp32 a row's output differs in the last bits
  between 1, 2..8 and 16 rows). :func:`row_tiled` runs ``nn.Linear`` layers on tiles of exactly ``ROW_TILE``
  rows, the last one zero-padded: the same call for a row whatever the number of rows beside it.
- The fused CPU attention kernel (``scaled_dot_product_attention``, flash) splits its work differently when
  batch x heads is small for the thread count, and the split changes a row's sums. Measured on torch 2.13
  (3 KV heads of 3 queries, as SmolLM2's GQA decode packs them): at 2 threads a row alone differs from the
  1-thread result while the same row in a batch of 2 or more equals it; at 8 threads batches of up to 5
  differ; at 1 thread none does. So a row alone differed from the same row in a batch by ~1e-8 after one
  layer, ~2e-5 in the logits. A fixed padded batch would only move the threshold (it depends on the thread
  count); :func:`rowwise_attention` instead calls the model's attention once per row, on the row's own keys
  (``[0, length)``) and mask: a call whose shape and data belong to the row alone, so whichever split the
  kernel picks for it, it picks the same one beside any neighbours. Slicing to the row's length also drops
  the padding a batched call attends (masked) up to the longest row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_core.model import attention

ROW_TILE = 8  # linears run on tiles of exactly this many rows


def _tiled_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed ``ROW_TILE`` rows at a time (the last tile zero-padded): the same BLAS call, so
    the same summation order, for a row whatever the number of rows beside it."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    pad = -n % ROW_TILE
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad, flat.shape[1])))
    out = torch.cat([F.linear(flat[i:i + ROW_TILE], module.weight, module.bias)
                     for i in range(0, n + pad, ROW_TILE)])
    return out[:n].view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def row_tiled(modules: list[torch.nn.Linear]) -> Iterator[None]:
    """Within the block, ``modules`` compute on row tiles (an instance attribute shadows ``forward``; removed
    on exit, so nothing outside the block changes)."""
    for m in modules:
        m.__dict__["forward"] = _tiled_linear.__get__(m)
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)


@contextlib.contextmanager
def rowwise_attention(config: Any, lengths: Sequence[int]) -> Iterator[None]:
    """Within the block, the attention of the model with ``config`` runs row by row, row ``i`` on its first
    ``lengths[i]`` keys (its mask sliced to match). The wrapper lives in :mod:`kvboost_core.model.attention` (shared
    with the planned forward's block attention)."""
    with attention.switched(config), attention.rows(lengths):
        yield

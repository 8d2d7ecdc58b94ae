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
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

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


_ROWS = threading.local()  # .lengths: the attended length of each row, set by rowwise_attention's block
_PREFIX = "kvboost_rows|"  # registered name: this prefix + the model's own implementation ("sdpa", "eager")


def _row_lengths() -> Sequence[int] | None:
    return getattr(_ROWS, "lengths", None)


def _slice_rows(t: torch.Tensor | None, i: int, length: int) -> torch.Tensor | None:
    """Row ``i`` of a (rows, ..., T) mask limited to its first ``length`` keys (None stays None)."""
    return None if t is None else t[i:i + 1, ..., :length]


def _base_attention(impl: str, module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The function ``module`` runs for ``impl``: "eager" is each model family's own function (not in the
    registry: softcapping, scaling differ), anything else the registered one."""
    if impl == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _rowwise(impl: str) -> Callable[..., tuple[torch.Tensor, None]]:
    """Attention ``impl`` run once per row on the row's own keys; run as is on a thread outside a
    :func:`rowwise_attention` block (another user of the same model)."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        base = _base_attention(impl, module)
        lengths = _row_lengths()
        if lengths is None:
            return base(module, query, key, value, attention_mask, **kwargs)[0], None
        if len(lengths) != query.shape[0]:
            raise RuntimeError(f"row-wise attention was given {len(lengths)} lengths for {query.shape[0]} rows")
        outs = [base(module, query[i:i + 1], key[i:i + 1, :, :n], value[i:i + 1, :, :n],
                     _slice_rows(attention_mask, i, n), **kwargs)[0] for i, n in enumerate(lengths)]
        return torch.cat(outs), None

    return attention


def _registered(impl: str) -> str:
    """The name of attention ``impl``'s row-wise wrapper, registered on first use."""
    name = _PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS:
        if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"no attention implementation {impl!r} to run row by row")
        AttentionInterface.register(name, _rowwise(impl))
    return name


@contextlib.contextmanager
def rowwise_attention(config: Any, lengths: Sequence[int]) -> Iterator[None]:
    """Within the block, the attention of the model with ``config`` runs row by row, row ``i`` on its first
    ``lengths[i]`` keys (its mask sliced to match)."""
    impl = config._attn_implementation
    if not isinstance(impl, str) or impl.startswith(_PREFIX):
        raise ValueError(f"config has attn_implementation={impl!r}; row-wise attention wraps a model's own one")
    config._attn_implementation = _registered(impl)
    _ROWS.lengths = list(lengths)
    try:
        yield
    finally:
        _ROWS.lengths = None
        config._attn_implementation = impl

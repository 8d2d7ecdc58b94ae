"""Pure-torch reference implementations of the native ops: the specification and the fallback.

Each function here is what the C++/CUDA kernels reproduce (CPU: bit for bit; see tests/test_kernels.py), and
what :mod:`kvboost_core.kernels.ops` runs when the extension is not built or the device is not supported.

* :func:`dequant_rerotate_into` is exactly the inner loop of ``kvboost_core.assembly.place``: the payload is
  made dense in the destination dtype (``to_dense``: fp32 dequantization, then a cast), keys are re-rotated in
  fp32 (``rope.rerotate``) and cast back, and both are copied into the per-layer buffers.
* :func:`quantize_kv` is ``kvboost_core.quant.quantize_k`` + ``quantize_v``.
* :func:`blend_select` ranks tokens by their squared K deviation (CacheBlend's check layer).
* :func:`decode_attention` is one decode row's attention, torch's SDPA with GQA. The CPU kernel is not bitwise
  SDPA (its own fixed summation order and exp); tests/test_kernels.py bounds the difference.
* :func:`paged_decode_attention` is the same over a page pool's rows: gathered, then :func:`decode_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvboost_core.quant import dequantize_k, dequantize_v, quantize_k, quantize_v
from kvboost_core.rope import rerotate


def _dense_slice(k: torch.Tensor, v: torch.Tensor, k_scale, k_min, v_scale, v_min, bits: int, group_size: int,
                 head_dim: int, src_start: int, length: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [src_start, src_start + length) of the payload as dense (L, H, length, D) in ``dtype``."""
    end = src_start + length
    if bits == 16:
        return k[:, :, src_start:end].to(dtype), v[:, :, src_start:end].to(dtype)
    # K groups run along tokens: dequantize only the whole groups covering the slice, then trim. Every value
    # is computed from its own code and its group's (scale, min), so this equals slicing a full dequant.
    g = group_size
    g0, g1 = src_start // g, -(-end // g)
    t0, t1 = g0 * g, min(g1 * g, k.shape[2])
    kd = dequantize_k(k[:, :, t0:t1], k_scale[:, :, g0:g1], k_min[:, :, g0:g1], bits, g, head_dim, dtype)
    vd = dequantize_v(v[:, :, src_start:end], v_scale[:, :, src_start:end], v_min[:, :, src_start:end], bits, g,
                      head_dim, dtype)
    return kd[:, :, src_start - t0:src_start - t0 + length], vd


def dequant_rerotate_into(dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor], k: torch.Tensor,
                          v: torch.Tensor, k_scale: torch.Tensor | None, k_min: torch.Tensor | None,
                          v_scale: torch.Tensor | None, v_min: torch.Tensor | None, bits: int, group_size: int,
                          head_dim: int, src_start: int, length: int, dst_start: int,
                          cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """Write payload tokens [src_start, src_start + length) into ``dst_k[l][0, :, dst_start:dst_start + length]``
    (and V likewise) for every layer ``l``, keys rotated by per-token ``cos``/``sin`` (length, R) fp32.

    ``bits == 16``: ``k``/``v`` are dense (L, H, n, D); ``bits`` 8/4: they are the uint8 codes of a
    ``QuantPayload`` and the four scale/min tensors follow its layout. ``cos``/``sin`` None: no rotation.
    """
    if bits not in (16, 8, 4):
        raise ValueError(f"bits must be 16 (dense), 8 or 4, got {bits!r}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    n = k.shape[2]
    if src_start < 0 or length < 0 or src_start + length > n:
        raise ValueError(f"source tokens [{src_start}, {src_start + length}) out of range for a payload of {n} tokens")
    if len(dst_k) != k.shape[0] or len(dst_v) != k.shape[0]:
        raise ValueError(f"{k.shape[0]} payload layers but {len(dst_k)} key and {len(dst_v)} value buffers")
    if length == 0 or not len(dst_k):
        return
    dtype = dst_k[0].dtype
    kd, vd = _dense_slice(k, v, k_scale, k_min, v_scale, v_min, bits, group_size, head_dim, src_start, length,
                          dtype)
    if cos is not None and sin is not None and cos.shape[-1] > 0:
        kd = rerotate(kd, cos, sin)
    for layer in range(len(dst_k)):
        dst_k[layer][0, :, dst_start:dst_start + length] = kd[layer]
        dst_v[layer][0, :, dst_start:dst_start + length] = vd[layer]


def quantize_kv(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """(k_codes, k_scale, k_min, v_codes, v_scale, v_min), the tensors of ``quant.quantize_payload``."""
    return (*quantize_k(k, bits, group_size), *quantize_v(v, bits, group_size))


def deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 deviation (H, n, D) -> (n,) float64: fp32 differences and squares (as
    repair._sq_dev), summed in float64 so summation order cannot reorder tokens except on exact ties."""
    d = fresh.float() - cached.float()
    return (d * d).double().sum(dim=(0, 2))


def blend_select(fresh: torch.Tensor, cached: torch.Tensor, k: int,
                 forced_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions (int64, ascending) of the tokens CacheBlend keeps recomputing.

    Ranking: tokens in ``forced_mask`` first, then larger deviation (NaN above every number, as torch.topk),
    ties broken by the lower index. The first ``min(n, max(k, n_forced))`` are returned: forced tokens
    count toward ``k`` but are never dropped.
    """
    if fresh.dim() != 3 or fresh.shape != cached.shape:
        raise ValueError(f"blend_select takes fresh/cached (H, n, D) of one shape, got {tuple(fresh.shape)} "
                         f"and {tuple(cached.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = fresh.shape[1]
    dev = deviation(fresh, cached)
    forced = (torch.zeros(n, dtype=torch.bool, device=fresh.device) if forced_mask is None
              else forced_mask.to(torch.bool))
    take = min(n, max(k, int(forced.sum())))
    # Sort keys, lowest first: (not forced, not NaN, -dev, index). A stable sort on each key from the least
    # significant one gives that lexicographic order.
    order = torch.arange(n, device=fresh.device)
    key = torch.where(torch.isnan(dev), torch.zeros_like(dev), -dev)
    order = order[torch.sort(key[order], stable=True).indices]
    order = order[torch.sort((~torch.isnan(dev[order])).to(torch.int8), stable=True).indices]
    order = order[torch.sort((~forced[order]).to(torch.int8), stable=True).indices]
    return torch.sort(order[:take]).values


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float
                     ) -> torch.Tensor:
    """q (H, D), k/v (H_kv, T, D) -> (H, D): softmax(scale * q . K[:length]) @ V[:length] per query head, query
    head h reading KV head h // (H / H_kv)."""
    h, d = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(1, h, 1, d), k[None, :, :length], v[None, :, :length], scale=scale, enable_gqa=h != k.shape[0])
    return out.view(h, d)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor,
                           length: int, scale: float) -> torch.Tensor:
    """:func:`decode_attention` over the rows of a page pool (N, H_kv, P, D) that ``pages`` (n,) lists in
    position order: the pages gathered into a dense (H_kv, n * P, D), then SDPA."""
    p_tok = k_pool.shape[2]
    if not 1 <= length <= pages.numel() * p_tok:
        raise ValueError(f"length must be in [1, {pages.numel() * p_tok}] ({pages.numel()} pages of {p_tok}), "
                         f"got {length}")
    return decode_attention(q, gather_pages(k_pool, pages, length), gather_pages(v_pool, pages, length), length,
                            scale)


def gather_pages(pool: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows that ``pages`` (n,) lists of a pool layer (N, H_kv, P, D), as a dense
    (H_kv, length, D) copy: what paged attention reads in place."""
    used = pages[: -(-length // pool.shape[2])].long()
    return pool.index_select(0, used).transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, :length]


def select_count(ratio_or_k: float | int, n: int) -> int:
    """A float is a ratio of the ``n`` candidates (rounded up, as repair.build_schedule does); an int is a count."""
    if isinstance(ratio_or_k, bool):
        raise TypeError("ratio_or_k must be a float ratio or an int count, not a bool")
    if isinstance(ratio_or_k, float):
        if not 0.0 <= ratio_or_k <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio_or_k}")
        return math.ceil(ratio_or_k * n)
    return int(ratio_or_k)

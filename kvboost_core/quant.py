"""KIVI-style asymmetric KV quantization (int8 / int4) — the reference layout.

A later issue writes C++/CUDA kernels that must reproduce these functions bit for bit, so the layout is
spelled out here once and every function below follows it.

Notation: dense K and V are ``(L, H, n, D)`` (layers, KV heads, tokens, head_dim); ``G`` = ``group_size``;
``q = 2**bits - 1``; ``ng_n = ceil(n / G)``; ``ng_d = ceil(D / G)``.

Grouping (KIVI: keys have per-channel outliers, values do not):
  * K is quantized **per channel**: every (layer, head, channel) gets one (scale, min) per group of ``G``
    consecutive tokens. ``k_scale``/``k_min``: float16 ``(L, H, ng_n, D)``.
  * V is quantized **per token**: every (layer, head, token) gets one (scale, min) per group of ``G``
    consecutive channels. ``v_scale``/``v_min``: float16 ``(L, H, n, ng_d)``.

Per group, with ``x`` the group's values converted to float32:
  1. ``mn16 = fp16(min(x))`` rounded toward -inf (if the fp16 rounding landed above ``min(x)``, take the
     next fp16 below) so that no value lies under the stored zero-point.
  2. ``s32 = (max(x) - float32(mn16)) / q`` in float32; ``s16 = fp16(s32)`` rounded toward +inf the same way
     so that the largest value stays inside the code range. A constant group whose min is exact in fp16
     gets ``s16 = 0``.
  3. ``code = clamp(torch.round((x - float32(mn16)) / float32(s16)), 0, q)`` — float32 true division,
     round-half-to-even (``torch.round``); where ``s16 == 0`` the code is 0.
  4. Dequantization: ``x_hat = float32(code) * float32(s16) + float32(mn16)`` in float32 (a multiply then an
     add, not an fma), then cast to the requested dtype.
  So ``|x - x_hat| <= s16 / 2`` up to float32 rounding.

Ragged sizes: when ``n % G != 0`` (K) or ``D % G != 0`` (V) the last group is padded by repeating its last
real element (this leaves min/max unchanged); only the real elements' codes are stored, the true sizes are
kept in the payload (``num_tokens``, ``head_dim``).

Codes: ``k_codes`` and ``v_codes`` are uint8 ``(L, H, n, D)`` for int8. For int4 two codes share one byte
along the last (channel) axis: byte ``j`` holds channel ``2j`` in its low nibble and channel ``2j+1`` in its
high nibble; an odd ``D`` is padded with a zero code; the shape is ``(L, H, n, ceil(D / 2))``.

Byte cost (fp16 scale + fp16 min per group of ``G`` elements): ``bits/8 + 4/G`` bytes per element, so at
``G = 32`` int8 is 1.125 B/elem (0.5625x of bf16) and int4 0.625 B/elem (0.3125x); ``G = 128`` gives
0.516x and 0.266x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvboost_core.payload import DensePayload

_FP16_MAX = 65504.0
BITS = (4, 8)


# -- low-level, layout-defining functions ------------------------------------------------------------------
def _round_fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """fp32 -> fp16 rounded toward ``direction`` (+inf or -inf), i.e. a directed rounding of the cast."""
    h = x.to(torch.float16)
    wrong = (h.float() > x) if direction < 0 else (h.float() < x)
    if bool(wrong.any()):
        nudged = torch.nextafter(h, torch.full_like(h, direction))
        h = torch.where(wrong, nudged, h)
    return h


def _check_bits(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _quantize_groups_last(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """Quantize ``x`` (..., m) in groups of ``group_size`` along the last axis.

    Returns unpacked uint8 codes (..., m), fp16 scale (..., ng) and fp16 min (..., ng)."""
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize non-finite K/V values")
    if x.numel() and float(x.abs().max()) > _FP16_MAX:
        raise ValueError(f"K/V values exceed the fp16 range ({_FP16_MAX}) of the stored scales")
    m = x.shape[-1]
    ng = math.ceil(m / group_size)
    pad = ng * group_size - m
    if pad:  # repeat the last real element: min/max of the ragged group are unchanged
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    g = x.reshape(*x.shape[:-1], ng, group_size)  # (..., ng, G)
    qmax = float(2**bits - 1)
    mn16 = _round_fp16(g.amin(dim=-1), -math.inf)  # (..., ng)
    s16 = _round_fp16((g.amax(dim=-1) - mn16.float()) / qmax, math.inf)  # (..., ng)
    s = s16.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((g - mn16.float().unsqueeze(-1)) / safe).clamp_(0, qmax)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    codes = codes.reshape(*x.shape[:-1], ng * group_size)[..., :m].to(torch.uint8)  # (..., m)
    return codes, s16, mn16


def _dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                       axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of the quantizers: unpacked codes, groups of ``group_size`` along ``axis`` (-1 or -2), and the
    per-group scale/min (that axis has ``ceil(m / G)`` entries) -> values in ``dtype``, codes' shape."""
    m = codes.shape[axis]
    ng = scale.shape[axis]
    pad = ng * group_size - m
    c = codes.float()
    if pad:  # padded codes are dropped below; their value does not matter
        c = torch.nn.functional.pad(c, (0, pad) if axis == -1 else (0, 0, 0, pad))
    if axis == -1:  # (..., m) -> (..., ng, G) against (..., ng, 1)
        g = c.view(*c.shape[:-1], ng, group_size)
        out = g * scale.float().unsqueeze(-1) + mn.float().unsqueeze(-1)
        return out.reshape(*c.shape)[..., :m].to(dtype)
    # axis -2: (..., m, D) -> (..., ng, G, D) against (..., ng, 1, D)
    g = c.view(*c.shape[:-2], ng, group_size, c.shape[-1])
    out = g * scale.float().unsqueeze(-2) + mn.float().unsqueeze(-2)
    return out.reshape(*c.shape)[..., :m, :].to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] (..., m) -> uint8 (..., ceil(m/2)); even index = low nibble."""
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, torch.zeros_like(codes[..., :1])], dim=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (..., ceil(m/2)) -> (..., m) uint8 codes."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :m]


def quantize_k(k: torch.Tensor, bits: int, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel K quantization. ``k`` (L, H, n, D) -> ``(k_codes, k_scale, k_min)``:
    codes uint8 (L, H, n, D) [int4: (L, H, n, ceil(D/2)) packed], scale/min fp16 (L, H, ceil(n/G), D)."""
    _check_bits(bits, group_size)
    codes, s, z = _quantize_groups_last(k.transpose(-1, -2), bits, group_size)  # groups along tokens
    codes = codes.transpose(-1, -2).contiguous()  # (L, H, n, D)
    if bits == 4:
        codes = pack_int4(codes).contiguous()
    return codes, s.transpose(-1, -2).contiguous(), z.transpose(-1, -2).contiguous()


def dequantize_k(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, group_size: int,
                 head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_k` -> (L, H, n, D) in ``dtype``."""
    _check_bits(bits, group_size)
    if bits == 4:
        codes = unpack_int4(codes, head_dim)
    return _dequantize_groups(codes, scale, mn, group_size, -2, dtype).contiguous()


def quantize_v(v: torch.Tensor, bits: int, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token V quantization. ``v`` (L, H, n, D) -> ``(v_codes, v_scale, v_min)``:
    codes uint8 (L, H, n, D) [int4: (L, H, n, ceil(D/2)) packed], scale/min fp16 (L, H, n, ceil(D/G))."""
    _check_bits(bits, group_size)
    codes, s, z = _quantize_groups_last(v, bits, group_size)  # groups along channels
    if bits == 4:
        codes = pack_int4(codes)
    return codes.contiguous(), s.contiguous(), z.contiguous()


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, group_size: int,
                 head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_v` -> (L, H, n, D) in ``dtype``."""
    _check_bits(bits, group_size)
    if bits == 4:
        codes = unpack_int4(codes, head_dim)
    return _dequantize_groups(codes, scale, mn, group_size, -1, dtype).contiguous()


# -- payload ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class QuantPayload:
    """Quantized K/V of one chunk (implements ``KVPayload``). Tensor layouts: see the module docstring."""

    bits: int
    group_size: int
    head_dim: int
    k_codes: torch.Tensor  # uint8 (L, H, n, D) or (L, H, n, ceil(D/2)) for int4
    k_scale: torch.Tensor  # fp16 (L, H, ceil(n/G), D)
    k_min: torch.Tensor  # fp16 (L, H, ceil(n/G), D)
    v_codes: torch.Tensor  # uint8, same shape as k_codes
    v_scale: torch.Tensor  # fp16 (L, H, n, ceil(D/G))
    v_min: torch.Tensor  # fp16 (L, H, n, ceil(D/G))
    # True: keys were un-rotated to position 0 before quantization (pre-RoPE, see ``unrotate_keys``); whoever
    # places them rotates by the absolute target position instead of a delta.
    keys_pre_rope: bool = False

    def __post_init__(self) -> None:
        _check_bits(self.bits, self.group_size)
        if self.k_codes.dtype != torch.uint8 or self.v_codes.dtype != torch.uint8:
            raise ValueError("codes must be uint8")
        if self.k_codes.shape != self.v_codes.shape or self.k_codes.dim() != 4:
            raise ValueError(f"k/v codes must share one (L, H, n, Dc) shape, got {tuple(self.k_codes.shape)} "
                             f"and {tuple(self.v_codes.shape)}")
        L, H, n, dc = self.k_codes.shape
        want_dc = self.head_dim if self.bits == 8 else math.ceil(self.head_dim / 2)
        if dc != want_dc:
            raise ValueError(f"codes last dim {dc} does not match head_dim {self.head_dim} at {self.bits} bits")
        ks = (L, H, math.ceil(n / self.group_size), self.head_dim)
        vs = (L, H, n, math.ceil(self.head_dim / self.group_size))
        for name, t, shape in (("k_scale", self.k_scale, ks), ("k_min", self.k_min, ks),
                               ("v_scale", self.v_scale, vs), ("v_min", self.v_min, vs)):
            if tuple(t.shape) != shape or t.dtype != torch.float16:
                raise ValueError(f"{name} must be float16 {shape}, got {t.dtype} {tuple(t.shape)}")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k_codes": self.k_codes, "k_scale": self.k_scale, "k_min": self.k_min,
                "v_codes": self.v_codes, "v_scale": self.v_scale, "v_min": self.v_min}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def num_tokens(self) -> int:
        return int(self.k_codes.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.k_codes.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.k_codes.shape[1])

    def to_dense(self, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (K, V); K is pre-RoPE (position 0) when ``keys_pre_rope``."""
        # Move the small codes, not the dense result: the transfer is 2-4x smaller.
        t = {name: x.to(device) for name, x in self.tensors().items()}
        k = dequantize_k(t["k_codes"], t["k_scale"], t["k_min"], self.bits, self.group_size, self.head_dim, dtype)
        v = dequantize_v(t["v_codes"], t["v_scale"], t["v_min"], self.bits, self.group_size, self.head_dim, dtype)
        return k, v


def quantize_payload(dense: DensePayload, bits: int, group_size: int = 32, keys_pre_rope: bool = False
                     ) -> QuantPayload:
    """Quantize a dense payload (any float dtype; computed in float32 on its device)."""
    kc, ks, km = quantize_k(dense.keys, bits, group_size)
    vc, vs, vm = quantize_v(dense.values, bits, group_size)
    return QuantPayload(bits=bits, group_size=group_size, head_dim=int(dense.keys.shape[3]),
                        k_codes=kc, k_scale=ks, k_min=km, v_codes=vc, v_scale=vs, v_min=vm,
                        keys_pre_rope=keys_pre_rope)


def unrotate_keys(k: torch.Tensor, start: int, rotary_emb) -> torch.Tensor:
    """Keys ``k`` (L, H, n, D) computed at positions ``start..start+n-1`` -> the same keys at position 0.

    Why (KVQuant): RoPE spins each channel pair with the token's position, so after RoPE a channel's values
    swing between +a and -a along the tokens of a per-channel group and the group's range is inflated; before
    RoPE a channel keeps its (outlier) scale and a narrow range. On stories260K int4 this lowers the
    exact-prefix KL about 1.7x (0.047 -> 0.027; K error dominates V error there by 4x)."""
    from kvboost_core.rope import delta_cos_sin, rerotate

    pos = -torch.arange(start, start + k.shape[2], device=k.device)
    cos, sin = delta_cos_sin(rotary_emb, pos)  # (n, R)
    return rerotate(k, cos, sin)


def bytes_per_token(payload: DensePayload | QuantPayload) -> float:
    """Stored payload bytes per token (all layers and heads, K and V, scales included)."""
    n = payload.num_tokens
    if n == 0:
        raise ValueError("bytes_per_token of an empty payload")
    return payload.nbytes / n

"""KIVI-style int8/int4 quantization: layout, error bounds, ragged shapes, byte cost."""

from __future__ import annotations

import math

import pytest
import torch

from kvboost_core.kv_encode import maybe_quantize
from kvboost_core.quant import (
    QuantPayload,
    bytes_per_token,
    dequantize_k,
    dequantize_v,
    pack_int4,
    quantize_k,
    quantize_payload,
    quantize_v,
    unpack_int4,
)
from kvboost_core.store.base import DensePayload

EPS = 1e-4  # float32 rounding of (x - min) / scale and of code * scale + min, for |x| up to ~100


def _asymmetric(shape: tuple[int, ...], seed: int = 0, outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 6.0 - 1.0  # skewed: mostly positive
    x = x + torch.randn(shape, generator=g) * 0.5
    if outliers:  # KIVI's observation: a few K channels carry large magnitudes
        x[..., 3] *= 25.0
        x.view(-1)[:: 997] = 90.0
    return x


def _expand_k(t: torch.Tensor, n: int, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=2)[:, :, :n].float()  # (L, H, ng, D) -> (L, H, n, D)


def _expand_v(t: torch.Tensor, d: int, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=3)[..., :d].float()  # (L, H, n, ng) -> (L, H, n, D)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(2, 2, 64, 64), (3, 2, 37, 40), (1, 3, 5, 7), (2, 1, 33, 96)])
@pytest.mark.parametrize("outliers", [False, True])
def test_error_within_half_a_step(bits: int, shape: tuple[int, ...], outliers: bool) -> None:
    g = 32
    _, _, n, d = shape
    k = _asymmetric(shape, 1, outliers)
    v = _asymmetric(shape, 2, outliers)
    kc, ks, km = quantize_k(k, bits, g)
    vc, vs, vm = quantize_v(v, bits, g)
    k_hat = dequantize_k(kc, ks, km, bits, g, d)
    v_hat = dequantize_v(vc, vs, vm, bits, g, d)
    # the bound per element is half of *its own group's stored* scale
    assert ((k - k_hat).abs() <= _expand_k(ks, n, g) / 2 + EPS).all()
    assert ((v - v_hat).abs() <= _expand_v(vs, d, g) / 2 + EPS).all()
    # and the stored (scale, min) cover the group: the min never lies above the data
    assert (_expand_k(km, n, g) <= k).all() and (_expand_v(vm, d, g) <= v).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_layout_shapes_and_dtypes(bits: int) -> None:
    L, H, n, d, g = 2, 3, 45, 70, 32
    p = quantize_payload(DensePayload(_asymmetric((L, H, n, d)), _asymmetric((L, H, n, d), 3)), bits, g)
    dc = d if bits == 8 else math.ceil(d / 2)
    assert p.k_codes.shape == p.v_codes.shape == (L, H, n, dc) and p.k_codes.dtype == torch.uint8
    assert p.k_scale.shape == p.k_min.shape == (L, H, math.ceil(n / g), d)
    assert p.v_scale.shape == p.v_min.shape == (L, H, n, math.ceil(d / g))
    assert {t.dtype for t in (p.k_scale, p.k_min, p.v_scale, p.v_min)} == {torch.float16}
    assert p.num_tokens == n and p.num_layers == L
    k, v = p.to_dense(torch.bfloat16, "cpu")
    assert k.shape == v.shape == (L, H, n, d) and k.dtype == torch.bfloat16


def test_codes_round_half_to_even_and_clamp() -> None:
    # one V group [0, 1, ..., 15] + halves: scale 1 at int4 -> codes are the values; 0.5 -> 0, 2.5 -> 2
    v = torch.tensor([0.0, 15.0, 0.5, 2.5, 3.5, 14.5] + [7.0] * 26).view(1, 1, 1, 32)
    codes, scale, mn = quantize_v(v, 8, 32)
    assert float(scale) == pytest.approx(15 / 255, rel=1e-3)
    codes4, scale4, mn4 = quantize_v(v, 4, 32)
    assert float(scale4) == 1.0 and float(mn4) == 0.0
    assert unpack_int4(codes4, 32)[0, 0, 0, :6].tolist() == [0, 15, 0, 2, 4, 14]


def test_int4_packing_low_nibble_is_even_index() -> None:
    codes = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [1 | 2 << 4, 3 | 4 << 4, 5]
    assert unpack_int4(packed, 5).tolist() == [1, 2, 3, 4, 5]


def test_constant_groups_are_exact() -> None:
    k = torch.full((1, 2, 40, 8), 0.25)
    p = quantize_payload(DensePayload(k, k.clone()), 4)
    kk, vv = p.to_dense(torch.float32, "cpu")
    assert torch.equal(kk, k) and torch.equal(vv, k)


def test_caller_errors() -> None:
    x = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError):
        quantize_k(x, 3)
    with pytest.raises(ValueError):
        quantize_v(x, 8, 0)
    with pytest.raises(ValueError):
        quantize_k(torch.full((1, 1, 4, 4), float("nan")), 8)
    with pytest.raises(ValueError):
        quantize_v(torch.full((1, 1, 4, 4), 1e6), 8)
    p = quantize_payload(DensePayload(x, x), 8)
    with pytest.raises(ValueError):
        QuantPayload(bits=8, group_size=32, head_dim=4, k_codes=p.k_codes, k_scale=p.k_scale.float(),
                     k_min=p.k_min, v_codes=p.v_codes, v_scale=p.v_scale, v_min=p.v_min)


def _qwen_like(n: int = 128) -> DensePayload:
    g = torch.Generator().manual_seed(0)
    shape = (24, 2, n, 64)  # Qwen2.5-0.5B KV: 24 layers, 2 KV heads, head_dim 64
    return DensePayload(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())


@pytest.mark.parametrize("bits,expected", [(8, (1 + 4 / 32) / 2), (4, (0.5 + 4 / 32) / 2)])
def test_bytes_per_token_matches_layout(bits: int, expected: float) -> None:
    # fp16 scale + fp16 min per 32 elements = 4 B / 32 elems on top of the codes, for K and V alike
    dense = _qwen_like()
    assert bytes_per_token(dense) == 24 * 2 * 64 * 2 * 2
    ratio = bytes_per_token(quantize_payload(dense, bits, 32)) / bytes_per_token(dense)
    assert ratio == pytest.approx(expected)


@pytest.mark.parametrize("shape", [(24, 2, 64), (30, 3, 64)], ids=["qwen2.5-0.5b", "smollm2-135m"])
@pytest.mark.parametrize("bits,group,goal", [(8, 32, 0.57), (4, 32, 0.32), (8, 128, 0.53), (4, 128, 0.28)])
def test_bytes_per_token_goals(shape: tuple[int, int, int], bits: int, group: int, goal: float) -> None:
    """Issue 17's byte goals against bf16 (2 B per element; an fp16 scale + fp16 min is 4 B per group)."""
    g = torch.Generator().manual_seed(1)
    full = (shape[0], shape[1], 256, shape[2])  # (L, H, n, D)
    dense = DensePayload(torch.randn(full, generator=g).bfloat16(), torch.randn(full, generator=g).bfloat16())
    ratio = bytes_per_token(quantize_payload(dense, bits, group)) / bytes_per_token(dense)
    # K groups run along tokens; V groups along head_dim, so they are capped at head_dim
    k_bytes, v_bytes = bits / 8 + 4 / group, bits / 8 + 4 / min(group, shape[2])
    assert ratio == pytest.approx((k_bytes + v_bytes) / 4)
    assert ratio <= goal


def test_maybe_quantize() -> None:
    dense = _qwen_like(8)
    assert maybe_quantize(dense, None) is dense
    assert maybe_quantize(dense, 16).keys.dtype == torch.bfloat16
    assert isinstance(maybe_quantize(dense, 4), QuantPayload)


def test_pre_rope_keys_roundtrip_through_absolute_rotation() -> None:
    """unrotate_keys(k, start) rotated to start..start+n-1 gives k back (what place() does with such keys)."""
    from conftest import make_tiny_model

    from kvboost_core.quant import unrotate_keys
    from kvboost_core.rope import delta_cos_sin, rerotate

    rot = make_tiny_model("llama").model.rotary_emb
    k = torch.randn(2, 2, 40, 16, generator=torch.Generator().manual_seed(3))  # (L, H, n, D)
    pre = unrotate_keys(k, 100, rot)
    assert not torch.allclose(pre, k, atol=1e-3)
    cos, sin = delta_cos_sin(rot, torch.arange(100, 140))
    assert torch.allclose(rerotate(pre, cos, sin), k, atol=1e-5)
    q = maybe_quantize(DensePayload(k, k), 8, 32, start=100, rotary_emb=rot)
    assert isinstance(q, QuantPayload) and q.keys_pre_rope
    assert not maybe_quantize(DensePayload(k, k), 8, 32).keys_pre_rope

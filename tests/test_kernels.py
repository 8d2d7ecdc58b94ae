"""Native kernels (kvboost_core._C) against the pure-torch reference (kvboost_core.kernels.reference).

CPU parity tests skip when the extension is not built; with KVBOOST_REQUIRE_EXT=1 (CI, after `make kernels`)
a missing extension fails instead. The reference itself is checked against assembly.place()'s original loop
and runs everywhere. CUDA tests are marked gpu and skip without a device.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from kvboost_core import kernels
from kvboost_core.kernels import ops, reference
from kvboost_core.quant import quantize_payload
from kvboost_core.rope import rerotate
from kvboost_core.store.base import DensePayload

needs_ext = pytest.mark.skipif(not kernels.has_ext(), reason=f"kvboost_core._C not built ({kernels.load_error()})")
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.has_cuda_ext()),
                                reason="needs a CUDA device and a KVBOOST_CUDA=1 build")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.skipif(os.environ.get("KVBOOST_REQUIRE_EXT") != "1", reason="set KVBOOST_REQUIRE_EXT=1 to require it")
def test_extension_is_built():
    assert kernels.backend() != "torch", kernels.load_error()


def test_backend_names():
    assert kernels.backend() in ("torch", "pending-jit", "cpu-ext", "cuda-ext+cpu-ext")


def test_backend_reports_a_pending_jit_build_not_torch(monkeypatch):
    """Before the first kernel call of an install without the extension, the JIT build may still give native
    kernels: backend() said "torch" then. It says "pending-jit" until the outcome is known."""
    from kvboost_core.kernels import jit, ops

    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(ops, "_jit_tried", False)
    monkeypatch.setattr(jit, "why_not", lambda: None)
    assert kernels.backend() == "pending-jit"
    monkeypatch.setattr(jit, "why_not", lambda: "no C++ compiler (c++/g++) on PATH")
    assert kernels.backend() == "torch"  # a build is impossible here: the fallback is final
    monkeypatch.setattr(jit, "why_not", lambda: None)
    monkeypatch.setattr(ops, "_jit_tried", True)  # tried and failed
    assert kernels.backend() == "torch"


# -- helpers -------------------------------------------------------------------------------------------------
def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Half/bfloat16 bits as integers whose difference counts ulps (sign-magnitude -> two's complement)."""
    b = x.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def assert_close_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: 1e-6 relative; bf16/fp16: within 1 ulp of the reference's rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        diff = (_ordered(got) - _ordered(want)).abs().max().item() if got.numel() else 0
        assert diff <= 1, f"{diff} ulps apart"


def _payload(L, H, n, D, kind, G, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, n, D, generator=g) * 2 + torch.rand(1, 1, 1, D, generator=g) * 4  # per-channel offsets
    v = torch.randn(L, H, n, D, generator=g)
    if kind in DTYPES:
        return DensePayload(k.to(kind), v.to(kind))
    return quantize_payload(DensePayload(k, v), kind, G)


def _old_place(payload, src, length, keys, values, dst, cos, sin):
    """assembly.place()'s inner loop as it was before the kernels: the semantics place_block keeps."""
    k, v = payload.to_dense(keys[0].dtype, keys[0].device)
    k, v = k[:, :, src:src + length], v[:, :, src:src + length]
    if cos is not None:
        k = rerotate(k, cos, sin)
    for layer in range(len(keys)):
        keys[layer][0, :, dst:dst + length] = k[layer]
        values[layer][0, :, dst:dst + length] = v[layer]


def _random_case(rng: random.Random):
    L, H = rng.randint(1, 3), rng.randint(1, 4)
    n = rng.randint(1, 70)
    D = rng.choice((16, 32, 64, 80))
    R = rng.choice((D, D, D // 2, 0))  # 0: no rotation (delta 0)
    kind = rng.choice((torch.float32, torch.bfloat16, torch.float16, 8, 4, 8, 4))
    G = rng.choice((16, 32, 64))
    dst_dtype = rng.choice(DTYPES)
    src = rng.randint(0, n - 1)
    length = rng.randint(1, n - src)
    T = length + rng.randint(0, 40)
    dst = rng.randint(0, T - length)
    return L, H, n, D, R, kind, G, dst_dtype, src, length, T, dst


CASES = [_random_case(random.Random(i)) for i in range(48)]


def _buffers(L, H, T, D, dtype, stacked=False):
    # Non-zero fill: the slots outside [dst, dst + length) must come back untouched.
    if stacked:
        return torch.full((L, 1, H, T, D), 7.0, dtype=dtype), torch.full((L, 1, H, T, D), -7.0, dtype=dtype)
    return ([torch.full((1, H, T, D), 7.0, dtype=dtype) for _ in range(L)],
            [torch.full((1, H, T, D), -7.0, dtype=dtype) for _ in range(L)])


def _angles(length, R, seed):
    if R == 0:
        return None, None
    a = torch.randn(length, R, generator=torch.Generator().manual_seed(seed)) * 3
    return a.cos(), a.sin()


# -- the reference is today's place() ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES[:16], ids=lambda c: "-".join(map(str, c[:9])))
def test_reference_place_equals_old_place_loop(case, monkeypatch):
    L, H, n, D, R, kind, G, dt, src, length, T, dst = case
    payload = _payload(L, H, n, D, kind, G, seed=len(str(case)))
    cos, sin = _angles(length, R, 1)
    want_k, want_v = _buffers(L, H, T, D, dt)
    _old_place(payload, src, length, want_k, want_v, dst, cos, sin)
    monkeypatch.setattr(kernels, "has_ext", lambda: False)  # force the fallback
    got_k, got_v = _buffers(L, H, T, D, dt)
    ops.place_block(payload, src, length, got_k, got_v, dst, cos, sin)
    for a, b in zip(got_k + got_v, want_k + want_v):
        assert torch.equal(a, b)


# -- fused place: extension vs reference ---------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_place_block_matches_reference(case):
    L, H, n, D, R, kind, G, dt, src, length, T, dst = case
    payload = _payload(L, H, n, D, kind, G, seed=hash(str(case)) % 1000)
    cos, sin = _angles(length, R, 2)
    want_k, want_v = _buffers(L, H, T, D, dt)
    _old_place(payload, src, length, want_k, want_v, dst, cos, sin)
    stacked = case[0] == 2  # exercise the stacked (L, 1, H, T, D) form too
    got_k, got_v = _buffers(L, H, T, D, dt, stacked=stacked)
    if stacked:
        kw = {}
        if isinstance(payload, DensePayload):
            args = (payload.keys, payload.values)
        else:
            args = (payload.k_codes, payload.v_codes)
            kw = dict(k_scale=payload.k_scale, k_min=payload.k_min, v_scale=payload.v_scale, v_min=payload.v_min,
                      bits=payload.bits, group_size=payload.group_size, head_dim=payload.head_dim)
        ops.dequant_rerotate_into(got_k, got_v, *args, src, length, dst, cos, sin, **kw)
        got_k, got_v = list(got_k.unbind(0)), list(got_v.unbind(0))
    else:
        ops.place_block(payload, src, length, got_k, got_v, dst, cos, sin)
    for a, b in zip(got_k + got_v, want_k + want_v):
        assert_close_ulp(a, b)
        # Stronger than the tolerance: the CPU kernel reproduces torch's rounding steps exactly.
        assert torch.equal(a, b)


@needs_ext
def test_place_strided_source_and_buffers():
    # A dense payload that is a view (token slice) and buffers that are views of a larger allocation.
    L, H, n, D = 2, 2, 40, 32
    base = torch.randn(L, H, 2 * n, D)
    k, v = base[:, :, 5:5 + n], base.flip(2)[:, :, :n]
    big = torch.zeros(L, 1, H, 100, 2 * D)
    dk = [big[i, :, :, :, :D] for i in range(L)]
    dv = [big[i, :, :, :, D:] for i in range(L)]
    cos, sin = _angles(30, D, 3)
    ops.dequant_rerotate_into(dk, dv, k, v, 3, 30, 50, cos, sin)
    want = rerotate(k[:, :, 3:33], cos, sin)
    assert torch.equal(big[:, 0, :, 50:80, :D], want) and torch.equal(big[:, 0, :, 50:80, D:], v[:, :, 3:33])
    assert big[:, :, :, :50].abs().sum() == 0 and big[:, :, :, 80:].abs().sum() == 0


@needs_ext
def test_place_rejects_bad_arguments():
    payload = _payload(1, 2, 10, 16, 8, 16, 0)
    dk, dv = _buffers(1, 2, 20, 16, torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        ops.place_block(payload, 5, 6, dk, dv, 0, None, None)
    with pytest.raises(ValueError, match="out of range"):
        ops.place_block(payload, 0, 5, dk, dv, 16, None, None)
    with pytest.raises(ValueError, match="cos/sin"):
        ops.place_block(payload, 0, 5, dk, dv, 0, torch.ones(4, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="layers"):
        ops.place_block(payload, 0, 5, dk + dk, dv + dv, 0, None, None)


# -- quantize_kv ---------------------------------------------------------------------------------------------
QCASES = [(bits, G, dt, shape) for bits in (8, 4) for G, dt, shape in (
    (16, torch.float32, (2, 3, 37, 64)), (32, torch.bfloat16, (1, 2, 70, 80)), (64, torch.float16, (3, 1, 65, 16)),
    (5, torch.float32, (1, 2, 13, 33)), (32, torch.float32, (1, 1, 1, 7)))]


@needs_ext
@pytest.mark.parametrize("bits,G,dt,shape", QCASES)
def test_quantize_kv_bit_exact(bits, G, dt, shape):
    g = torch.Generator().manual_seed(bits * 100 + G)
    k = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(dt)  # per-channel scales
    v = (torch.rand(shape, generator=g) * 6 - 1).to(dt)
    k.view(-1)[::11] = 0.0
    v[..., :1] = 3.0  # constant runs -> zero scales in some groups
    got = ops.quantize_kv(k, v, bits, G)
    want = reference.quantize_kv(k, v, bits, G)
    names = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype == torch.uint8 else b.view(torch.int16)), name


@needs_ext
def test_quantize_kv_edge_values():
    # Directed rounding corner cases: tiny and huge magnitudes, signed zeros, exact fp16 values, ties.
    vals = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 6.1e-5, 65504.0, -65504.0, 1.0 / 3, 2.5, 0.5, 1e4, -3e-7])
    k = vals[torch.randperm(12, generator=torch.Generator().manual_seed(0)).repeat(8)[:64]].view(1, 1, 8, 8)
    for bits in (8, 4):
        for G in (1, 2, 3, 8):
            got, want = ops.quantize_kv(k, k.flip(-1), bits, G), reference.quantize_kv(k, k.flip(-1), bits, G)
            for a, b in zip(got, want):
                assert torch.equal(a, b)


@needs_ext
@pytest.mark.parametrize("bad,msg", [(float("nan"), "non-finite"), (float("inf"), "non-finite"), (7e4, "fp16 range")])
def test_quantize_kv_errors_match(bad, msg):
    k, v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    for t in (k, v):
        t.view(-1)[5] = bad
        with pytest.raises(ValueError, match=msg):
            ops.quantize_kv(k, v, 8, 2)
        with pytest.raises(ValueError, match=msg):
            reference.quantize_kv(k, v, 8, 2)
        t.zero_()


@needs_ext
def test_native_errors_keep_their_numbers():
    """An argument error formatted inside the extension reaches Python whole. A second C++ runtime in the
    extension (a compiler that finds only the static libstdc++) formats it with an uninitialised locale and drops
    the numbers here, and crashed the process on the lent GPU image (kernels.jit.link_flags)."""
    with pytest.raises(ValueError, match=r"bits must be 8 or 4, got 3$"):
        torch.ops.kvboost.quantize_kv(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 3, 4)
    with pytest.raises(ValueError, match=r"source tokens \[5, 11\) out of range for a payload of 10 tokens"):
        ops.place_block(_payload(1, 2, 10, 16, 8, 16, 0), 5, 6, *_buffers(1, 2, 20, 16, torch.float32), 0, None, None)


# -- blend_select --------------------------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("seed", range(8))
def test_blend_select_matches_reference(seed):
    rng = random.Random(seed)
    H, n, D = rng.randint(1, 4), rng.randint(1, 300), rng.choice((16, 64, 80))
    dt = rng.choice(DTYPES)
    g = torch.Generator().manual_seed(seed)
    fresh, cached = torch.randn(H, n, D, generator=g).to(dt), torch.randn(H, n, D, generator=g).to(dt)
    forced = torch.rand(n, generator=g) < 0.1 if seed % 2 else None
    for ratio_or_k in (0.0, 0.15, 0.5, 1.0, 3, n + 5):
        got = ops.blend_select(fresh, cached, ratio_or_k, forced)
        want = reference.blend_select(fresh, cached, reference.select_count(ratio_or_k, n), forced)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert torch.all(got[1:] > got[:-1])
        if forced is not None:
            assert torch.isin(torch.nonzero(forced).flatten(), got).all()


def test_blend_select_reference_semantics():
    # Integer-valued data makes every deviation exact, so ties are real: the lower index wins.
    dev = torch.tensor([4.0, 9.0, 4.0, 1.0, 9.0, 0.0, 4.0])  # per-token squared deviation
    fresh = torch.zeros(1, 7, 1)
    cached = dev.sqrt().view(1, 7, 1)
    assert reference.blend_select(fresh, cached, 3).tolist() == [0, 1, 4]
    forced = torch.tensor([False, False, False, False, False, True, False])
    assert reference.blend_select(fresh, cached, 3, forced).tolist() == [1, 4, 5]
    assert reference.blend_select(fresh, cached, 0, forced).tolist() == [5]  # forced never dropped
    assert reference.blend_select(fresh, cached, 99).tolist() == list(range(7))
    cached_nan = cached.clone()
    cached_nan[0, 3, 0] = float("nan")
    assert reference.blend_select(fresh, cached_nan, 1).tolist() == [3]  # NaN ranks first, like topk
    if kernels.has_ext():
        for c, f, k in ((cached, None, 3), (cached, forced, 3), (cached, forced, 0), (cached_nan, None, 2)):
            assert torch.equal(ops.blend_select(fresh.repeat(3, 1, 16), c.repeat(3, 1, 16), k, f),
                               reference.blend_select(fresh, c, k, f))


def test_select_count():
    assert reference.select_count(0.15, 100) == 15 and reference.select_count(0.151, 100) == 16
    assert reference.select_count(7, 100) == 7
    with pytest.raises(TypeError):
        reference.select_count(True, 3)


# -- torch.library plumbing ----------------------------------------------------------------------------------
@needs_ext
def test_opcheck():
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    torch.library.opcheck(torch.ops.kvboost.quantize_kv.default, (k, v, 4, 4))
    kc, ks, km, vc, vs, vm = ops.quantize_kv(k, v, 8, 4)
    dk, dv = _buffers(2, 2, 12, 16, torch.bfloat16)
    cos, sin = _angles(5, 8, 0)
    torch.library.opcheck(torch.ops.kvboost.dequant_rerotate_into.default,
                          (dk, dv, kc, vc, ks, km, vs, vm, 8, 4, 16, 2, 5, 7, cos, sin),
                          test_utils=("test_schema", "test_faketensor"))


# -- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES[:24], ids=lambda c: "-".join(map(str, c[:9])))
def test_cuda_place_matches_reference(case):
    L, H, n, D, R, kind, G, dt, src, length, T, dst = case
    payload = _payload(L, H, n, D, kind, G, seed=5)
    cos, sin = _angles(length, R, 4)
    want_k, want_v = _buffers(L, H, T, D, dt)
    _old_place(payload, src, length, want_k, want_v, dst, cos, sin)
    got_k, got_v = (list(t.cuda() for t in x) for x in _buffers(L, H, T, D, dt))
    c = cos.cuda() if cos is not None else None
    s = sin.cuda() if sin is not None else None
    ops.place_block(payload, src, length, got_k, got_v, dst, c, s)
    for a, b in zip(got_k + got_v, want_k + want_v):
        assert_close_ulp(a.cpu(), b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits,G,dt,shape", QCASES)
def test_cuda_quantize_matches_reference_on_cuda(bits, G, dt, shape):
    g = torch.Generator().manual_seed(G)
    k = (torch.randn(shape, generator=g) * 3).to(dt).cuda()
    v = torch.randn(shape, generator=g).to(dt).cuda()
    for a, b in zip(ops.quantize_kv(k, v, bits, G), reference.quantize_kv(k, v, bits, G)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_cuda_blend_select(seed):
    g = torch.Generator().manual_seed(seed)
    H, n, D = 2, 500, 64
    fresh, cached = torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g)
    forced = torch.rand(n, generator=g) < 0.05
    got = ops.blend_select(fresh.cuda(), cached.cuda(), 0.2, forced.cuda())
    assert torch.equal(got.cpu(), reference.blend_select(fresh, cached, math.ceil(0.2 * n), forced))

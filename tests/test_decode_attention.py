"""The native decode attention (kvboost_core.kernels.ops.decode_attention) against a float64 reference and
torch's SDPA (its reference), its thread-count invariance, its argument checks and its fallback."""

from __future__ import annotations

import pytest
import torch

from kvboost_core import kernels
from kvboost_core.kernels import ops, reference

needs_ext = pytest.mark.skipif(not kernels.has_ext(), reason=f"kvboost_core._C not built ({kernels.load_error()})")

# (query heads, KV heads, head_dim, capacity, length): GQA 3 and 4, MHA; the AVX2 widths 16/32/64/128 and the
# scalar path (12, 40); lengths around the 8-lane tails
SHAPES = [(9, 3, 64, 1900, 1800), (4, 4, 16, 50, 1), (8, 2, 12, 300, 257), (32, 8, 128, 600, 599),
          (6, 2, 32, 20, 9), (4, 1, 40, 64, 8), (12, 4, 64, 33, 7)]


def _case(h, kv, d, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, d, generator=g), torch.randn(kv, cap, d, generator=g) * 2,
            torch.randn(kv, cap, d, generator=g))


def _float64(q, k, v, n, scale):
    group = q.shape[0] // k.shape[0]
    qd, kd, vd = q.double(), k.double(), v.double()
    return torch.stack([torch.softmax((kd[h // group, :n] @ qd[h]) * scale, 0) @ vd[h // group, :n]
                        for h in range(q.shape[0])])


@needs_ext
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_the_kernel_is_as_close_to_float64_as_sdpa(shape):
    h, kv, d, cap, n = shape
    q, k, v = _case(h, kv, d, cap)
    scale = d ** -0.5
    assert ops.decode_kernel(q.device)
    got = ops.decode_attention(q, k, v, n, scale)
    sdpa = reference.decode_attention(q, k, v, n, scale)
    exact = _float64(q, k, v, n, scale)
    err, sdpa_err = float((got.double() - exact).abs().max()), float((sdpa.double() - exact).abs().max())
    assert err <= max(2e-6, 2 * sdpa_err), (err, sdpa_err)
    assert got.shape == (h, d) and got.dtype == torch.float32


@needs_ext
def test_large_scores_do_not_overflow_and_a_single_key_is_its_value():
    q, k, v = _case(4, 2, 16, 10)
    got = ops.decode_attention(q * 300, k, v, 10, 1.0)  # scores in the thousands: max-subtracted exp
    assert torch.isfinite(got).all()
    assert torch.allclose(got, _float64(q * 300, k, v, 10, 1.0).float(), atol=1e-5)
    one = ops.decode_attention(q, k, v, 1, 0.25)
    assert torch.equal(one, v[:, :1].repeat_interleave(2, 0).view(4, 16))


@needs_ext
def test_a_rows_result_does_not_depend_on_the_thread_count():
    q, k, v = _case(9, 3, 64, 700)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(ops.decode_attention(q, k, v, 650, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_ext
def test_strided_buffers_are_read_in_place():
    q, k, v = _case(6, 2, 32, 40)
    buf_k, buf_v = torch.randn(1, 2, 80, 32), torch.randn(1, 2, 80, 32)
    buf_k[0, :, :40], buf_v[0, :, :40] = k, v
    assert torch.equal(ops.decode_attention(q, buf_k[0], buf_v[0], 33, 0.2), ops.decode_attention(q, k, v, 33, 0.2))


@needs_ext
@pytest.mark.parametrize("bad,msg", [
    (lambda q, k, v: (q, k, v, 0), "length"),
    (lambda q, k, v: (q, k, v, 41), "length"),
    (lambda q, k, v: (q[:5], k, v, 4), "multiple of KV heads"),
    (lambda q, k, v: (q[:, :8], k, v, 4), "head_dim"),
    (lambda q, k, v: (q, k, v[:, :20], 4), "one shape"),
])
def test_bad_arguments_are_value_errors(bad, msg):
    q, k, v = _case(6, 2, 16, 40)
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvboost.decode_attention(*bad(q, k, v), 0.25)


def test_without_the_extension_or_off_fp32_it_is_the_sdpa_reference(monkeypatch):
    q, k, v = _case(6, 2, 16, 40)
    monkeypatch.setattr(kernels, "has_ext", lambda: False)
    monkeypatch.setattr(ops, "_jit_tried", True)
    assert not ops.decode_kernel(q.device)
    assert torch.equal(ops.decode_attention(q, k, v, 30, 0.25), reference.decode_attention(q, k, v, 30, 0.25))
    monkeypatch.undo()
    half = ops.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 30, 0.25)
    assert torch.equal(half, reference.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 30, 0.25))


@needs_ext
def test_opcheck():
    q, k, v = _case(6, 2, 16, 40)
    torch.library.opcheck(torch.ops.kvboost.decode_attention.default, (q, k, v, 30, 0.25),
                          test_utils=("test_schema", "test_faketensor"))

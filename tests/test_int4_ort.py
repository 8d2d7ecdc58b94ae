"""benchmarks/bench_int4_ort.py's building blocks (kvboost_rag.app.bench.int4_ort): a GGUF's Q4_1/Q8_0 blocks
read as gguf's own dequantization reads them, rows matched bitwise, and the MatMulNBits graph (onnxruntime, the
bench extra; skipped without it) equal to dequantize-then-matmul at accuracy 0."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from kvboost_rag.app.bench import int4_ort  # noqa: E402


def _tensor(kind: str, weight: np.ndarray) -> types.SimpleNamespace:
    qtype = gguf.GGMLQuantizationType[kind]
    return types.SimpleNamespace(name="blk.0.test.weight", tensor_type=qtype, data=quantize(weight, qtype))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_blocks_are_ggufs_own_values(kind):
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    t = _tensor(kind, w)
    q, d, m = int4_ort._blocks(t)
    deq = q.astype(np.float32) * d[..., None] + (0 if m is None else m[..., None])
    ref = dequantize(t.data, t.tensor_type)
    assert np.array_equal(deq.reshape(24, 96), ref)
    assert (m is None) == (kind == "Q8_0") and q.shape == (24, 3, 32)
    order = np.random.default_rng(1).permutation(24)
    assert np.array_equal(int4_ort._row_order(ref[order], ref), order)
    with pytest.raises(ValueError, match="differs"):
        int4_ort._row_order(ref + 1, ref)


def test_other_quantizations_are_refused_by_name():
    t = types.SimpleNamespace(name="blk.3.ffn_up.weight", tensor_type=gguf.GGMLQuantizationType.Q6_K,
                              data=np.zeros((4, 210), np.uint8))
    with pytest.raises(ValueError, match="Q6_K"):
        int4_ort._blocks(t)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_graph_at_accuracy_0_is_dequantize_then_matmul(kind):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    w = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32) * 0.1
    t = _tensor(kind, w)
    q, d, m = int4_ort._blocks(t)
    linear = int4_ort._linear_class()(int4_ort._session(q, d, m, 0, 1), 40, 64, 0)
    x = torch.randn(5, 3, 64)
    ref = x @ torch.from_numpy(dequantize(t.data, t.tensor_type)).T
    assert torch.allclose(linear(x), ref, atol=1e-5, rtol=1e-5)

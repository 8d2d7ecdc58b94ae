"""The precision the linear layers' weights are held and read at (issue #35).

Decode is bound by weight traffic: every token reads every weight once. ``weights="fp16"`` packs each linear layer
of the decoder and the LM head at fp16 for FBGEMM (``torch.ops.quantized.linear_prepack_fp16``), multiplies through
``linear_dynamic_fp16`` and holds the input embedding at fp16. Activations, accumulation and outputs stay fp32; only
the stored weights are rounded (relative error <= 2**-11 per weight). Measured on this project's 2-core CPU
(SmolLM2-135M, ``benchmarks/bench_decode.py --ops``), it is at least as fast as fp32 MKL from one decode row to a
2K-token prefill and decodes about 2x faster, and a row's output does not depend on the other rows of its batch
(alone and inside a batch it is bitwise equal), which batched decoding's determinism needs. FBGEMM pads the input
dimension to blocks of 512, so SmolLM2's 576-wide layers take about 0.9x of their fp32 bytes: speed, not memory.

Chosen by measurement over the alternatives torch ships for CPU (``bench_decode.py --ops`` prints them):

- ``torch._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu`` (weight-only int8 / group-wise int4,
  the form a GGUF's Q8_0 / Q4_1 weights would keep exactly) run 2-20x *slower* than fp32 at one row here;
- FBGEMM's dynamic int8 (``quantize_dynamic``) is fastest, but quantizes the activations per tensor: a row's output
  then depends on the other rows in its batch, and on more than the weights' precision.

The packed weight is not an ``nn.Parameter``: a 16-byte digest of the fp16 weight is kept as a buffer, so
:func:`kvboost_core.keys.model_fingerprint` still covers it, and :func:`fingerprint` derives the stored KV's key
from the fp32 model's, so KV computed at one precision is never served for another.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash
from torch import nn

from kvboost_core.config import check_precision


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight packed at fp16 for FBGEMM; fp32 in, fp32 out. Inference only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w16 = linear.weight.detach().to(torch.float16)
        bias = None if linear.bias is None else linear.bias.detach().float()
        # prepack reads fp32: the fp16-rounded values, so the packed weight is exactly w16
        self._packed = torch.ops.quantized.linear_prepack_fp16(w16.float().contiguous(), bias)
        digest = xxhash.xxh3_128(w16.contiguous().view(torch.uint8).numpy().tobytes()).digest()
        self.register_buffer("weight_digest", torch.frombuffer(bytearray(digest), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("a PackedLinear (weights='fp16') has no gradient; train on an fp32 model")
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, shape[-1]).float().contiguous(), self._packed)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_fp32(self) -> torch.Tensor:
        """The weight as the layer computes with it (the fp16 values, in fp32); (out, in)."""
        w, _ = torch.ops.quantized.linear_unpack_fp16(self._packed)
        return w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=fp16 (FBGEMM)"


class HalfEmbedding(nn.Module):
    """``nn.Embedding`` whose table is held at fp16; looked-up rows are returned in fp32. Inference only."""

    weight: torch.Tensor  # (V, D) fp16, a buffer

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.register_buffer("weight", embedding.weight.detach().to(torch.float16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight).float()  # (..., D)


def precision(model: Any) -> str:
    """``"fp16"`` when any linear layer of ``model`` is packed, else ``"fp32"``."""
    return "fp16" if any(isinstance(m, PackedLinear) for m in model.modules()) else "fp32"


def _targets(model: Any) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` of the decoder layers and the LM head, as (parent, attribute, module)."""
    root = model.get_decoder() if hasattr(model, "get_decoder") else model
    out = [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()
           if type(child) is nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is nn.Linear:
        out.append((model, _attr_of(model, head), head))
    return out


def _attr_of(model: nn.Module, module: nn.Module) -> str:
    for name, child in model.named_children():
        if child is module:
            return name
    raise RuntimeError("the output embedding is not a direct child of the model")


def pack(model: Any, weights: str) -> Any:
    """Hold ``model``'s linear layers at ``weights`` precision, in place; returns ``model``. ``"fp32"`` leaves it
    as it is. Refuses a model that is not fp32 on the CPU, or one already packed, with a ValueError."""
    weights = check_precision(weights)
    current = precision(model)
    if weights == "fp32":
        if current != "fp32":
            raise ValueError(f"weights='fp32', but this model's linear layers are already packed at {current}; "
                             "load it again to run at fp32")
        return model
    if current == weights:
        return model
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"weights={weights!r} packs an fp32 model on the CPU (FBGEMM); this one is {p.dtype} on "
                         f"{p.device}. On a GPU, load it at dtype=torch.float16 or torch.bfloat16 instead")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"weights={weights!r} needs torch's FBGEMM backend (x86 with AVX2); this build has "
                         f"{torch.backends.quantized.supported_engines}")
    for parent, name, linear in _targets(model):
        setattr(parent, name, PackedLinear(linear))
    embedding = model.get_input_embeddings()
    if type(embedding) is nn.Embedding:  # read one row per token; held at fp16 too (its tied head is packed)
        model.set_input_embeddings(HalfEmbedding(embedding))
    with torch.no_grad():  # the rest (norms, rotary tables) in memory of their own: a weights file mapped by the
        for t in [*model.parameters(), *model.buffers()]:  # loader is then released, not held by a few views
            t.data = t.data.clone()
    for p in model.parameters():  # inference only: a plain call outside no_grad then runs, training is refused
        p.requires_grad_(False)
    return model


def fingerprint(fp32_fingerprint: str, weights: str) -> str:
    """The key of KV computed at ``weights`` precision, derived from the fp32 model's: the same at fp32."""
    if check_precision(weights) == "fp32":
        return fp32_fingerprint
    return xxhash.xxh3_128(f"{fp32_fingerprint}|weights={weights}".encode()).hexdigest()

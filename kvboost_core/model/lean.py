"""One decode step of a Llama-shaped decoder without the HF module stack (issue #35).

A decode step is one token through every layer. Through HF's modules (``ModelDriver.run_layer`` under the planned
forward) it pays per layer for keyword plumbing, the attention-interface dispatch, the row-block plan and the cache
object's hooks: on SmolLM2-135M at 1.8K tokens of context, about 5 ms of a 33 ms step at fp16 (1 thread), where the
linear layers take 14 ms and attention over the fp32 KV 9 ms. :class:`LeanDecoder` runs the same operations in the
same order on the same tensors (RMSNorm as HF's ``LlamaRMSNorm``, rotary as ``apply_rotary_pos_emb``, the model's
own linear modules, SDPA with the layer's ``scaling`` and GQA) and writes K/V into the same :class:`ScatterCache`
slots, so its logits are the planned forward's to the last bit (``tests/test_lean_decode.py``) at less cost.

It serves only what it reproduces exactly: decoders whose layers are Llama's (pre-norm RMSNorm, SiLU-gated MLP,
rotary q/k without per-head norms), with no sliding window, no logit softcapping and no reader adapter gating rows.
:func:`lean_decoder` returns None for anything else, and the caller keeps the planned forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvboost_core.model.driver import ModelDriver, ScatterCache

# model_type -> the RMSNorm class name whose forward :func:`_rms` reproduces (weight * x / rms(x), fp32 inside)
_NORMS = {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "mistral": "MistralRMSNorm"}
# (q (H, D), keys (H_kv, T, D), values, length, scale) -> (H, D): one decode row's attention over keys [0, length)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
_IMPLS = ("sdpa",)  # eager runs each family's own attention function: not reproduced here

__all__ = ["Attend", "DenseRows", "KVRows", "LeanDecoder", "lean_decoder"]


@dataclass(frozen=True, slots=True)
class _Layer:
    norm1: torch.Tensor  # (C,)
    eps1: float
    q: Any  # the model's own linear modules (nn.Linear or a packed one)
    k: Any
    v: Any
    o: Any
    norm2: torch.Tensor
    eps2: float
    gate: Any
    up: Any
    down: Any
    scaling: float


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm.forward, op for op (x fp32)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _why_not(driver: ModelDriver) -> str | None:
    """Why :class:`LeanDecoder` cannot reproduce this model's decode step exactly; None when it can."""
    config = driver.model.config
    kind = getattr(config, "model_type", None)
    if kind not in _NORMS:
        return f"model_type {kind!r} is not one of {sorted(_NORMS)}"
    if driver.reader is not None:
        return "a reader adapter gates rows"
    if any(w is not None for w in driver.windows):
        return "sliding-window layers"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit softcapping"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r}"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _IMPLS:
        return f"attention implementation {impl!r}"
    if next(driver.model.parameters()).dtype != torch.float32:
        return "not an fp32 model"
    for layer in driver.inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return "a layer that is not Llama's"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ != _NORMS[kind]:
                return f"norm {type(norm).__name__}"
    if type(driver.inner.norm).__name__ != _NORMS[kind]:
        return f"final norm {type(driver.inner.norm).__name__}"
    return None


def _eps(norm: Any) -> float:
    return float(norm.variance_epsilon)


class LeanDecoder:
    """Decode steps for one model (see the module docstring). Build it with :func:`lean_decoder`."""

    def __init__(self, driver: ModelDriver, *, attend: Attend | None = None) -> None:
        self.driver = driver
        # None: SDPA as the planned forward calls it, so the step is bitwise the planned forward's. The engine
        # passes the native kernel (kvboost_core.kernels.ops.decode_attention) where it runs: faster, not SDPA's
        # bits (within ~1e-6 of a float64 reference, as SDPA is).
        self.attend = attend
        inner = driver.inner
        config = driver.model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = [
            _Layer(layer.input_layernorm.weight, _eps(layer.input_layernorm), layer.self_attn.q_proj,
                   layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm), layer.mlp.gate_proj,
                   layer.mlp.up_proj, layer.mlp.down_proj, float(layer.self_attn.scaling))
            for layer in inner.layers]
        self.norm, self.norm_eps = inner.norm.weight, _eps(inner.norm)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: int, cache: ScatterCache) -> torch.Tensor:
        """Run ``token`` (a 1-element long tensor) at ``position``, attending to slots [0, position] of ``cache``
        (its K/V written there); returns the logits (vocab,). One row of :meth:`step_rows`: the same operations on
        the same shapes as a one-row step, so the bits are the same."""
        cache.length = position + 1
        return self.step_kv(token.view(1), [position], DenseRows(cache.keys, cache.values, [position], self.attend))[0]

    @torch.inference_mode()
    def step_rows(self, tokens: torch.Tensor, positions: list[int], keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> torch.Tensor:
        """One token for each of ``n`` rows (the batched server's step): row ``i`` runs ``tokens[i]`` at
        ``positions[i]``, its K/V written into row ``i`` of the per-layer (rows, H_kv, T, D) buffers, and attends
        to its own slots [0, positions[i]] only, one attention call per row (so its result cannot depend on the
        other rows; the linear layers' batch invariance is the caller's: ``serving.invariant.row_tiled``).
        Returns the logits (n, V)."""
        return self.step_kv(tokens, positions, DenseRows(keys, values, positions, self.attend))

    def step_kv(self, tokens: torch.Tensor, positions: list[int], kv: KVRows) -> torch.Tensor:
        """:meth:`step_rows` over any :class:`KVRows` (the batched server's paged pool, or dense buffers): row
        ``i`` runs ``tokens[i]`` at ``positions[i]``; ``kv`` stores its K/V and attends it. Not under inference
        mode itself (the callers are). Returns the logits (n, V)."""
        d = self.driver
        heads, kv_heads, hd = self.heads, self.kv_heads, self.head_dim
        n = tokens.numel()
        pos = torch.tensor(positions, device=tokens.device)
        x = d.inner.embed_tokens(tokens.view(n, 1))  # (n, 1, C)
        cos, sin = d.inner.rotary_emb(x, position_ids=pos.view(n, 1))  # (n, 1, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (n, 1, 1, D)
        for i, ly in enumerate(self.layers):
            h = _rms(x, ly.norm1, ly.eps1)
            q = ly.q(h).view(n, 1, heads, hd).transpose(1, 2)  # (n, H, 1, D)
            k = ly.k(h).view(n, 1, kv_heads, hd).transpose(1, 2)  # (n, H_kv, 1, D)
            v = ly.v(h).view(n, 1, kv_heads, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv.write(i, k[:, :, 0], v[:, :, 0])  # (n, H_kv, D): row r at position pos_r
            o = torch.stack([kv.attend(i, r, q[r:r + 1], ly.scaling) for r in range(n)])  # (n, H, D)
            x = x + ly.o(o.reshape(n, 1, heads * hd))
            h = _rms(x, ly.norm2, ly.eps2)
            x = x + ly.down(F.silu(ly.gate(h)) * ly.up(h))
        return d.model.lm_head(_rms(x, self.norm, self.norm_eps))[:, -1]  # (n, V)


class KVRows(Protocol):
    """Where a lean step's rows keep their K/V: :meth:`write` stores the step's new K/V, :meth:`attend` runs one
    row's attention over its keys so far (the new one included). One attention call per row, so a row's result
    cannot depend on the other rows."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, H_kv, D): row r's new K/V of ``layer``, at the row's position."""

    def attend(self, layer: int, row: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q (1, H, 1, D) -> (H, D): ``row``'s attention over its keys of ``layer``."""


class DenseRows:
    """Per-layer dense (rows, H_kv, T, D) buffers, row r writing and reading slots [0, positions[r]]; ``attend``
    None runs SDPA as the planned forward calls it (bitwise), else that one-row attention (:data:`Attend`)."""

    __slots__ = ("keys", "values", "positions", "_pos", "_rows", "_attend")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int],
                 attend: Attend | None) -> None:
        self.keys, self.values, self.positions, self._attend = keys, values, positions, attend
        device = keys[0].device
        self._pos = torch.tensor(positions, device=device)
        self._rows = torch.arange(len(positions), device=device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kb, vb = self.keys[layer], self.values[layer]
        kb[self._rows, :, self._pos] = k.to(kb.dtype)  # (n, H_kv, D) into row r, slot pos_r
        vb[self._rows, :, self._pos] = v.to(vb.dtype)

    def attend(self, layer: int, row: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        kb, vb, length = self.keys[layer], self.values[layer], self.positions[row] + 1
        heads, hd = q.shape[1], q.shape[3]
        if self._attend is not None:
            return self._attend(q.reshape(heads, hd), kb[row], vb[row], length, scale)
        return F.scaled_dot_product_attention(q, kb[row:row + 1, :, :length], vb[row:row + 1, :, :length],
                                              scale=scale, enable_gqa=heads != kb.shape[1]).view(heads, hd)


def lean_decoder(driver: ModelDriver, *, attend: Attend | None = None) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``driver``'s model, or None where it would not reproduce the planned forward's
    operations (the planned forward then decodes). ``attend``: as :class:`LeanDecoder`'s."""
    return None if _why_not(driver) is not None else LeanDecoder(driver, attend=attend)

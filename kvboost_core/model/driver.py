"""Driving a HuggingFace decoder layer by layer, for a chosen subset of positions.

This is the only model-specific module. Llama-like families (pre-norm decoder layers that call
``cache.update(k, v, layer_idx)`` after RoPE and take ``position_embeddings`` from ``model.model.rotary_emb``)
share one driver; others are refused with a clear error. Everything model-specific the engine needs is here:
embedding, rotary cos/sin, running one layer, the final norm and the LM head, and per-layer sliding windows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvboost_core.model import attention
from kvboost_core.rope import RopeSupport, rope_support

# Families whose decoder layers follow the Llama contract (verified by tests against full prefill).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "granite", "olmo", "olmo2", "smollm3")


def output_cache(out: Any) -> Any:
    """The KV cache an HF forward returned: transformers 5 calls it ``cache``, earlier 5.x ``past_key_values``."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class KVWritten(Exception):
    """Raised by :meth:`ScatterCache.update` in K/V-only mode: the layer's K/V are written, stop the layer."""


class ScatterCache:
    """A duck-typed HF ``Cache`` over preallocated per-layer buffers.

    ``update`` writes the new K/V of the positions being computed into their slots (any positions, not only
    a suffix) and returns the buffers up to ``length``, so attention sees cached and fresh entries alike. An
    optional ``on_update(layer, k_new, v_new)`` hook runs first: CacheBlend uses it to compare fresh K/V with
    the cached entries before they are overwritten. With ``kv_only`` set, ``update`` raises :class:`KVWritten`
    after writing, so a layer costs its norm and Q/K/V projections only (see :meth:`ModelDriver.layer_kv`).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys  # per layer (1, H_kv, T_max, D)
        self.values = values
        self.positions: torch.Tensor | None = None  # (n,) positions being computed this step
        self.length = 0  # attention covers slots [0, length)
        self.on_update: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.kv_only = False
        self.is_compileable = False
        self.hf: Any = None  # the HF cache object on the prefix-only path
        # positions >= gate_from run through the reader adapter (kvboost_core.lora.reader), if one is attached
        self.gate_from: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.positions is None:
            raise RuntimeError("ScatterCache.update called outside a planned forward")
        if self.on_update is not None:
            self.on_update(layer_idx, key_states, value_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[:, :, self.positions] = key_states.to(k_buf.dtype)  # (1, H, n, D) into (1, H, T, D)
        v_buf[:, :, self.positions] = value_states.to(v_buf.dtype)
        if self.kv_only:
            raise KVWritten
        return k_buf[:, :, : self.length], v_buf[:, :, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


@dataclass
class ModelDriver:
    model: Any
    inner: Any  # model.model
    num_layers: int
    num_kv_heads: int
    head_dim: int
    windows: list[int | None]  # sliding window per layer (None: full causal)
    rope: RopeSupport
    max_context: int
    layerwise: bool = True  # False: prefix-only reuse through HF's own forward and cache (no re-placement)
    # Why no KV is reused at all (plain HF generation), or None. Set for prefix-only families with sliding-window
    # layers: HF keeps only the last `window` tokens of those layers, so their KV cannot be stored or re-placed.
    no_reuse: str | None = None
    reader: Any = None  # a kvboost_core.lora.reader.ReaderAdapter attached to the model, or None

    @classmethod
    def for_model(cls, model: Any) -> ModelDriver:
        cfg = model.config
        mtype = getattr(cfg, "model_type", "?")
        if getattr(cfg, "is_encoder_decoder", False) or not callable(getattr(model, "generate", None)):
            raise ValueError(f"{type(model).__name__} is not a decoder-only causal LM; kvboost needs one "
                             "(load it with AutoModelForCausalLM)")
        if mtype not in LLAMA_LIKE:
            return cls._prefix_only(model, f"model type {mtype!r} is not a supported RoPE family (absolute or "
                                           f"ALiBi positions, or untested); supported: {', '.join(LLAMA_LIKE)}")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            raise ValueError(f"{type(model).__name__} does not expose model.layers / model.rotary_emb; "
                             "pass a *ForCausalLM model")
        # Our masks are explicit (any positions), which flash kernels do not take. Through attention.use_base:
        # another engine's forward on this model may have the name switched to kvboost's wrapper right now.
        attention.use_base(cfg, ("sdpa", "eager"), "sdpa")
        support = rope_support(cfg, inner.rotary_emb)
        if not support.rerotatable:
            warnings.warn(f"kvboost: {support.reason}; falling back to exact-prefix reuse only", stacklevel=3)
        n_layers = cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(model=model, inner=inner, num_layers=n_layers, num_kv_heads=n_kv, head_dim=head_dim,
                   windows=_sliding_windows(cfg, n_layers), rope=support,
                   max_context=int(getattr(cfg, "max_position_embeddings", 0) or 0))

    @classmethod
    def _prefix_only(cls, model: Any, reason: str) -> ModelDriver:
        """Exact-prefix reuse through the model's own forward: correct for any causal LM whose HF cache is
        (B, H, T, D) per layer, because an identical prefix at identical positions needs no re-rotation."""
        cfg = model.config
        heads = cfg.num_attention_heads
        windows = _sliding_windows(cfg, cfg.num_hidden_layers)
        no_reuse = None
        if any(w is not None for w in windows):
            # the engine warns once, when it is built on this driver
            no_reuse = (f"{reason}; its sliding-window layers keep only the last {max(w or 0 for w in windows)} "
                        "tokens in HF's cache, so no KV is reused: plain HF generation")
        else:
            warnings.warn(f"kvboost: {reason}; falling back to exact-prefix reuse only", stacklevel=3)
        return cls(model=model, inner=None, num_layers=cfg.num_hidden_layers,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   windows=windows, rope=RopeSupport(False, "none", reason),
                   max_context=int(getattr(cfg, "max_position_embeddings", 0) or 0), layerwise=False,
                   no_reuse=no_reuse)

    @torch.inference_mode()
    def hf_prefill(self, ids: torch.Tensor, cache: ScatterCache, reused: int) -> torch.Tensor:
        """Prefix-only path: the first ``reused`` slots are placed; HF computes the rest with its own cache,
        which is kept on ``cache.hf`` for decoding and copied into the buffers so chunks can be stored."""
        from transformers import DynamicCache

        hf = DynamicCache()
        if reused:
            for layer in range(self.num_layers):
                hf.update(cache.keys[layer][:, :, :reused].clone(), cache.values[layer][:, :, :reused].clone(),
                          layer)
        out = self.model(input_ids=ids[reused:].view(1, -1), cache=hf if reused else None, use_cache=True,
                         logits_to_keep=1)
        hf = output_cache(out)
        cache.hf = hf
        if self.no_reuse:
            return out.logits[0, -1]  # nothing is stored: HF's window-sized layers need no copy
        total = ids.numel()
        for layer in range(self.num_layers):
            cache.keys[layer][:, :, :total] = hf.layers[layer].keys
            cache.values[layer][:, :, :total] = hf.layers[layer].values
        return out.logits[0, -1]

    @torch.inference_mode()
    def hf_step(self, cache: ScatterCache, token: int) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([[token]], device=self.device), cache=cache.hf, use_cache=True)
        cache.hf = output_cache(out)
        return out.logits[0, -1]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids.view(1, -1))  # (1, n, hidden); Gemma's scaling lives in the module

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.rotary_emb(hidden, position_ids=positions.view(1, -1))  # each (1, n, R)

    def run_layer(self, i: int, hidden: torch.Tensor, mask: torch.Tensor | None, cos_sin, positions: torch.Tensor,
                  cache: ScatterCache) -> torch.Tensor:
        if self.reader is not None:
            self.reader.set_rows(positions, cache.gate_from)
        out = self.inner.layers[i](hidden, attention_mask=mask, position_embeddings=cos_sin,
                                   position_ids=positions.view(1, -1), cache=cache, use_cache=True)
        return out[0] if isinstance(out, tuple) else out

    def layer_kv(self, i: int, hidden: torch.Tensor, mask: torch.Tensor | None, cos_sin, positions: torch.Tensor,
                 cache: ScatterCache) -> None:
        """Write layer ``i``'s K/V for ``positions`` into ``cache`` without running its attention or MLP.

        The layer runs as usual up to its ``cache.update`` call, which raises once the K/V are written: that
        costs the input norm and the Q/K/V projections (about 5% of a layer for a 0.5B model at 4K context),
        with no per-family code. CacheBlend's check layer needs fresh K/V for every candidate but the rest of
        the layer only for the tokens it keeps."""
        cache.kv_only = True
        try:
            self.run_layer(i, hidden, mask, cos_sin, positions, cache)
        except KVWritten:
            return
        finally:
            cache.kv_only = False
        raise RuntimeError(f"decoder layer {i} of {type(self.model).__name__} finished without calling "
                           "cache.update; its K/V cannot be computed separately")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.inner.norm(hidden)
        logits = self.model.lm_head(h)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _sliding_windows(cfg: Any, n_layers: int) -> list[int | None]:
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None:
        return [None] * n_layers
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n_layers

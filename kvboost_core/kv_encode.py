"""How a freshly computed chunk is encoded for the store (``EngineConfig.kv_bits``).

:mod:`kvboost_core.quant` is the pure-torch reference layout and imports nothing of the kernels;
:mod:`kvboost_core.kernels.ops` dispatches to the native kernel or that reference. This module sits above both,
so the imports run one way: engine -> kv_encode -> kernels.ops -> quant.
"""

from __future__ import annotations

import torch

from kvboost_core.kernels.ops import quantize_payload
from kvboost_core.quant import QuantPayload, unrotate_keys
from kvboost_core.store.base import DensePayload


def maybe_quantize(dense: DensePayload, kv_bits: int | None, group_size: int = 32, *, start: int = 0,
                   rotary_emb=None) -> DensePayload | QuantPayload:
    """``EngineConfig.kv_bits`` -> payload: None keeps the dense payload as is, 16 casts it to bf16; 8/4
    quantize, with keys un-rotated to position 0 first when ``rotary_emb`` is given (pre-RoPE storage)."""
    if kv_bits is None:
        return dense
    if kv_bits == 16:
        return DensePayload(dense.keys.to(torch.bfloat16), dense.values.to(torch.bfloat16))
    # the native kernel when built (bit-identical to quant.quantize_payload, which stays the reference)
    pre_rope = rotary_emb is not None
    if pre_rope:
        dense = DensePayload(unrotate_keys(dense.keys, start, rotary_emb), dense.values)
    return quantize_payload(dense, kv_bits, group_size, keys_pre_rope=pre_rope)

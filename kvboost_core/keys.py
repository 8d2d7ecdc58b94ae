"""Typed cache keys and the model fingerprint.

Keys are xxh3-128 digests. A *content key* names a chunk's tokens for one model in one namespace, wherever
the chunk stands; a *prefix key* chains its parent's prefix key, so it names the chunk *and everything before
it*. Both include the namespace (tenant isolation, like vLLM's ``cache_salt``), the model fingerprint and the
stored KV's precision (:func:`kv_precision`), so a different model, dtype, tokenizer or ``kv_bits`` can never
hit: an int4 entry is never served to a dense engine as its exact prefix, and engines of different precisions
share a store side by side. A key is never trusted alone: callers compare the stored token ids with the
request's on every hit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NewType

import numpy as np
import xxhash

CacheKey = NewType("CacheKey", bytes)
Fingerprint = NewType("Fingerprint", str)

_CONTENT = b"C"
_PREFIX = b"P"


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    # int64 little-endian: stable across platforms and vocabularies of any size.
    return np.asarray(token_ids, dtype="<i8").tobytes()


def kv_precision(kv_bits: int | None, group_size: int) -> str:
    """The stored KV's precision as a key component (``EngineConfig.kv_bits`` / ``kv_group_size``): "model"
    (the model's dtype, already in the fingerprint), "bf16", or "int8g32" / "int4g32" (bits and group size:
    another group size is another quantization of the same KV)."""
    if kv_bits is None:
        return "model"
    if kv_bits == 16:
        return "bf16"
    if kv_bits in (4, 8):
        return f"int{kv_bits}g{int(group_size)}"
    raise ValueError(f"kv_bits must be None, 16, 8 or 4, got {kv_bits!r}")


def _precision_field(precision: str) -> bytes:
    # length-prefixed: no precision string can shift bytes into a neighbouring field
    raw = precision.encode("utf-8")
    return b"kv:" + len(raw).to_bytes(2, "little") + raw


def root_key(namespace: str, fingerprint: Fingerprint, *, precision: str) -> CacheKey:
    """The root of every prefix chain for one (namespace, model, KV precision)."""
    h = xxhash.xxh3_128()
    h.update(b"kvboost/root\0")
    h.update(namespace.encode("utf-8") + b"\0")
    h.update(fingerprint.encode("ascii") + b"\0")
    h.update(_precision_field(precision))
    return CacheKey(h.digest())


def content_key(namespace: str, fingerprint: Fingerprint, token_ids: Sequence[int], *,
                precision: str) -> CacheKey:
    """Key of a chunk by its tokens alone (position independent), for one KV precision."""
    h = xxhash.xxh3_128()
    h.update(_CONTENT)
    h.update(namespace.encode("utf-8") + b"\0")
    h.update(fingerprint.encode("ascii") + b"\0")
    h.update(_precision_field(precision))
    h.update(_ids_bytes(token_ids))
    return CacheKey(h.digest())


def prefix_key(parent: CacheKey, token_ids: Sequence[int]) -> CacheKey:
    """Key of a chunk *and* its whole prefix: chains the parent's prefix key (the root for the first chunk)."""
    h = xxhash.xxh3_128()
    h.update(_PREFIX)
    h.update(parent)
    h.update(_ids_bytes(token_ids))
    return CacheKey(h.digest())


def _tensor_digest(h: Any, name: str, t: Any) -> None:
    # Every byte of every tensor: a sample would miss a change to an unsampled weight (a small fine-tune, a
    # patched layer) and stale KV would be served. xxh3 hashes at memory bandwidth; one tensor at a time is
    # copied to the CPU, so the peak extra memory is the largest tensor, not the model.
    import torch

    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    if t.device.type == "meta" or t.numel() == 0:  # offloaded / empty: nothing to read
        return
    flat = t.detach().reshape(-1).to("cpu").contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    h.update(memoryview(flat.view(torch.uint8).numpy()))


def model_fingerprint(model: Any, tokenizer: Any) -> Fingerprint:
    """Config + every weight and buffer byte + dtype + tokenizer, as a hex digest (computed once at load)."""
    h = xxhash.xxh3_128()
    cfg = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "_commit_hash"):
        cfg.pop(volatile, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        _tensor_digest(h, "p:" + name, p)
    for name, b in model.named_buffers():  # rotary tables, norms' running stats: they change outputs too
        _tensor_digest(h, "b:" + name, b)
    h.update(str(next(model.parameters()).dtype).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    h.update(json.dumps(getattr(tokenizer, "all_special_tokens", []), default=str).encode())
    return Fingerprint(h.hexdigest())

"""Typed cache keys and the model fingerprint.

Keys are xxh3-128 digests. A *content key* names a chunk's tokens for one model in one namespace, wherever
the chunk stands; a *prefix key* chains its parent's prefix key, so it names the chunk *and everything before
it*. Both include the namespace (tenant isolation, like vLLM's ``cache_salt``) and the model fingerprint, so a
different model, dtype or tokenizer can never hit. A key is never trusted alone: callers compare the stored
token ids with the request's on every hit.
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


def root_key(namespace: str, fingerprint: Fingerprint) -> CacheKey:
    """The root of every prefix chain for one (namespace, model)."""
    h = xxhash.xxh3_128()
    h.update(b"kvboost/root\0")
    h.update(namespace.encode("utf-8") + b"\0")
    h.update(fingerprint.encode("ascii"))
    return CacheKey(h.digest())


def content_key(namespace: str, fingerprint: Fingerprint, token_ids: Sequence[int]) -> CacheKey:
    """Key of a chunk by its tokens alone (position independent)."""
    h = xxhash.xxh3_128()
    h.update(_CONTENT)
    h.update(namespace.encode("utf-8") + b"\0")
    h.update(fingerprint.encode("ascii") + b"\0")
    h.update(_ids_bytes(token_ids))
    return CacheKey(h.digest())


def prefix_key(parent: CacheKey, token_ids: Sequence[int]) -> CacheKey:
    """Key of a chunk *and* its whole prefix: chains the parent's prefix key (the root for the first chunk)."""
    h = xxhash.xxh3_128()
    h.update(_PREFIX)
    h.update(parent)
    h.update(_ids_bytes(token_ids))
    return CacheKey(h.digest())


def _tensor_sample_digest(h: Any, t: Any) -> None:
    # Hash shape, dtype and a strided sample of the values: identifies the weights without reading all of
    # a multi-GB model. Fine-tunes change essentially every value, so a sample of 4096 catches them.
    import torch

    flat = t.detach().reshape(-1)
    h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
    n = flat.numel()
    if n == 0:
        return
    step = max(1, n // 4096)
    sample = flat[::step][:4096].to(device="cpu", dtype=torch.float32).contiguous()
    h.update(sample.numpy().tobytes())


def model_fingerprint(model: Any, tokenizer: Any) -> Fingerprint:
    """Config + weights identity + dtype + tokenizer, as a hex digest."""
    h = xxhash.xxh3_128()
    cfg = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "_commit_hash"):
        cfg.pop(volatile, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(name.encode())
        _tensor_sample_digest(h, p)
    h.update(str(next(model.parameters()).dtype).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8"))
    h.update(json.dumps(getattr(tokenizer, "all_special_tokens", []), default=str).encode())
    return Fingerprint(h.hexdigest())

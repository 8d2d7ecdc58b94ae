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

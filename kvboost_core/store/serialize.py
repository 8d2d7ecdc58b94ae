"""One block <-> safetensors bytes, shared by the disk and Redis tiers. Nothing is pickled.

Tensors: ``token_ids`` (int64, (n,)) plus either ``k``/``v`` (dense, (L, H, n, D), any dtype safetensors
holds) or the quantized ``k_codes``/``k_scale``/``k_min``/``v_codes``/``v_scale``/``v_min`` (layout in
:mod:`kvboost_core.quant`). The safetensors metadata (str -> str) carries the key, namespace, fingerprint,
kind, parent, base_position, payload type/bits/group/true sizes, the format version, and ``checksum``: an
xxh3-128 over every tensor (name, dtype, shape, bytes, in name order) and every other metadata item.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvboost_core.keys import CacheKey, Fingerprint
from kvboost_core.store.base import DensePayload, KVBlock

FORMAT_VERSION = "1"
HEADER_LIMIT = 1 << 24  # a header over 16 MiB is not one of ours


class CorruptEntry(Exception):
    """A stored entry that must not be served: truncated, checksum mismatch, foreign, or unreadable."""


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    return h.hexdigest()


def _payload_tensors(payload: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from kvboost_core.quant import QuantPayload  # lazy: quant imports store.base (import cycle)

    if isinstance(payload, QuantPayload):
        return payload.tensors(), {"payload": "quant", "bits": str(payload.bits),
                                   "group_size": str(payload.group_size), "head_dim": str(payload.head_dim),
                                   "num_tokens": str(payload.num_tokens),
                                   "keys_pre_rope": "1" if payload.keys_pre_rope else "0"}
    if not isinstance(payload, DensePayload):
        # An unknown payload type: store what it decodes to, losslessly in float32.
        payload = DensePayload(*payload.to_dense(torch.float32, "cpu"))
    return {"k": payload.keys, "v": payload.values}, {"payload": "dense",
                                                      "num_tokens": str(payload.num_tokens)}


def encode(key: CacheKey, block: KVBlock) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Block -> (cpu contiguous tensors, metadata with checksum)."""
    tensors, meta = _payload_tensors(block.payload)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    tensors["token_ids"] = torch.tensor(block.token_ids, dtype=torch.int64)
    meta.update({"format": FORMAT_VERSION, "key": key.hex(), "namespace": block.namespace,
                 "fingerprint": block.fingerprint, "kind": block.kind,
                 "parent": block.parent.hex() if block.parent is not None else "",
                 "base_position": str(block.base_position), "context_digest": block.context_digest.hex()})
    meta["checksum"] = _checksum(tensors, meta)
    return tensors, meta


def dumps(key: CacheKey, block: KVBlock) -> bytes:
    tensors, meta = encode(key, block)
    return st_save(tensors, metadata=meta)


def read_header(head: bytes) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header from the file's first bytes -> (header dict, total file size it implies).

    Raises CorruptEntry when ``head`` is too short or not a safetensors header."""
    if len(head) < 8:
        raise CorruptEntry("shorter than a safetensors header")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > HEADER_LIMIT or len(head) < 8 + hlen:
        raise CorruptEntry(f"header of {hlen} bytes is truncated or implausible")
    try:
        header = json.loads(head[8:8 + hlen])
    except ValueError as e:
        raise CorruptEntry(f"header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptEntry("header has no metadata")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    return header, 8 + hlen + end


def check_meta(meta: dict[str, str], key: CacheKey | None, fingerprint: str | None) -> None:
    """Raise CorruptEntry if the metadata is not ours, not this key's, or not this model's."""
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptEntry(f"format {meta.get('format')!r} != {FORMAT_VERSION}")
    if key is not None and meta.get("key") != key.hex():
        raise CorruptEntry("entry holds another key")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise CorruptEntry("foreign model fingerprint")


def loads(data: bytes, *, key: CacheKey | None = None, fingerprint: str | None = None) -> KVBlock:
    """Bytes -> verified block. Raises CorruptEntry for anything that must not be served."""
    header, size = read_header(data)
    if size != len(data):
        raise CorruptEntry(f"size {len(data)} != {size} declared by the header (truncated?)")
    meta = header["__metadata__"]
    check_meta(meta, key, fingerprint)
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error type for malformed data
        raise CorruptEntry(f"unreadable tensors: {e}") from e
    if _checksum(tensors, meta) != meta.get("checksum"):
        raise CorruptEntry("checksum mismatch")
    try:
        return _decode(tensors, meta)
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptEntry(f"inconsistent entry: {e}") from e


def _decode(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> KVBlock:
    payload: Any
    if meta["payload"] == "quant":
        from kvboost_core.quant import QuantPayload

        payload = QuantPayload(bits=int(meta["bits"]), group_size=int(meta["group_size"]),
                               head_dim=int(meta["head_dim"]), **{k: tensors[k] for k in (
                                   "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")},
                               keys_pre_rope=meta.get("keys_pre_rope", "0") == "1")
    elif meta["payload"] == "dense":
        payload = DensePayload(tensors["k"], tensors["v"])
    else:
        raise ValueError(f"unknown payload type {meta['payload']!r}")
    if payload.num_tokens != int(meta["num_tokens"]):
        raise ValueError("token count disagrees with the metadata")
    parent = CacheKey(bytes.fromhex(meta["parent"])) if meta["parent"] else None
    return KVBlock(token_ids=tuple(tensors["token_ids"].tolist()), payload=payload,
                   base_position=int(meta["base_position"]), fingerprint=Fingerprint(meta["fingerprint"]),
                   namespace=meta["namespace"], kind=meta["kind"], parent=parent,
                   context_digest=bytes.fromhex(meta.get("context_digest", "")))

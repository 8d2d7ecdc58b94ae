"""One block <-> safetensors bytes, shared by the disk and Redis tiers. Nothing is pickled.

Tensors: ``token_ids`` (int64, (n,)) plus either ``k``/``v`` (dense, (L, H, n, D), float) or the quantized
``k_codes``/``k_scale``/``k_min``/``v_codes``/``v_scale``/``v_min`` (layout in :mod:`kvboost_core.quant`).
The safetensors metadata (str -> str) carries the key, namespace, fingerprint, kind, parent, base_position,
context digest, payload type/bits/group/true sizes, the format version, and ``tag``: a MAC (or, without a
secret, an integrity hash) over the canonical header and the tensor bytes, see :mod:`.trust`.

:func:`parse_entry` is the one validation boundary for bytes read from disk or Redis: whatever is wrong with
them (bad JSON, wrong types, offsets out of range, wrong dtype or shape, a shape that does not fit the model's
:class:`~kvboost_core.store.base.KVGeometry`, a length mismatch, a bad tag, another key/namespace/model, an
unknown kind) it raises :class:`CorruptEntry` and nothing else. Its subclass :class:`ForeignEntry` marks an
entry that may be valid for *another* reader (a MAC this reader cannot check: no secret, or another one; an
intact unkeyed entry when this reader requires a MAC; a chunk longer than this engine's chunks): the tiers
never serve it and never delete it, so one misconfigured replica cannot wipe a shared cache.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import torch

from kvboost_core.keys import CacheKey, Fingerprint
from kvboost_core.payload import DensePayload
from kvboost_core.quant import QuantPayload
from kvboost_core.store.base import KINDS, KVBlock, KVGeometry
from kvboost_core.store.trust import entry_tag, tags_equal

FORMAT_VERSION = "2"
HEADER_LIMIT = 1 << 20  # our headers are a few hundred bytes; anything near a MiB is not one of ours

_DTYPES: dict[torch.dtype, str] = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                                   torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                                   torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_QUANT = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
_TENSORS = {"dense": frozenset({"k", "v", "token_ids"}), "quant": frozenset({*_QUANT, "token_ids"})}
_META = frozenset({"format", "key", "namespace", "fingerprint", "kind", "parent", "base_position",
                   "context_digest", "payload", "num_tokens", "tag"})
_QUANT_META = frozenset({"bits", "group_size", "head_dim", "keys_pre_rope"})
_UINT = re.compile(r"0|[1-9][0-9]{0,17}")  # int() alone would take " 5", "+5" and "5_0"
_HEX16 = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(r"(?:[0-9a-f]{32}){0,2}")  # b"", 16 or 32 bytes


class CorruptEntry(Exception):
    """A stored entry that must not be served: truncated, malformed, unauthenticated, foreign, or unreadable."""


class ForeignEntry(CorruptEntry):
    """An entry this reader must not serve but must not delete either: it may be another reader's (a MAC under
    a secret this reader does not hold, an unkeyed entry when this reader requires a MAC, a longer chunk)."""


# K+V bytes per (layer, head, token, channel), worst case over the payloads a writer produces: dense float32 is
# 8; int8 with group size 1 is 10 (codes 2, fp16 scale and min 4 each for K's and V's groups).
_MAX_ELEMENT_BYTES = 10


def entry_cap(geometry: KVGeometry) -> int:
    """The largest entry a writer for ``geometry`` produces: the size prefix, a header of at most
    HEADER_LIMIT, the K/V of ``max_tokens`` tokens in the widest payload, and the token ids."""
    per = max(_MAX_ELEMENT_BYTES, 2 * max(d.itemsize for d in geometry.dense_dtypes))
    elems = geometry.num_layers * geometry.num_kv_heads * geometry.max_tokens * geometry.head_dim
    return 8 + HEADER_LIMIT + per * elems + 8 * geometry.max_tokens


def check_geometry(header: dict[str, Any], geometry: KVGeometry) -> None:
    """The declared tensors fit the model (from the header alone: before any payload byte is read).
    CorruptEntry when they cannot be this model's; ForeignEntry for a chunk longer than this engine's."""
    ids = header.get("token_ids")
    if not isinstance(ids, dict) or len(ids["shape"]) != 1:
        raise CorruptEntry("token_ids must be one (n,) tensor")
    n = ids["shape"][0]
    if n > geometry.max_tokens:
        raise ForeignEntry(f"{n} tokens: longer than this engine's chunks ({geometry.max_tokens} at most)")
    lhn = [geometry.num_layers, geometry.num_kv_heads, n]
    d = geometry.head_dim
    names = set(header) - {"__metadata__"}
    if names == _TENSORS["dense"]:
        allowed = {_DTYPES[t] for t in geometry.dense_dtypes}
        for t in ("k", "v"):
            if header[t]["shape"] != [*lhn, d] or header[t]["dtype"] not in allowed:
                raise CorruptEntry(f"dense {t} is {header[t]['dtype']} {header[t]['shape']}; this model's KV is "
                                   f"(L, H, n, D) = {(*lhn, d)} in {sorted(allowed)}")
    elif names == _TENSORS["quant"]:
        if header["__metadata__"].get("head_dim") != str(d):
            raise CorruptEntry(f"quantized head_dim {header['__metadata__'].get('head_dim')!r}; this model's is {d}")
        for t in ("k_codes", "v_codes"):
            shape = header[t]["shape"]
            if len(shape) != 4 or shape[:3] != lhn or shape[3] not in (d, math.ceil(d / 2)):
                raise CorruptEntry(f"{t} is {shape}; this model's KV is (L, H, n, D) = {(*lhn, d)}")
    else:
        raise CorruptEntry(f"tensors {sorted(names)} are neither a dense nor a quantized payload")


def _payload_tensors(payload: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


def _canonical(header: dict[str, Any]) -> bytes:
    """The header as the tag sees it: every tensor record and every metadata item except the tag itself."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "tag"}
    return json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


def dumps(key: CacheKey, block: KVBlock, *, secret: bytes | None = None) -> bytes:
    """Block -> safetensors bytes whose ``tag`` binds ``key``, the block's namespace and fingerprint."""
    if not isinstance(block.context_digest, bytes) or len(block.context_digest) not in (0, 16, 32):
        raise ValueError(f"context_digest must be 0, 16 or 32 bytes, got {block.context_digest!r}")
    tensors, meta = _payload_tensors(block.payload)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    tensors["token_ids"] = torch.tensor(block.token_ids, dtype=torch.int64)
    meta.update({"format": FORMAT_VERSION, "key": key.hex(), "namespace": block.namespace,
                 "fingerprint": block.fingerprint, "kind": block.kind,
                 "parent": block.parent.hex() if block.parent is not None else "",
                 "base_position": str(block.base_position), "context_digest": block.context_digest.hex()})
    header: dict[str, Any] = {}
    parts: list[bytes] = []
    offset = 0
    for name in sorted(tensors):  # offsets contiguous from 0, as safetensors requires
        t = tensors[name]
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        parts.append(raw)
        offset += len(raw)
    data = b"".join(parts)
    header["__metadata__"] = meta
    meta["tag"] = entry_tag(secret, key=key, namespace=block.namespace, fingerprint=block.fingerprint,
                            header=_canonical(header), data=data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head + data


# -- reading: everything below raises CorruptEntry only (parse_entry converts the rest) -----------------------
def parse_header(head: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """Parse and structurally check a header from an entry's first bytes -> (header, total size it implies)."""
    if len(head) < 8:
        raise CorruptEntry("shorter than a safetensors header")
    (hlen,) = struct.unpack("<Q", bytes(head[:8]))
    if hlen > HEADER_LIMIT or len(head) < 8 + hlen:
        raise CorruptEntry(f"header of {hlen} bytes is truncated or implausible")
    try:
        header = json.loads(bytes(head[8:8 + hlen]))
    except ValueError as e:
        raise CorruptEntry(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptEntry("header has no str -> str metadata")
    spans = []
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data_offsets"}:
            raise CorruptEntry(f"tensor record {name!r} is malformed")
        dtype, shape, offs = rec["dtype"], rec["shape"], rec["data_offsets"]
        if dtype not in _FROM_NAME:
            raise CorruptEntry(f"tensor {name!r} has dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
            raise CorruptEntry(f"tensor {name!r} has shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int and o >= 0 for o in offs):
            raise CorruptEntry(f"tensor {name!r} has offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * _FROM_NAME[dtype].itemsize:
            raise CorruptEntry(f"tensor {name!r}: offsets {offs} do not hold {dtype} {shape}")
        spans.append((offs[0], offs[1]))
    end = 0
    for begin, stop in sorted(spans):  # the data section is exactly the tensors, back to back
        if begin != end:
            raise CorruptEntry("tensor data overlaps or leaves a gap")
        end = stop
    return header, 8 + hlen + end


def parse_entry(data: bytes | memoryview, *, key: CacheKey, namespace: str, fingerprint: str,
                secret: bytes | None, geometry: KVGeometry | None = None) -> KVBlock:
    """Bytes read from a tier -> a block fit to serve ``key`` to (``namespace``, ``fingerprint``) and, when
    given, of ``geometry``'s shape; or CorruptEntry (ForeignEntry: not this reader's to delete). No other
    exception escapes: this is the trust boundary for disk and Redis."""
    try:
        return _parse(memoryview(data), key, namespace, fingerprint, secret, geometry)
    except CorruptEntry:
        raise
    except Exception as e:  # noqa: BLE001 - any defect in untrusted bytes is a miss, never a crash
        raise CorruptEntry(f"malformed entry: {type(e).__name__}: {e}") from e


def _check_tag(tag: str, header: dict[str, Any], payload: memoryview, key: CacheKey, namespace: str,
               fingerprint: str, secret: bytes | None) -> None:
    """The entry's tag against this reader's: CorruptEntry when the entry is provably damaged or not ours,
    ForeignEntry when it may be another reader's (keyed under a secret we lack, or unkeyed and intact)."""
    def tag_for(s: bytes | None) -> str:
        return entry_tag(s, key=key, namespace=namespace, fingerprint=fingerprint, header=_canonical(header),
                         data=payload)

    if tags_equal(tag, tag_for(secret)):
        return
    scheme = tag.partition(":")[0]
    if scheme == "hmac-sha256":  # a wrong secret and a damaged entry look alike: not ours to judge
        raise ForeignEntry("MAC does not verify under this reader's secret" if secret is not None
                           else "keyed entry, and this reader has no store secret to check it")
    if scheme == "xxh3" and secret is not None:
        if tags_equal(tag, tag_for(None)):
            raise ForeignEntry("unkeyed entry (written without a store secret); this reader requires a MAC")
        raise CorruptEntry("integrity hash does not match")
    raise CorruptEntry("integrity hash does not match" if scheme == "xxh3" else f"unknown tag scheme {scheme!r}")


def _parse(data: memoryview, key: CacheKey, namespace: str, fingerprint: str, secret: bytes | None,
           geometry: KVGeometry | None) -> KVBlock:
    header, size = parse_header(data)
    if size != len(data):
        raise CorruptEntry(f"size {len(data)} != {size} declared by the header (truncated?)")
    meta: dict[str, str] = header["__metadata__"]
    check_meta(meta, key, namespace, fingerprint)
    if geometry is not None:
        check_geometry(header, geometry)
    data_start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    _check_tag(meta["tag"], header, data[data_start:], key, namespace, fingerprint, secret)
    names = _TENSORS.get(meta["payload"])
    if names is None or set(header) - {"__metadata__"} != names:
        raise CorruptEntry(f"payload {meta['payload']!r} with tensors {sorted(set(header) - {'__metadata__'})}")
    tensors = {}
    for name in names:
        rec = header[name]
        begin, stop = rec["data_offsets"]
        dtype = _FROM_NAME[rec["dtype"]]
        # own, aligned memory per tensor: the entry's buffer may be read-only or misaligned for the dtype
        raw = bytearray(data[data_start + begin:data_start + stop])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(rec["shape"])
    return _decode(tensors, meta)


def check_meta(meta: dict[str, str], key: CacheKey, namespace: str, fingerprint: str) -> None:
    """Raise CorruptEntry if the metadata is incomplete, not ours, not this key's, tenant's or model's."""
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptEntry(f"format {meta.get('format')!r} != {FORMAT_VERSION}")
    missing = _META - set(meta)
    if meta.get("payload") == "quant":
        missing |= _QUANT_META - set(meta)
    if missing:
        raise CorruptEntry(f"metadata lacks {sorted(missing)}")
    if meta["key"] != key.hex():
        raise CorruptEntry("entry holds another key")
    if meta["namespace"] != namespace:
        raise CorruptEntry("entry of another namespace")
    if meta["fingerprint"] != fingerprint:
        raise CorruptEntry("foreign model fingerprint")


def _uint(meta: dict[str, str], name: str) -> int:
    if _UINT.fullmatch(meta[name]) is None:
        raise CorruptEntry(f"{name}={meta[name]!r} is not a non-negative int")
    return int(meta[name])


def _decode(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> KVBlock:
    payload: Any
    if meta["payload"] == "quant":
        if meta["keys_pre_rope"] not in ("0", "1"):
            raise CorruptEntry(f"keys_pre_rope={meta['keys_pre_rope']!r}")
        payload = QuantPayload(bits=_uint(meta, "bits"), group_size=_uint(meta, "group_size"),
                               head_dim=_uint(meta, "head_dim"), **{k: tensors[k] for k in _QUANT},
                               keys_pre_rope=meta["keys_pre_rope"] == "1")
    else:
        k, v = tensors["k"], tensors["v"]
        if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
            raise CorruptEntry(f"dense K/V must be float, got {k.dtype} and {v.dtype}")
        payload = DensePayload(k, v)  # checks both are (L, H, n, D) of one shape
    ids = tensors["token_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise CorruptEntry(f"token_ids must be int64 (n,), got {ids.dtype} {tuple(ids.shape)}")
    if not payload.num_tokens == len(ids) == _uint(meta, "num_tokens"):
        raise CorruptEntry("token count disagrees between K/V, token ids and metadata")
    if meta["kind"] not in KINDS:
        raise CorruptEntry(f"kind {meta['kind']!r}")
    if meta["parent"] and _HEX16.fullmatch(meta["parent"]) is None:
        raise CorruptEntry(f"parent {meta['parent']!r}")
    if _DIGEST.fullmatch(meta["context_digest"]) is None:
        raise CorruptEntry("context_digest must be 0, 16 or 32 bytes of hex")
    parent = CacheKey(bytes.fromhex(meta["parent"])) if meta["parent"] else None
    return KVBlock(token_ids=tuple(ids.tolist()), payload=payload, base_position=_uint(meta, "base_position"),
                   fingerprint=Fingerprint(meta["fingerprint"]), namespace=meta["namespace"], kind=meta["kind"],
                   parent=parent, context_digest=bytes.fromhex(meta["context_digest"]))

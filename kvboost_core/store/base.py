"""What a store holds and the interface every tier implements.

A :class:`KVBlock` is the KV of one chunk: token ids, where the chunk stood when it was computed
(``base_position``, needed to re-rotate RoPE keys), and a payload that can produce dense K/V. Payloads are
an interface so that quantized storage (int8/int4) slots in without the engine knowing the layout; the interface
and the dense payload live in :mod:`kvboost_core.payload` (re-exported here), the quantized one in
:mod:`kvboost_core.quant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvboost_core.keys import CacheKey, Fingerprint
from kvboost_core.payload import DensePayload, KVPayload  # noqa: F401  (DensePayload: re-exported, its old home)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV shape every entry for one model and chunking must have. The disk and Redis tiers check each
    entry against it before serving it (a forged entry of another shape is a miss, never an error in a
    request) and derive their per-entry byte cap from it (see ``serialize.entry_cap``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int  # the longest chunk the engine stores: chunk_size + boundary_window
    dtype: torch.dtype = torch.float32  # the model's; dense entries may also be bf16 (kv_bits=16) or float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"KVGeometry.dtype must be a float dtype, got {self.dtype}")

    @classmethod
    def for_engine(cls, driver: Any, config: Any) -> KVGeometry:
        """From a ``ModelDriver`` and an ``EngineConfig``."""
        return cls(int(driver.num_layers), int(driver.num_kv_heads), int(driver.head_dim),
                   int(config.chunk_size) + int(config.boundary_window), driver.dtype)

    @property
    def dense_dtypes(self) -> frozenset[torch.dtype]:
        """What a dense entry may hold: the model's dtype, bf16 (``kv_bits=16``), float32 (other payloads)."""
        return frozenset({self.dtype, torch.bfloat16, torch.float32})


KINDS = ("content", "prefix", "repaired")
PREFIX_KINDS = ("prefix", "repaired")


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One cached chunk. ``kind`` is "content" (computed in a warm context, position independent key),
    "prefix" (computed in exactly the context named by its prefix key, reusable as is at ``base_position``) or
    "repaired" (stored under a prefix key after a repaired prefill: the same tokens and context, but KV that
    approximates a full prefill; reused as a prefix hit except when the caller asks for ``repair="full"``)."""

    token_ids: tuple[int, ...]
    payload: KVPayload
    base_position: int
    fingerprint: Fingerprint
    namespace: str
    kind: str = "content"
    parent: CacheKey | None = None  # the parent prefix key, for kind == "prefix"
    context_digest: bytes = b""  # chained digest of every token before and in this block (prefix kinds); b"" for content

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.token_ids) != self.payload.num_tokens:
            raise ValueError(f"{len(self.token_ids)} token ids but the payload holds "
                             f"{self.payload.num_tokens} tokens")

    @property
    def nbytes(self) -> int:
        # Token ids and metadata are small next to K/V, but count them so the budget is honest.
        return self.payload.nbytes + 8 * len(self.token_ids) + 128

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class KVStore(Protocol):
    """A tier, or a stack of tiers. All methods are thread-safe. ``get`` never raises for a bad or missing
    entry: it returns None (a miss). The caller verifies token ids on every hit."""

    def get(self, key: CacheKey) -> KVBlock | None: ...

    def put(self, key: CacheKey, block: KVBlock, *, pin: bool = False) -> bool: ...

    def contains(self, key: CacheKey) -> bool: ...

    def delete(self, key: CacheKey) -> bool: ...

    def children(self, parent: CacheKey) -> list[CacheKey]: ...

    def stats(self) -> dict[str, int]: ...

    def clear(self) -> None: ...

"""The payload interface and the dense payload: the stored K/V of one chunk, in some layout.

They live outside :mod:`kvboost_core.store` so that :mod:`kvboost_core.quant` (the quantized payload) can build on
them without importing the store package, whose serializer imports ``quant`` in turn: payload <- quant <-
store.serialize, one way. ``kvboost_core.store`` and ``kvboost_core.store.base`` re-export both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVPayload(Protocol):
    """Stored K/V for one chunk, in some layout. Dense K/V have shape (L, H_kv, n, D)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def to_dense(self, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class DensePayload:
    keys: torch.Tensor  # (L, H_kv, n, D)
    values: torch.Tensor  # (L, H_kv, n, D)

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"keys/values must both be (L, H, n, D), got {tuple(self.keys.shape)} "
                             f"and {tuple(self.values.shape)}")

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    def to_dense(self, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype)

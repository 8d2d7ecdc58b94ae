"""Small immutable results returned at the engine's boundary, and the engine's counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing the results (e.g. langchain_kvboost) must not load torch
    import torch


@dataclass(slots=True)
class AssembledCache:
    """The prompt's KV after assembly and repair: per-layer buffers (1, H_kv, T_max, D), valid up to ``length``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i][:, :, : self.length], self.values[i][:, :, : self.length]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    token_ids: list[int]
    last_logits: torch.Tensor  # (vocab,) fp32
    cache: AssembledCache
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    prompt_token_ids: list[int]
    ttft_s: float
    total_s: float
    reuse_ratio: float
    finish_reason: str  # "stop", "eos", "length"
    stats: dict[str, Any]
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # (vocab,) fp32: the prefill's output


@dataclass(frozen=True, slots=True)
class WarmResult:
    documents: int
    warmed: int  # documents computed now and stored whole
    already_warm: int  # documents whose chunks were all present: cost a lookup
    chunks: int  # chunks stored now
    tokens: int  # tokens of the documents counted in ``warmed``
    bytes: int
    seconds: float
    doc_token_ids: list[list[int]] = field(default_factory=list)
    not_stored: int = 0  # documents computed but not (wholly) stored: the budget held nothing it could evict


class Counters:
    """Thread-safe token counters for ``KVEngine.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # hits_repaired: prefix tokens served from earlier repaired (approximate) prefills, never counted exact
        self._c = {"hits_exact": 0, "hits_repaired": 0, "hits_content": 0, "misses": 0, "prefills": 0,
                   "warmed_tokens": 0}

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._c[k] = self._c.get(k, 0) + int(v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

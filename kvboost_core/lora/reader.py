"""A reader adapter: low-rank weights that only the tokens reading re-placed document KV run through.

Documents are warmed in isolation, so their KV lacks the cross-document attention a full prefill would give
them. CacheBlend repairs that by recomputing some document tokens; a reader adapter instead teaches the tokens
that *read* the documents (the prompt's tail after the last re-placed document, and every generated token) to
read isolated KV the way the base model reads a full prefill (Block-Attention, KVLink: a model fine-tuned to
attend over independently encoded blocks matches full attention). It is trained by distillation against the
base model's full prefill (``kvboost-rag adapt``).

The adapter is gated per token: positions before the gate run the base weights, so the exact prefix, the
documents' stored KV and any repaired document token stay the base model's. With no re-placed KV left in a
prompt (exact hits, or ``repair="full"``) the gate is closed and generation is exactly the base model's.

Why not peft: peft switches an adapter per forward call, while one forward here mixes gated and ungated
positions (CacheBlend recomputes document tokens with base weights in the same pass as the tail).

Files (:mod:`kvboost_core.lora.lora_file`): ``reader.safetensors`` (the A/B matrices, float32) and ``reader.json``
(rank, alpha, targets, the base model's fingerprint, training figures). Loading checks the fingerprint: an
adapter never runs on another base model.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvboost_core.lora import lora_file
from kvboost_core.lora.lora_file import TARGETS, LoraFiles, LoraHeader

FILES = LoraFiles("reader_adapter", "reader.safetensors", "reader.json", "kvboost-rag adapt")
WEIGHTS, META = FILES.weights, FILES.meta


class _Gate(threading.local):
    """Which rows of the current forward run the adapter: None (none), True (all) or a (1, n, 1) mask.
    Thread-local: concurrent requests on one engine each set their own."""

    mask: torch.Tensor | bool | None = None


class GatedLoRA(nn.Module):
    """``base(x) + scale * (x A^T) B^T`` on the gated rows of ``x`` (1, n, in); B starts at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gate: _Gate) -> None:
        super().__init__()
        self.base = base
        self.gate = gate
        self.scale = alpha / rank
        p = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=torch.float32, device=p.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32, device=p.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.gate.mask
        if mask is None or mask is False:
            return y
        delta = (x.float() @ self.lora_a.t()) @ self.lora_b.t() * self.scale  # (1, n, out)
        if mask is not True:
            delta = delta * mask
        return y + delta.to(y.dtype)


@dataclass(slots=True)
class ReaderMeta:
    """``reader.json``: the LoRA header (rank, alpha, targets, base model) and how the adapter was trained."""

    header: LoraHeader
    trained: dict[str, Any] = field(default_factory=dict)  # how it was trained and what it measured

    rank = property(lambda self: self.header.rank)
    alpha = property(lambda self: self.header.alpha)
    targets = property(lambda self: self.header.targets)
    base_fingerprint = property(lambda self: self.header.base_fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {**self.header.to_json(), "trained": self.trained}

    @classmethod
    def from_json(cls, raw: Any) -> ReaderMeta:
        return cls(LoraHeader.from_json(raw), dict(raw.get("trained", {})))


class ReaderAdapter:
    """Gated LoRA modules attached in place to a causal LM's decoder layers."""

    def __init__(self, model: Any, meta: ReaderMeta) -> None:
        if meta.rank < 1:
            raise ValueError(f"rank must be >= 1, got {meta.rank}")
        self.meta = meta
        self.gate = _Gate()
        self.modules: dict[str, GatedLoRA] = {}
        layers = model.model.layers
        for key, base in lora_file.target_linears(model, meta.targets, unwrap=False).items():
            _, i, kind, name = key.split(".")
            mod = GatedLoRA(base, meta.rank, meta.alpha, self.gate)
            setattr(getattr(layers[int(i)], kind), name, mod)
            self.modules[key] = mod
        if not self.modules:
            raise ValueError(f"none of the target projections {meta.targets} found in {type(model).__name__}")

    # ------------------------------------------------------------------ gating
    @contextmanager
    def gated(self, mask: torch.Tensor | bool | None) -> Iterator[None]:
        """Run the adapter on ``mask``'s rows (True: all, None/False: none) inside the block."""
        prev = self.gate.mask
        self.gate.mask = mask
        try:
            yield
        finally:
            self.gate.mask = prev

    def set_rows(self, positions: torch.Tensor, gate_from: int | None) -> None:
        """Open the gate for the rows whose position is >= ``gate_from`` (None: closed)."""
        if gate_from is None:
            self.gate.mask = None
            return
        on = positions >= gate_from  # (n,)
        if bool(on.all()):
            self.gate.mask = True
        elif not bool(on.any()):
            self.gate.mask = None
        else:
            self.gate.mask = on.view(1, -1, 1).to(torch.float32)

    # ------------------------------------------------------------------ parameters and files
    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules.values() for p in (m.lora_a, m.lora_b)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, m in self.modules.items():
            out[f"{name}.lora_a"] = m.lora_a.detach().cpu().contiguous()
            out[f"{name}.lora_b"] = m.lora_b.detach().cpu().contiguous()
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        lora_file.check_names(FILES, set(tensors), set(self.modules))
        for name, m in self.modules.items():
            for part in lora_file.PARTS:
                t = tensors[f"{name}.{part}"]
                p = getattr(m, part)
                if t.shape != p.shape or not torch.isfinite(t).all():
                    raise ValueError(f"reader adapter tensor {name}.{part} has shape {tuple(t.shape)} or non-finite "
                                     f"values; expected {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(t)

    def save(self, directory: str) -> None:
        lora_file.write(FILES, directory, self.state_dict(), self.meta.to_json())

    @classmethod
    def attach(cls, model: Any, *, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = TARGETS,
               base_fingerprint: str = "") -> ReaderAdapter:
        """New (untrained: B = 0, so the model is unchanged until trained) adapter on ``model``."""
        return cls(model, ReaderMeta(LoraHeader(int(rank), float(alpha), tuple(targets), base_fingerprint)))

    @classmethod
    def load(cls, model: Any, directory: str, base_fingerprint: str) -> ReaderAdapter:
        """Attach the adapter saved in ``directory``; refuse one trained on another base model."""
        meta = lora_file.read_meta(FILES, directory, ReaderMeta.from_json)
        lora_file.check_base(FILES, directory, meta.base_fingerprint, base_fingerprint)
        tensors = lora_file.read_weights(FILES, directory)
        adapter = cls(model, meta)
        adapter.load_state_dict(tensors)
        return adapter

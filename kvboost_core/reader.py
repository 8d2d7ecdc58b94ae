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

Files: ``reader.safetensors`` (the A/B matrices) and ``reader.json`` (rank, alpha, targets, the base model's
fingerprint, training figures). Loading checks the fingerprint: an adapter never runs on another base model.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = "reader.safetensors"
META = "reader.json"


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
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_fingerprint: str
    trained: dict[str, Any] = field(default_factory=dict)  # how it was trained and what it measured


class ReaderAdapter:
    """Gated LoRA modules attached in place to a causal LM's decoder layers."""

    def __init__(self, model: Any, meta: ReaderMeta) -> None:
        if meta.rank < 1:
            raise ValueError(f"rank must be >= 1, got {meta.rank}")
        self.meta = meta
        self.gate = _Gate()
        self.modules: dict[str, GatedLoRA] = {}
        layers = model.model.layers
        for i, layer in enumerate(layers):
            for parent in (layer.self_attn, layer.mlp):
                for name in meta.targets:
                    base = getattr(parent, name, None)
                    if isinstance(base, nn.Linear):
                        mod = GatedLoRA(base, meta.rank, meta.alpha, self.gate)
                        setattr(parent, name, mod)
                        kind = "self_attn" if parent is layer.self_attn else "mlp"
                        self.modules[f"layers.{i}.{kind}.{name}"] = mod
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
        expected = set(self.state_dict())
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"reader adapter weights do not match the model: missing {missing}, unexpected {extra}")
        for name, m in self.modules.items():
            for part in ("lora_a", "lora_b"):
                t = tensors[f"{name}.{part}"]
                p = getattr(m, part)
                if t.shape != p.shape or not torch.isfinite(t).all():
                    raise ValueError(f"reader adapter tensor {name}.{part} has shape {tuple(t.shape)} or non-finite "
                                     f"values; expected {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(t)

    def save(self, directory: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{WEIGHTS}.tmp")
        save_file(self.state_dict(), tmp)
        os.replace(tmp, os.path.join(directory, WEIGHTS))
        meta = asdict(self.meta)
        meta["targets"] = list(self.meta.targets)
        with open(os.path.join(directory, META + ".tmp"), "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(os.path.join(directory, META + ".tmp"), os.path.join(directory, META))

    @classmethod
    def attach(cls, model: Any, *, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = TARGETS,
               base_fingerprint: str = "") -> ReaderAdapter:
        """New (untrained: B = 0, so the model is unchanged until trained) adapter on ``model``."""
        return cls(model, ReaderMeta(int(rank), float(alpha), tuple(targets), base_fingerprint))

    @classmethod
    def load(cls, model: Any, directory: str, base_fingerprint: str) -> ReaderAdapter:
        """Attach the adapter saved in ``directory``; refuse one trained on another base model."""
        from safetensors.torch import load_file

        meta_path, weights = os.path.join(directory, META), os.path.join(directory, WEIGHTS)
        if not (os.path.isfile(meta_path) and os.path.isfile(weights)):
            raise ValueError(f"reader_adapter: {directory!r} holds no {META} + {WEIGHTS} "
                             "(train one with `kvboost-rag adapt`)")
        try:
            with open(meta_path) as f:
                raw = json.load(f)
            meta = ReaderMeta(int(raw["rank"]), float(raw["alpha"]), tuple(raw["targets"]),
                              str(raw["base_fingerprint"]), dict(raw.get("trained", {})))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"reader_adapter: {meta_path} is not a valid reader adapter description ({e})") from e
        if meta.base_fingerprint != base_fingerprint:
            raise ValueError(f"reader_adapter: {directory!r} was trained on another base model (fingerprint "
                             f"{meta.base_fingerprint[:16]}..., this model {base_fingerprint[:16]}...)")
        adapter = cls(model, meta)
        adapter.load_state_dict(load_file(weights))
        return adapter

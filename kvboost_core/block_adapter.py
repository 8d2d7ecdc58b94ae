"""A block adapter: LoRA weights that make re-placed document KV the model's own prefill.

A model fine-tuned for block attention (Block-Attention, TurboRAG, KVLink) expects documents encoded on their
own and then re-placed; serving their stored KV at ``repair="none"`` is then not an approximation of that
model's prefill, it *is* that prefill (:mod:`kvboost_core.block_prefill` builds it with plain HF calls). Unlike
the reader adapter (:mod:`kvboost_core.reader`), which keeps the documents' KV on the base weights and only
compensates in the tokens that read them, a block adapter runs on every token, documents included: it is
merged into the weights at load, so warming, serving and decoding all run the adapted model at the base
model's speed.

The adapted model is a different model: its cache entries are keyed by a fingerprint derived from the base
model's and the adapter's (:func:`adapted_fingerprint`), so base and adapted entries never mix. The base
weights are kept (``base_weights()``) so accuracy can still be compared with the base model's full prefill.

Files: ``block.safetensors`` (the LoRA A/B matrices, fp16) and ``block.json`` (rank, alpha, targets, the base
model's fingerprint, the warm lead-in it was trained behind, training figures). Loading refuses an adapter of
another base model or of another lead-in.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import xxhash
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = "block.safetensors"
META = "block.json"


@dataclass(slots=True)
class BlockMeta:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_fingerprint: str
    warm_prefix: tuple[int, ...]  # the lead-in documents were encoded behind in training
    sink_tokens: int = 32  # the engine's lookup rule it was trained on (block_prefill.block_runs)
    trained: dict[str, Any] = field(default_factory=dict)  # how it was trained and what it measured

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"], out["warm_prefix"] = list(self.targets), list(self.warm_prefix)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BlockMeta:
        return cls(int(raw["rank"]), float(raw["alpha"]), tuple(str(t) for t in raw["targets"]),
                   str(raw["base_fingerprint"]), tuple(int(t) for t in raw["warm_prefix"]),
                   int(raw.get("sink_tokens", 32)), dict(raw.get("trained", {})))


def adapted_fingerprint(base: str, adapter: str) -> str:
    """The cache fingerprint of base model + adapter: never equal to the base model's own."""
    return xxhash.xxh3_128(f"block-adapter:{base}:{adapter}".encode()).hexdigest()


def target_linears(model: Any, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """``layers.{i}.{self_attn|mlp}.{name}`` -> the decoder's projection (a GatedLoRA's ``base`` when one is
    attached, so names are stable during training)."""
    out: dict[str, nn.Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for kind in ("self_attn", "mlp"):
            parent = getattr(layer, kind)
            for name in targets:
                mod = getattr(parent, name, None)
                mod = getattr(mod, "base", mod)
                if isinstance(mod, nn.Linear):
                    out[f"layers.{i}.{kind}.{name}"] = mod
    return out


def save(directory: str, tensors: dict[str, torch.Tensor], meta: BlockMeta) -> str:
    """Write ``block.safetensors`` (fp16) and ``block.json`` atomically; returns the adapter's fingerprint."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    half = {name: t.detach().to(torch.float16).cpu().contiguous() for name, t in sorted(tensors.items())}
    if not all(torch.isfinite(t).all() for t in half.values()):
        raise ValueError("block adapter weights overflow fp16 (non-finite after conversion)")
    tmp = os.path.join(directory, f".{WEIGHTS}.tmp")
    save_file(half, tmp)
    os.chmod(tmp, 0o644)  # a shipped file: readable like the package around it
    os.replace(tmp, os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, META + ".tmp"), "w") as f:
        json.dump(meta.to_json(), f, indent=1)
    os.replace(os.path.join(directory, META + ".tmp"), os.path.join(directory, META))
    return file_fingerprint(directory)


def file_fingerprint(directory: str) -> str:
    h = xxhash.xxh3_128()
    for name in (META, WEIGHTS):
        with open(os.path.join(directory, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class BlockAdapter:
    """A block adapter merged into a model's weights (the base weights kept aside)."""

    def __init__(self, model: Any, meta: BlockMeta, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
        self.meta = meta
        self.fingerprint = fingerprint
        self.model = model
        self._lock = threading.Lock()
        linears = target_linears(model, meta.targets)
        expected = {f"{n}.{p}" for n in linears for p in ("lora_a", "lora_b")}
        if not linears or set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"block adapter weights do not match the model: missing {missing}, unexpected {extra}")
        scale = meta.alpha / meta.rank
        self._base: dict[str, torch.Tensor] = {}
        for name, lin in linears.items():
            a, b = tensors[f"{name}.lora_a"].float(), tensors[f"{name}.lora_b"].float()
            w = lin.weight
            if a.shape != (meta.rank, lin.in_features) or b.shape != (lin.out_features, meta.rank):
                raise ValueError(f"block adapter tensor {name} has shapes {tuple(a.shape)}/{tuple(b.shape)}; "
                                 f"expected ({meta.rank}, {lin.in_features})/({lin.out_features}, {meta.rank})")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(f"block adapter tensor {name} has non-finite values")
            delta = (b @ a).mul_(scale).to(device=w.device)  # (out, in)
            self._base[name] = w.detach().clone()
            merged = (w.detach().float() + delta).to(w.dtype)
            with torch.no_grad():
                w.copy_(merged)
        self._linears = linears

    @contextmanager
    def base_weights(self) -> Iterator[None]:
        """Run the base model inside the block (the reference accuracy is compared against). Not while the
        engine serves other requests: the weights are swapped in place."""
        with self._lock:
            saved = {n: lin.weight.detach().clone() for n, lin in self._linears.items()}
            try:
                with torch.no_grad():
                    for n, lin in self._linears.items():
                        lin.weight.copy_(self._base[n])
                yield
            finally:
                with torch.no_grad():
                    for n, lin in self._linears.items():
                        lin.weight.copy_(saved[n])

    @classmethod
    def load(cls, model: Any, directory: str, base_fingerprint: str, warm_prefix: Sequence[int]) -> BlockAdapter:
        """Merge the adapter saved in ``directory`` into ``model``; refuse one of another base model or lead-in."""
        from safetensors.torch import load_file

        meta_path, weights = os.path.join(directory, META), os.path.join(directory, WEIGHTS)
        if not (os.path.isfile(meta_path) and os.path.isfile(weights)):
            raise ValueError(f"block_adapter: {directory!r} holds no {META} + {WEIGHTS} "
                             "(train one with `kvboost-rag adapt --block`)")
        try:
            with open(meta_path) as f:
                meta = BlockMeta.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"block_adapter: {meta_path} is not a valid block adapter description ({e})") from e
        if meta.rank < 1 or not meta.alpha > 0:
            raise ValueError(f"block_adapter: rank must be >= 1 and alpha > 0, got {meta.rank}/{meta.alpha}")
        if meta.base_fingerprint != base_fingerprint:
            raise ValueError(f"block_adapter: {directory!r} was trained on another base model (fingerprint "
                             f"{meta.base_fingerprint[:16]}..., this model {base_fingerprint[:16]}...)")
        if tuple(warm_prefix) != meta.warm_prefix:
            raise ValueError(f"block_adapter: {directory!r} was trained with documents behind the lead-in "
                             f"{list(meta.warm_prefix)[:8]}..., this engine warms behind {list(warm_prefix)[:8]}...; "
                             "use the warm_prefix it was trained with")
        if os.path.isfile(os.path.join(directory, "links.safetensors")):
            raise ValueError(f"block_adapter: {directory!r} has link slots (links.safetensors), which the engine "
                             "cannot serve yet; measure it with `kvboost-rag adapt --block --eval-only --init DIR`")
        try:
            tensors = load_file(weights)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"block_adapter: {weights} is not a readable safetensors file ({e})") from e
        return cls(model, meta, tensors, file_fingerprint(directory))

"""A block adapter: LoRA weights that make re-placed document KV the model's own prefill.

A model fine-tuned for block attention (Block-Attention, TurboRAG, KVLink) expects documents encoded on their
own and then re-placed; serving their stored KV at ``repair="none"`` is then not an approximation of that
model's prefill, it *is* that prefill (:mod:`kvboost_core.lora.block_prefill` builds it with plain HF calls). Unlike
the reader adapter (:mod:`kvboost_core.lora.reader`), which keeps the documents' KV on the base weights and only
compensates in the tokens that read them, a block adapter runs on every token, documents included: it is
merged into the weights at load, so warming, serving and decoding all run the adapted model at the base
model's speed.

The adapted model is a different model: its cache entries are keyed by a fingerprint derived from the base
model's and the adapter's (:func:`adapted_fingerprint`), so base and adapted entries never mix. The base
weights are kept (``base_weights()``) so accuracy can still be compared with the base model's full prefill.

Files (:mod:`kvboost_core.lora.lora_file`): ``block.safetensors`` (the LoRA A/B matrices, fp16) and ``block.json``
(rank, alpha, targets, the base model's fingerprint, the warm lead-in it was trained behind, training figures).
Loading refuses an adapter of another base model or of another lead-in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvboost_core.lora import lora_file
from kvboost_core.lora.block_links import LINKS_FILE
from kvboost_core.lora.lora_file import TARGETS, LoraFiles, LoraHeader, target_linears  # noqa: F401  (re-exported)

FILES = LoraFiles("block_adapter", "block.safetensors", "block.json", "kvboost-rag adapt --block")
WEIGHTS, META = FILES.weights, FILES.meta


@dataclass(slots=True)
class BlockMeta:
    """``block.json``: the LoRA header (rank, alpha, targets, base model), the serving conditions it was trained
    under, and how it was trained."""

    header: LoraHeader
    warm_prefix: tuple[int, ...]  # the lead-in documents were encoded behind in training
    sink_tokens: int = 32  # the engine's lookup rule it was trained on (block_prefill.block_runs)
    trained: dict[str, Any] = field(default_factory=dict)  # how it was trained and what it measured

    rank = property(lambda self: self.header.rank)
    alpha = property(lambda self: self.header.alpha)
    targets = property(lambda self: self.header.targets)
    base_fingerprint = property(lambda self: self.header.base_fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {**self.header.to_json(), "warm_prefix": list(self.warm_prefix), "sink_tokens": self.sink_tokens,
                "trained": self.trained}

    @classmethod
    def from_json(cls, raw: Any) -> BlockMeta:
        return cls(LoraHeader.from_json(raw), tuple(int(t) for t in raw["warm_prefix"]),
                   int(raw.get("sink_tokens", 32)), dict(raw.get("trained", {})))


def adapted_fingerprint(base: str, adapter: str) -> str:
    """The cache fingerprint of base model + adapter: never equal to the base model's own."""
    return xxhash.xxh3_128(f"block-adapter:{base}:{adapter}".encode()).hexdigest()


def save(directory: str, tensors: dict[str, torch.Tensor], meta: BlockMeta) -> str:
    """Write ``block.safetensors`` (fp16) and ``block.json`` atomically; returns the adapter's fingerprint."""
    half = {name: t.detach().to(torch.float16).cpu().contiguous() for name, t in sorted(tensors.items())}
    if not all(torch.isfinite(t).all() for t in half.values()):
        raise ValueError("block adapter weights overflow fp16 (non-finite after conversion)")
    lora_file.write(FILES, directory, half, meta.to_json())
    return file_fingerprint(directory)


def file_fingerprint(directory: str) -> str:
    """The fingerprint of the adapter saved in ``directory`` (its files' bytes: :func:`lora_file.fingerprint`)."""
    return lora_file.fingerprint(FILES, directory)


def read_meta(directory: str, base_fingerprint: str, warm_prefix: Sequence[int]) -> BlockMeta:
    """``block.json`` of the adapter in ``directory``, refused when it was trained on another base model or behind
    another lead-in (what serving and a warm start of training both require)."""
    meta = lora_file.read_meta(FILES, directory, BlockMeta.from_json)
    lora_file.check_base(FILES, directory, meta.base_fingerprint, base_fingerprint)
    if tuple(warm_prefix) != meta.warm_prefix:
        raise ValueError(f"block_adapter: {directory!r} was trained with documents behind the lead-in "
                         f"{list(meta.warm_prefix)[:8]}..., this engine warms behind {list(warm_prefix)[:8]}...; "
                         "use the warm_prefix it was trained with")
    return meta


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """The LoRA tensors of the adapter in ``directory`` (names checked against its metadata when merged)."""
    return lora_file.read_weights(FILES, directory)


class BlockAdapter:
    """A block adapter merged into a model's weights (the base weights kept aside)."""

    def __init__(self, model: Any, meta: BlockMeta, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
        self.meta = meta
        self.fingerprint = fingerprint
        self.model = model
        self._lock = threading.Lock()
        linears = target_linears(model, meta.targets)
        lora_file.check_names(FILES, set(tensors), set(linears))
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
        from kvboost_core.model.weights import precision

        if precision(self.model) != "fp32":  # the merged fp32 layers were replaced: swapping them would do nothing
            raise ValueError("the base model inside a block adapter swaps fp32 weights in place; this engine holds "
                             f"them packed (weights={precision(self.model)!r}): build one with weights='fp32'")
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
        meta = read_meta(directory, base_fingerprint, warm_prefix)
        if os.path.isfile(os.path.join(directory, LINKS_FILE)):  # a link-slot table (block_links): not servable yet
            raise ValueError(f"block_adapter: {directory!r} has link slots ({LINKS_FILE}), which the engine "
                             "cannot serve yet; measure it with `kvboost-rag adapt --block --eval-only --init DIR`")
        return cls(model, meta, read_weights(directory), file_fingerprint(directory))

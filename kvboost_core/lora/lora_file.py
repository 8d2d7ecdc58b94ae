"""The LoRA adapter files the reader adapter (:mod:`kvboost_core.lora.reader`) and the block adapter
(:mod:`kvboost_core.lora.block_adapter`) share.

An adapter is a directory with two files of one kind's names (:class:`LoraFiles`):

- ``<kind>.safetensors``: for every target projection ``layers.{i}.{self_attn|mlp}.{name}``
  (:func:`target_linears`) its ``.lora_a`` (rank, in) and ``.lora_b`` (out, rank) matrices;
- ``<kind>.json``: a JSON object with ``rank``, ``alpha`` (the update is ``alpha / rank * B A``), ``targets``,
  ``base_fingerprint`` (the base model it was trained on: :class:`LoraHeader`), what the kind adds, and
  ``trained`` (how it was trained and what it measured).

Both are written atomically; reading names the argument that loads the adapter in every error (no files, a
description that does not parse, another base model, an unreadable weights file, weights of another shape).
:func:`fingerprint` hashes the two files' bytes (the description first): a block adapter's cache entries are keyed
by it, so it must never change for the same files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import xxhash
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARTS = ("lora_a", "lora_b")
M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class LoraFiles:
    """One adapter kind's two file names, and how its errors name it."""

    option: str  # the engine argument that loads this kind ("reader_adapter"): every error starts with it
    weights: str  # "reader.safetensors"
    meta: str  # "reader.json"
    command: str  # the command that trains one, named when a directory holds none

    def __post_init__(self) -> None:
        for name, suffix in (("option", ""), ("weights", ".safetensors"), ("meta", ".json"), ("command", "")):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.endswith(suffix) or len(value) <= len(suffix) \
                    or os.sep in value:
                raise ValueError(f"LoraFiles.{name} must be a file-safe name ending in {suffix!r}, got {value!r}")

    @property
    def what(self) -> str:
        """The kind in words: "reader adapter"."""
        return self.option.replace("_", " ")


@dataclass(frozen=True, slots=True)
class LoraHeader:
    """The fields every adapter description holds."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_fingerprint: str

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if not (isinstance(self.alpha, float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be a number > 0, got {self.alpha!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"targets must be projection names, got {self.targets!r}")
        if not isinstance(self.base_fingerprint, str):
            raise ValueError(f"base_fingerprint must be a str, got {self.base_fingerprint!r}")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "base_fingerprint": self.base_fingerprint}

    @classmethod
    def from_json(cls, raw: Any) -> LoraHeader:
        """The common fields of a parsed description; KeyError, TypeError or ValueError when it has none."""
        if not isinstance(raw, dict):
            raise TypeError(f"a description is a JSON object, got {type(raw).__name__}")
        if not isinstance(raw["targets"], list):
            raise TypeError(f"targets must be a list, got {raw['targets']!r}")
        return cls(int(raw["rank"]), float(raw["alpha"]), tuple(str(t) for t in raw["targets"]),
                   str(raw["base_fingerprint"]))


def target_linears(model: Any, targets: tuple[str, ...] | list[str], *, unwrap: bool = True) -> dict[str, nn.Linear]:
    """``layers.{i}.{self_attn|mlp}.{name}`` -> the decoder's projection, the names an adapter's tensors carry.
    ``unwrap``: a projection an adapter already wraps counts as its ``base`` (names stay stable in training);
    else it is left out."""
    out: dict[str, nn.Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for kind in ("self_attn", "mlp"):
            parent = getattr(layer, kind)
            for name in targets:
                mod = getattr(parent, name, None)
                if unwrap:
                    mod = getattr(mod, "base", mod)
                if isinstance(mod, nn.Linear):
                    out[f"layers.{i}.{kind}.{name}"] = mod
    return out


def check_names(files: LoraFiles, tensors: Set[str], modules: Set[str]) -> None:
    """Refuse weights whose tensor names are not exactly ``modules``' A and B matrices."""
    expected = {f"{m}.{p}" for m in modules for p in PARTS}
    if not modules or set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ValueError(f"{files.what} weights do not match the model: missing {missing}, unexpected {extra}")


def write(files: LoraFiles, directory: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write the weights (as given: contiguous CPU tensors) and the description, each atomically."""
    from safetensors.torch import save_file

    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict (the JSON description), got {type(meta).__name__}")
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{files.weights}.tmp")
    save_file(tensors, tmp)
    os.chmod(tmp, 0o644)  # a shipped file: readable like the package around it
    os.replace(tmp, os.path.join(directory, files.weights))
    tmp = os.path.join(directory, files.meta + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(directory, files.meta))


def read_meta(files: LoraFiles, directory: str, parse: Callable[[Any], M]) -> M:
    """``parse`` of the description in ``directory``; a clear ValueError when either file is missing or the
    description does not parse."""
    path = os.path.join(directory, files.meta)
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(directory, files.weights))):
        raise ValueError(f"{files.option}: {directory!r} holds no {files.meta} + {files.weights} "
                         f"(train one with `{files.command}`)")
    try:
        with open(path) as f:
            return parse(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{files.option}: {path} is not a valid {files.what} description ({e})") from e


def check_base(files: LoraFiles, directory: str, trained_on: str, base_fingerprint: str) -> None:
    """Refuse an adapter trained on another base model."""
    if trained_on != base_fingerprint:
        raise ValueError(f"{files.option}: {directory!r} was trained on another base model (fingerprint "
                         f"{trained_on[:16]}..., this model {base_fingerprint[:16]}...)")


def read_weights(files: LoraFiles, directory: str) -> dict[str, torch.Tensor]:
    """The A/B matrices; a clear ValueError when the file is not a readable safetensors file."""
    from safetensors.torch import load_file

    path = os.path.join(directory, files.weights)
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        raise ValueError(f"{files.option}: {path} is not a readable safetensors file ({e})") from e


def fingerprint(files: LoraFiles, directory: str) -> str:
    """xxh3-128 of the description's bytes, then the weights' bytes (hex)."""
    h = xxhash.xxh3_128()
    for name in (files.meta, files.weights):
        with open(os.path.join(directory, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()

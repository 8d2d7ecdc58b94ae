"""The LoRA adapter files (kvboost_core.lora.lora_file) the reader and block adapters share: the shipped adapters load
unchanged, their fingerprints (which key the adapted model's cache entries) stay bit-identical, and bad files
are refused with errors that say what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvboost_core import zoo
from kvboost_core.lora import lora_file
from kvboost_core.lora.block_adapter import (
    FILES,
    BlockAdapter,
    BlockMeta,
    adapted_fingerprint,
    file_fingerprint,
    save,
)
from kvboost_core.lora.lora_file import LoraFiles, LoraHeader

# zoo name -> (the shipped adapter's file fingerprint, the adapted model's cache fingerprint). A change here
# orphans every cache entry users warmed with the shipped adapter: only a new adapter may change it.
# the adapter of issue #32's final test (scale_b_gpu) since 2026-12-04; the first one (recipe a) was
# ("b15af5769b1ce911c7d55a3147dda7ed", "8be7f5f36de4feaac4cf89a602e276a7")
PINNED = {"smollm2-135m-instruct": ("1aacddb20d9db9074158029be4ff5ace", "d9e0360fdfb68d3783fc1c5f0c1cc28d")}
SHIPPED = [m for m in zoo.MODELS.values() if m.block_adapter]


def _meta_model(spec: zoo.ZooModel):
    """A model of the zoo entry's shape on the meta device: shapes without weights, so loading is checked without
    the real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch, layers, hidden, vocab = spec.shape
    assert arch == "llama" and (layers, hidden) == (30, 576), "a new shipped shape: extend this helper"
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=vocab)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_every_shipped_adapter_is_pinned():
    assert SHIPPED and sorted(m.name for m in SHIPPED) == sorted(PINNED)


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda m: m.name)
def test_shipped_adapters_load_with_their_pinned_fingerprints(spec):
    path = zoo.shipped_block_adapter(spec.name)
    fp, adapted = PINNED[spec.name]
    assert file_fingerprint(path) == fp
    base = spec.fingerprints[0]
    assert adapted_fingerprint(base, fp) == adapted
    meta = lora_file.read_meta(FILES, path, BlockMeta.from_json)
    block = BlockAdapter.load(_meta_model(spec), path, base, meta.warm_prefix)
    assert block.fingerprint == fp and block.meta == meta and len(block._linears) == spec.shape[1] * 7


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda m: m.name)
def test_saving_a_shipped_adapter_again_writes_the_same_bytes(spec, tmp_path):
    """The writer is the one that wrote the shipped files: the same weights and description give the same
    fingerprint (with this safetensors version)."""
    path = zoo.shipped_block_adapter(spec.name)
    meta = lora_file.read_meta(FILES, path, BlockMeta.from_json)
    assert save(str(tmp_path), lora_file.read_weights(FILES, path), meta) == PINNED[spec.name][0]


@pytest.fixture
def shipped_copy(tmp_path):
    spec = SHIPPED[0]
    out = tmp_path / "copy"
    shutil.copytree(zoo.shipped_block_adapter(spec.name), out)
    return spec, str(out)


def test_block_adapter_files_are_refused_with_clear_errors(shipped_copy):
    spec, path = shipped_copy
    base, lead = spec.fingerprints[0], (2,)
    with pytest.raises(ValueError, match="block_adapter: .* was trained on another base model"):
        BlockAdapter.load(_meta_model(spec), path, "0" * 32, lead)
    shutil.copy(f"{path}/block.safetensors", f"{path}/links.safetensors")
    with pytest.raises(ValueError, match=r"has link slots \(links.safetensors\)"):
        BlockAdapter.load(_meta_model(spec), path, base, lead)
    os.remove(f"{path}/links.safetensors")
    with open(f"{path}/block.safetensors", "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(ValueError, match="block.safetensors is not a readable safetensors file"):
        BlockAdapter.load(_meta_model(spec), path, base, lead)
    raw = json.load(open(f"{path}/block.json"))
    for broken, why in (({**raw, "alpha": 0}, "alpha must be"), ({**raw, "rank": 0}, "rank must be"),
                        ({**raw, "targets": "q_proj"}, "targets must be a list"), ([raw], "JSON object")):
        json.dump(broken, open(f"{path}/block.json", "w"))
        with pytest.raises(ValueError, match=f"not a valid block adapter description .*{why}"):
            BlockAdapter.load(_meta_model(spec), path, base, lead)


def test_file_names_and_header_are_checked():
    with pytest.raises(ValueError, match="LoraFiles.weights"):
        LoraFiles("x_adapter", "x.bin", "x.json", "train")
    with pytest.raises(ValueError, match="LoraFiles.meta"):
        LoraFiles("x_adapter", "x.safetensors", "../x.json", "train")
    with pytest.raises(ValueError, match="rank"):
        LoraHeader(True, 1.0, ("q_proj",), "")
    with pytest.raises(ValueError, match="targets"):
        LoraHeader(2, 1.0, (), "")
    assert LoraHeader.from_json({"rank": 2, "alpha": 4, "targets": ["q_proj"], "base_fingerprint": "ab"}) == \
        LoraHeader(2, 4.0, ("q_proj",), "ab")

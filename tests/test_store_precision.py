"""KV precision is part of every cache key: engines of different ``kv_bits`` sharing one store never serve each
other's KV, neither as an exact prefix nor as a re-placed document."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS
from helpers import docs_prompt, engine_for, full_logits

from kvboost_core import Segment
from kvboost_core.keys import Fingerprint, content_key, kv_precision, root_key
from kvboost_core.quant import QuantPayload

FP = Fingerprint("ab" * 16)


def test_precision_names_every_setting_apart():
    names = {kv_precision(None, 32), kv_precision(16, 32), kv_precision(8, 32), kv_precision(4, 32),
             kv_precision(4, 64), kv_precision(8, 128)}
    assert len(names) == 6
    assert kv_precision(None, 32) == kv_precision(None, 64)  # the group size only shapes quantized payloads
    with pytest.raises(ValueError, match="kv_bits"):
        kv_precision(3, 32)


def test_keys_differ_by_precision():
    ids = [5, 6, 7]
    assert (content_key("default", FP, ids, precision=kv_precision(None, 32))
            != content_key("default", FP, ids, precision=kv_precision(4, 32)))
    assert (root_key("default", FP, precision=kv_precision(None, 32))
            != root_key("default", FP, precision=kv_precision(8, 32)))
    # a length-prefixed field: a precision cannot borrow bytes from the fingerprint or namespace
    assert root_key("ab", FP, precision="c") != root_key("a", FP, precision="bc")


def _prompt(tokenizer):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in CORPUS]
    return [Segment(token_ids=ids[0]), Segment(token_ids=ids[1]), Segment(token_ids=ids[2][:5])]


def test_int4_prefix_on_a_shared_disk_is_never_served_to_a_dense_engine(tiny_llama, tokenizer, tmp_path):
    """The audit's case: a kv_bits=4 engine and a kv_bits=None engine share one disk directory. The dense
    engine must not read int4 prefix KV as ``reused_exact``; its answer is the full prefill's."""
    prompt = _prompt(tokenizer)
    int4 = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}", kv_bits=4)
    first = int4.prefill(prompt)
    assert first.stats["reused_exact"] == 0
    disk = next(t for t in int4.store.tiers if type(t).__name__ == "DiskStore")
    stored = [disk.get(k) for k in list(disk._index.entries)]
    assert any(isinstance(b.payload, QuantPayload) for b in stored if b is not None)  # int4 entries exist

    dense = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}")  # kv_bits=None, fresh memory tier
    res = dense.prefill(prompt)
    assert res.stats["reused_exact"] == 0 and res.stats["hits_exact"] == 0
    ref = full_logits(tiny_llama, res.token_ids)
    assert (ref - res.last_logits).abs().max().item() < 1e-4
    # and the dense engine's own entries are exact for it on its next call
    again = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}").prefill(prompt)
    assert again.stats["reused_exact"] >= again.stats["prompt_tokens"] - 16
    assert (ref - again.last_logits).abs().max().item() < 1e-4

    # both precisions coexist: a second int4 engine still hits the first one's entries, bit for bit
    int4_again = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}", kv_bits=4).prefill(prompt)
    assert int4_again.stats["reused_exact"] >= int4_again.stats["prompt_tokens"] - 16


def test_quantized_documents_are_not_re_placed_into_a_dense_engine(tiny_llama, tokenizer, tmp_path):
    int8 = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}", kv_bits=8)
    assert int8.warm(CORPUS[:2]).warmed == 2
    dense = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}")
    assert dense.warm(CORPUS[:2]).already_warm == 0  # int8 documents are not this engine's documents
    prompt = docs_prompt(CORPUS[:2], " Where was Alice born?")
    fresh = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path / 'other'}", kv_bits=8)
    assert fresh.warm(CORPUS[:2]).warmed == 2
    res = engine_for(tiny_llama, tokenizer, store=f"disk:{tmp_path}", kv_bits=8).prefill(
        prompt, store_prefix=False)
    assert res.stats["hits_content"] > 0  # the int8 documents are found by an int8 engine
    ref = fresh.prefill(prompt, store_prefix=False)
    assert torch.equal(ref.last_logits, res.last_logits)


def test_a_calibration_that_changes_kv_bits_moves_the_engine_to_that_precision(tiny_llama, tokenizer):
    """kv_bits is read per call (calibration may replace the config): the keys follow the current setting."""
    eng = engine_for(tiny_llama, tokenizer)
    prompt = _prompt(tokenizer)
    eng.prefill(prompt)
    eng.config = eng.config.with_(kv_bits=4)
    res = eng.prefill(prompt)
    assert res.stats["reused_exact"] == 0  # the dense entries are not the int4 engine's

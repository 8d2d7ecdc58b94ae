"""Sliding-window families outside the layer-by-layer adapter (Gemma 2, Gemma 3 text): no reuse, one warning,
plain HF generation, and no crash when a prompt or a warmed document is longer than the window."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import CORPUS
from helpers import engine_for

from kvboost_core import Segment

WINDOW = 16


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        model_type, vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    impl = "eager" if model_type == "gemma2" else "sdpa"  # transformers has no SDPA path for Gemma 2
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=impl)
    assert "sliding_attention" in cfg.layer_types  # the tiny config really has window layers
    return model.eval()


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def sliding(request, tokenizer):
    model = _tiny(request.param)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = engine_for(model, tokenizer)
    return model, eng, [w for w in caught if "kvboost" in str(w.message)]


@torch.inference_mode()
def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(ids):].tolist()


def test_one_warning_per_engine(sliding):
    _, eng, caught = sliding
    assert len(caught) == 1 and "sliding-window" in str(caught[0].message)
    assert eng.driver.no_reuse


def test_long_prompt_and_warmed_document_run_as_plain_hf(sliding):
    model, eng, _ = sliding
    doc = " ".join(CORPUS[:3])  # far longer than the window
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning per request
        warm = eng.warm([doc])
        assert warm.chunks == 0 and eng.stats()["entries"] == 0
        prompt = [Segment(text=doc, cacheable=True), Segment(text=" Where was Alice born?")]
        first = eng.generate(prompt, max_new_tokens=6)
        again = eng.generate(prompt, max_new_tokens=6)
    n = len(first.prompt_token_ids)
    assert n > 3 * WINDOW
    assert first.stats["reuse_ratio"] == again.stats["reuse_ratio"] == 0.0
    assert first.token_ids == again.token_ids
    ref = _hf_greedy(model, first.prompt_token_ids, len(first.token_ids))
    assert first.token_ids == ref[: len(first.token_ids)]
    pre = eng.prefill(prompt)
    full = model(input_ids=torch.tensor([pre.token_ids])).logits[0, -1].float()
    assert (pre.last_logits - full).abs().max().item() < 1e-4
    assert eng.stats()["entries"] == 0

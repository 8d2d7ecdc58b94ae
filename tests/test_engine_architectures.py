"""Every supported family: exact prefix hits equal a full prefill, greedy generate equals HF generate, and
CacheBlend's K/V-only check-layer pass writes a full prefill's K/V."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for, full_logits, full_prefill_kv

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, make_tiny_model(request.param)


def test_exact_prefix_hit_equals_full_prefill(arch_model, tokenizer):
    arch, model = arch_model
    eng = engine_for(model, tokenizer)
    prompt = CORPUS[6] + " " + CORPUS[1] + " " + CORPUS[2]
    first = eng.prefill(prompt)
    second = eng.prefill(prompt)
    assert first.stats["reused_exact"] == 0
    assert second.stats["reused_exact"] >= second.stats["prompt_tokens"] - 1, second.stats
    ref = full_logits(model, second.token_ids)
    assert (ref - second.last_logits).abs().max().item() < 1e-4, arch
    # a longer prompt that extends the cached one reuses the prefix (partly matching the last chunk)
    longer = eng.prefill(prompt + " " + CORPUS[4])
    assert longer.stats["reused_exact"] >= len(first.token_ids) - 16
    assert (full_logits(model, longer.token_ids) - longer.last_logits).abs().max().item() < 1e-4


def test_greedy_generate_equals_hf(arch_model, tokenizer):
    arch, model = arch_model
    eng = engine_for(model, tokenizer)
    prompt = CORPUS[1]
    for _ in range(2):  # cold, then an exact hit
        res = eng.generate(prompt, max_new_tokens=12)
        ids = torch.tensor([res.prompt_token_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
        hf = out[0, ids.shape[1]:].tolist()
        assert res.token_ids == hf[: len(res.token_ids)], arch
        assert res.finish_reason in ("length", "eos")


def test_full_repair_on_reordered_docs_equals_full_prefill(arch_model, tokenizer):
    arch, model = arch_model
    eng = engine_for(model, tokenizer)
    eng.warm(CORPUS[:5])
    prompt = docs_prompt([CORPUS[3], CORPUS[0], CORPUS[2]], " Where was Alice born?", head="System: answer.")
    res = eng.prefill(prompt, repair="full", store_prefix=False)
    assert res.stats["hits_content"] > 0
    ref = full_logits(model, res.token_ids)
    assert (ref - res.last_logits).abs().max().item() < 1e-4, arch
    blend = eng.prefill(prompt, repair="cacheblend", recompute_ratio=1.0, store_prefix=False)
    assert (ref - blend.last_logits).abs().max().item() < 1e-4, arch


def test_check_layer_kv_only_pass_equals_full_prefill_kv(arch_model, tokenizer):
    """CacheBlend's check layer computes K/V alone for the tokens it drops, by stopping the stock decoder layer at
    its cache write: in every family (fused QKV, K norms, Gemma's scaled norms) those K/V must be a full prefill's."""
    arch, model = arch_model
    eng = engine_for(model, tokenizer)
    eng.warm(CORPUS[:5])
    prompt = docs_prompt([CORPUS[4], CORPUS[1], CORPUS[3]], " Who?", head="System: answer.")
    res = eng.prefill(prompt, repair="cacheblend", recompute_ratio=0.15, check_layer=1, store_prefix=False)
    assert res.stats["check_kv_tokens"] > res.stats["tokens_per_layer"][1], arch  # some tokens were K/V-only
    n = len(res.token_ids)
    ref_k, ref_v = full_prefill_kv(model, res.token_ids)[1]
    k, v = res.cache.keys[1][0, :, :n], res.cache.values[1][0, :, :n]  # (H, n, D)
    assert torch.allclose(k, ref_k, atol=1e-4), arch
    assert torch.allclose(v, ref_v, atol=1e-4), arch

"""Every supported family: exact prefix hits equal a full prefill, and greedy generate equals HF generate."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for, full_logits

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

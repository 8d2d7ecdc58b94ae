"""CacheBlend: exact causal masking, real skipped work, and ratio 1.0 == full prefill."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CORPUS
from helpers import docs_prompt, engine_for, full_logits, full_prefill_kv

from kvboost_core.model import attention


@pytest.fixture(scope="module")
def eng(tiny_llama, tokenizer):
    e = engine_for(tiny_llama, tokenizer, sink_tokens=2)
    e.warm(CORPUS)
    return e


def test_mask_is_exactly_causal():
    """The one causal rule every mask is built from (attention.visible), with and without a window, and the
    dense reference and the additive form built from it."""
    from kvboost_core.model import attention
    from kvboost_core.model.forward import dense_mask

    q = torch.tensor([2, 5, 9])
    m = dense_mask(q, 12, None, impl="sdpa", dtype=torch.float32)[0, 0]  # (3, 12)
    for i, p in enumerate(q.tolist()):
        assert m[i, : p + 1].all() and not m[i, p + 1:].any()
    w = attention.visible(q, torch.arange(12), 3)
    for i, p in enumerate(q.tolist()):
        assert w[i].nonzero().flatten().tolist() == [p - 2, p - 1, p]
    add = attention.additive(w, "eager", torch.float32)
    assert (add[w] == 0).all() and (add[~w] == torch.finfo(torch.float32).min).all()
    assert (attention.additive(w, "sdpa", torch.float32)[~w] == float("-inf")).all()


def _kv_before(res, end):
    return [(k[0, :, :end].clone(), v[0, :, :end].clone()) for k, v in zip(res.cache.keys, res.cache.values)]


def test_recomputed_tokens_ignore_later_tokens(eng, monkeypatch):
    docs = [CORPUS[2], CORPUS[0], CORPUS[4]]
    a_prompt = docs_prompt(docs, " Where was Alice born?")
    b_prompt = docs_prompt(docs, " Who repairs bicycles in town?")
    q_start = len(eng.tokenize_ids(docs_prompt(docs, "x"))) - 1
    kw = dict(repair="cacheblend", recompute_ratio=0.3, select="deviation", store_prefix=False)
    a, b = eng.prefill(a_prompt, **kw), eng.prefill(b_prompt, **kw)
    assert a.stats["recomputed"] > 0
    for (ka, va), (kb, vb) in zip(_kv_before(a, q_start), _kv_before(b, q_start)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)

    # The same check catches a leaking (bidirectional) mask: it can fail.
    real_blocks = attention.row_blocks

    def leaky(q_pos, length, window, **kw):
        plan = real_blocks(q_pos, length, window, **kw)
        return attention.RowBlocks(plan.rows, tuple(
            attention.QueryBlock(b.start, b.end, 0, length, torch.zeros(1, 1, b.end - b.start, length))
            for b in plan.blocks))

    monkeypatch.setattr(attention, "row_blocks", leaky)
    a2, b2 = eng.prefill(a_prompt, **kw), eng.prefill(b_prompt, **kw)
    diffs = [not torch.equal(ka, kb) for (ka, _), (kb, _) in zip(_kv_before(a2, q_start), _kv_before(b2, q_start))]
    assert any(diffs)


def test_layers_from_check_see_only_selected_and_fresh(eng):
    prompt = docs_prompt([CORPUS[5], CORPUS[1], CORPUS[3], CORPUS[2]], " Why do birds sing?")
    res = eng.prefill(prompt, repair="cacheblend", recompute_ratio=0.15, check_layer=1, store_prefix=False)
    s = res.stats
    reused = s["hits_content"]
    fresh = s["computed"]
    per_layer = s["tokens_per_layer"]
    assert per_layer[0] == reused + fresh  # below the check layer: every re-placed token
    assert s["check_kv_tokens"] == reused + fresh  # the check layer scores every one by its K/V alone
    limit = math.ceil(0.15 * reused) + fresh + 1  # +1: the last prompt token is always computed
    assert all(n <= limit for n in per_layer[1:]), (per_layer, limit)
    assert per_layer[1] < 0.5 * per_layer[0]


@pytest.mark.parametrize("check_layer", [0, 1])
def test_check_layer_kv_is_fresh_for_every_candidate(eng, tiny_llama, check_layer):
    """Below and at the check layer the K/V are a full prefill's (the K/V-only pass must write every candidate's,
    not only the kept ones'); above it the unselected candidates keep the re-placed K/V, which differ."""
    prompt = docs_prompt([CORPUS[4], CORPUS[0], CORPUS[6]], " Who?")
    res = eng.prefill(prompt, repair="cacheblend", recompute_ratio=0.15, check_layer=check_layer,
                      store_prefix=False)
    n = len(res.token_ids)
    ref = full_prefill_kv(tiny_llama, res.token_ids)
    for layer in range(check_layer + 1):
        k, v = res.cache.keys[layer][0, :, :n], res.cache.values[layer][0, :, :n]  # (H, n, D)
        assert torch.allclose(k, ref[layer][0], atol=1e-4), layer
        assert torch.allclose(v, ref[layer][1], atol=1e-4), layer
    above = res.cache.keys[check_layer + 1][0, :, :n]
    assert not torch.allclose(above, ref[check_layer + 1][0], atol=1e-4)


@pytest.mark.parametrize("select", ["deviation", "value", "key", "recency", "deviation_recency"])
def test_ratio_one_equals_full_prefill(eng, tiny_llama, select):
    prompt = docs_prompt([CORPUS[3], CORPUS[1]], " Where?")
    res = eng.prefill(prompt, repair="cacheblend", recompute_ratio=1.0, select=select, store_prefix=False)
    assert (full_logits(tiny_llama, res.token_ids) - res.last_logits).abs().max().item() < 1e-4


def test_repaired_prefill_is_not_served_by_default(eng):
    prompt = docs_prompt([CORPUS[6], CORPUS[0]], " Answer:")
    first = eng.prefill(prompt, repair="cacheblend")
    again = eng.prefill(prompt, repair="cacheblend")
    assert again.stats["reused_repaired"] == 0 and again.stats["reused_approx"] > 0
    # the repeat repairs again, from the same state: the same answer, bit for bit
    assert torch.equal(first.last_logits, again.last_logits)


def test_repaired_prefill_is_served_as_repaired_when_stored(tiny_llama, tokenizer):
    e = engine_for(tiny_llama, tokenizer, sink_tokens=2, store_repaired=True)
    e.warm(CORPUS)
    prompt = docs_prompt([CORPUS[6], CORPUS[0]], " Answer:")
    first = e.prefill(prompt, repair="cacheblend")
    again = e.prefill(prompt, repair="cacheblend")
    assert first.stats["reused_exact"] == 0 and first.stats["reused_repaired"] == 0
    # approximate KV reused from the first call: reported as repaired, never as exact
    assert again.stats["reused_repaired"] >= again.stats["prompt_tokens"] - 1 - again.stats["reused_exact"]
    assert again.stats["reused_exact"] < again.stats["prompt_tokens"] // 4
    assert e.stats()["hits_repaired"] == again.stats["hits_repaired"] > 0
    # the repeat gives the repaired answer (the same KV, served again)
    assert torch.allclose(first.last_logits, again.last_logits, atol=1e-4)


def test_verify_is_not_fooled_by_stored_repaired_prefixes(eng):
    prompt = docs_prompt([CORPUS[5], CORPUS[4]], " Why?")
    before = eng.verify([prompt], repairs=("none",), max_new_tokens=2).summary()["none"]
    eng.generate(prompt, max_new_tokens=2, repair="none")  # stores the approximate KV as a repaired prefix
    assert eng.prefill(prompt, repair="none", store_prefix=False).stats["reused_exact"] > 0
    after = eng.verify([prompt], repairs=("none",), max_new_tokens=2).summary()["none"]
    assert after["mean_kl"] == pytest.approx(before["mean_kl"], abs=1e-6) and before["mean_kl"] > 0

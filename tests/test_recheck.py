"""Progressive CacheBlend: a second check layer re-scores the kept tokens and narrows them (recheck_layer)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CORPUS
from helpers import docs_prompt, engine_for, full_logits, full_prefill_kv

from kvboost_core.config import EngineConfig
from kvboost_core.model.forward import Schedule

PROMPT_DOCS = [CORPUS[5], CORPUS[1], CORPUS[3], CORPUS[2]]


@pytest.fixture(scope="module")
def eng(tiny_llama, tokenizer):
    e = engine_for(tiny_llama, tokenizer, sink_tokens=2)
    e.warm(CORPUS)
    return e


def _prefill(eng, **kw):
    return eng.prefill(docs_prompt(PROMPT_DOCS, " Why do birds sing?"), repair="cacheblend", check_layer=0,
                       select="deviation", store_prefix=False, **kw)


def test_recheck_narrows_the_kept_set_above_its_layer(eng):
    s = _prefill(eng, recompute_ratio=0.5, recheck_layer=1, recheck_ratio=0.2).stats
    reused, fresh = s["hits_content"], s["computed"]
    per_layer = s["tokens_per_layer"]
    n1, n2 = math.ceil(0.5 * reused), math.ceil(0.2 * reused)
    assert per_layer[0] <= n1 + fresh + 1 and per_layer[0] >= n1  # at the first check: the top half
    assert all(n <= n2 + fresh + 1 for n in per_layer[1:]), per_layer  # from the re-check on: the top 20%
    assert per_layer[1] < per_layer[0]
    # the tokens dropped at the re-check are approximate above it: counted as reused, never as recomputed
    assert s["recomputed"] <= n2
    assert s["recheck_layer"] == 1


def test_recheck_keeping_everything_equals_one_check(eng):
    one = _prefill(eng, recompute_ratio=0.3)
    two = _prefill(eng, recompute_ratio=0.3, recheck_layer=1, recheck_ratio=0.3)
    assert torch.equal(one.last_logits, two.last_logits)
    assert one.stats["tokens_per_layer"] == two.stats["tokens_per_layer"]


def test_recheck_is_scored_on_its_own_layer(eng, tiny_llama):
    """At the re-check layer every kept token's K/V are a fresh prefill's (scored before the overwrite); a token
    dropped there keeps fresh K/V in the layers up to it and the re-placed K/V above."""
    res = _prefill(eng, recompute_ratio=1.0, recheck_layer=1, recheck_ratio=0.1)
    n = len(res.token_ids)
    ref = full_prefill_kv(tiny_llama, res.token_ids)
    for layer in (0, 1):  # ratio 1.0 at layer 0: every token is fresh through the re-check layer
        assert torch.allclose(res.cache.keys[layer][0, :, :n], ref[layer][0], atol=1e-4), layer
    above = len(ref) - 1
    assert not torch.allclose(res.cache.keys[above][0, :, :n], ref[above][0], atol=1e-4)


def test_recheck_at_ratio_one_equals_full_prefill(eng, tiny_llama):
    res = _prefill(eng, recompute_ratio=1.0, recheck_layer=1, recheck_ratio=1.0)
    ref = full_logits(tiny_llama, res.token_ids)
    assert torch.allclose(res.last_logits, ref, atol=1e-4)


def test_recheck_changes_the_answer_path(eng):
    """Dropping tokens at the re-check is real: the logits move away from the one-check result."""
    one = _prefill(eng, recompute_ratio=0.6)
    two = _prefill(eng, recompute_ratio=0.6, recheck_layer=1, recheck_ratio=0.05)
    assert not torch.equal(one.last_logits, two.last_logits)


def test_keeps_every_candidate():
    c = torch.arange(10)
    assert Schedule(base=c[:0], candidates=c, check_layer=1, n_select=10).keeps_every_candidate()
    assert not Schedule(base=c[:0], candidates=c, check_layer=1, n_select=10, recheck_layer=3,
                        n_recheck=4).keeps_every_candidate()
    assert not Schedule(base=c[:0], candidates=c, check_layer=1, n_select=4).keeps_every_candidate()


def test_recheck_validation(eng):
    with pytest.raises(ValueError, match="recheck_layer"):
        EngineConfig(check_layer=2, recheck_layer=2)
    with pytest.raises(TypeError, match="recheck_layer"):
        EngineConfig(recheck_layer=True)
    with pytest.raises(ValueError, match="recheck_ratio"):
        EngineConfig(recheck_layer=4, recheck_ratio=1.5)
    with pytest.raises(ValueError, match="recheck_layer"):
        _prefill(eng, recompute_ratio=0.5, recheck_layer=99, recheck_ratio=0.1)
    with pytest.raises(ValueError, match="recheck_layer"):
        eng.generate(docs_prompt(PROMPT_DOCS, " Why?"), max_new_tokens=1, check_layer=1, recheck_layer=1)

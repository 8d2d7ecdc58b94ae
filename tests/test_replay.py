"""The check layer's kept rows read their Q/K/V projections from its scoring pass (kvboost_core.model.replay): the same
logits and KV as projecting them again (single and canonical/batched prefill, re-check and query-aware
selection, sdpa and eager, a qwen3 q/k-norm family), each projection runs once per row at a check layer, and a
concurrent caller on another thread is never served the captured rows."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for

from kvboost_core.model import forward, replay
from kvboost_core.serving.batch import prefill as batch_prefill

PROMPT = docs_prompt([CORPUS[3], CORPUS[0], CORPUS[5], CORPUS[2]], " Who repairs bicycles in town?")
SETTINGS = [
    dict(repair="cacheblend", recompute_ratio=0.7),
    dict(repair="cacheblend", recompute_ratio=0.15, select="deviation"),
    dict(repair="cacheblend", recompute_ratio=0.5, recheck_layer=2, recheck_ratio=0.2),
    dict(repair="cacheblend", recompute_ratio=0.3, query_tokens=4),
]


def _engine(tokenizer, arch: str, impl: str):
    model = make_tiny_model(arch, hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                            layers=4)
    model.config._attn_implementation = impl
    engine = engine_for(model, tokenizer, sink_tokens=2)
    engine.warm(CORPUS)
    return engine


def _batch(engine, kw):  # the canonical (batched / deterministic-serving) prefill takes the basic settings
    basic = {k: v for k, v in kw.items() if k in ("repair", "recompute_ratio", "select")}
    return batch_prefill(engine, PROMPT, store_prefix=False, check_layer=1, **basic).result.last_logits


def _run(engine, kw):
    res = engine.prefill(PROMPT, store_prefix=False, check_layer=1, **kw)
    kv = [torch.cat((k[0, :, :len(res.token_ids)], v[0, :, :len(res.token_ids)]))
          for k, v in zip(res.cache.keys, res.cache.values)]
    return res, kv


@pytest.mark.parametrize(("arch", "impl"), [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_replayed_projections_equal_projecting_again(tokenizer, monkeypatch, arch, impl):
    engine = _engine(tokenizer, arch, impl)
    for kw in SETTINGS:
        monkeypatch.setattr(forward, "REUSE_CHECK_PROJECTIONS", False)
        old, old_kv = _run(engine, kw)
        old_batch = _batch(engine, kw)
        monkeypatch.setattr(forward, "REUSE_CHECK_PROJECTIONS", True)
        new, new_kv = _run(engine, kw)
        new_batch = _batch(engine, kw)
        assert new.stats["recomputed"] > 0 and new.stats["recomputed"] == old.stats["recomputed"], kw
        assert (new.last_logits.float() - old.last_logits.float()).abs().max().item() <= 1e-4, kw
        assert (new_batch.float() - old_batch.float()).abs().max().item() <= 1e-4, kw
        assert max((a - b).abs().max().item() for a, b in zip(new_kv, old_kv)) <= 1e-4, kw
    for layer in engine.driver.inner.layers:  # every override removed
        assert all("forward" not in vars(m) for m in replay.projections(layer.self_attn).values())


def test_each_projection_runs_once_per_row_at_the_check_layer(tokenizer, monkeypatch):
    engine = _engine(tokenizer, "llama", "sdpa")
    attn = engine.driver.inner.layers[1].self_attn
    rows: list[int] = []
    linear = torch.nn.Linear.forward

    def counting(self, x):  # the rows k_proj actually multiplies (a forward hook fires for replayed calls too)
        if self is attn.k_proj:
            rows.append(int(x.shape[1]))
        return linear(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    kw = dict(repair="cacheblend", recompute_ratio=0.5)
    monkeypatch.setattr(forward, "REUSE_CHECK_PROJECTIONS", False)
    engine.prefill(PROMPT, store_prefix=False, check_layer=1, **kw)
    before = list(rows)
    rows.clear()
    monkeypatch.setattr(forward, "REUSE_CHECK_PROJECTIONS", True)
    res = engine.prefill(PROMPT, store_prefix=False, check_layer=1, **kw)
    scored = res.stats["check_kv_tokens"]
    assert before == [scored, res.stats["tokens_per_layer"][1]]  # the kept rows were projected twice
    assert rows == [scored]  # now once: the whole-layer pass read them


def test_another_thread_is_never_served_the_captured_rows(tokenizer):
    engine = _engine(tokenizer, "llama", "sdpa")
    attn = engine.driver.inner.layers[0].self_attn
    x = torch.randn(1, 6, 144)
    with torch.inference_mode(), replay.capture(attn) as captured:
        attn.k_proj(x)
    idx = torch.tensor([1, 4])
    other: dict[str, torch.Tensor] = {}
    with torch.inference_mode(), replay.replaying(attn, captured, idx):
        here = attn.k_proj(x[:, idx])
        t = threading.Thread(target=lambda: other.setdefault("k", attn.k_proj(x)))
        t.start()
        t.join()
        with pytest.raises(RuntimeError, match="replayed projection"):
            attn.k_proj(x)  # this thread, a different row count: a broken invariant, not a wrong answer
    assert torch.equal(here, captured["k_proj"][:, idx])
    assert other["k"].shape == (1, 6, attn.k_proj.out_features)  # computed, not the captured two rows
    assert "forward" not in vars(attn.k_proj)

"""The TTFT benchmark's FLOP model (kvboost_rag.app.bench.flops) against FLOPs counted by torch's FlopCounterMode
on a tiny model (eager attention: matmuls the counter sees): a full prefill, and reuse prefills whose planned forward the model reads from its trace."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for
from torch.utils.flop_counter import FlopCounterMode

from kvboost_core.model import attention
from kvboost_core.model.forward import record_traces
from kvboost_rag.app.bench.flops import Shape, full_prefill_flops, trace_flops


@pytest.fixture(scope="module")
def gqa_engine(tokenizer):
    model = make_tiny_model("llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                            intermediate_size=200)
    # eager: its attention is matmuls the counter sees (it has no formula for CPU's fused SDPA kernel); the
    # planned forward runs the same query blocks under either implementation
    model.config._attn_implementation = "eager"
    engine = engine_for(model, tokenizer, sink_tokens=2)
    engine.warm(CORPUS)
    return engine


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def test_full_prefill_flops_match_the_counter(gqa_engine):
    model = gqa_engine.model
    ids = torch.arange(3, 200).view(1, -1)
    t = ids.shape[1]
    counted = _counted(lambda: model(input_ids=ids, logits_to_keep=1))
    shape = Shape.of(model.config)
    # eager attention computes the whole masked square; the model charges a causal prefill the causal half
    square_extra = shape.layers * shape.attention_flops(t * t - t * (t + 1) // 2)
    assert counted == full_prefill_flops(shape, t) + square_extra


@pytest.mark.parametrize(("kw", "block_rows"), [
    (dict(repair="cacheblend", recompute_ratio=0.5), 16),
    (dict(repair="cacheblend", recompute_ratio=0.5), 0),  # the former dense mask: every row reads every key
    (dict(repair="cacheblend", recompute_ratio=0.15, recheck_layer=2, recheck_ratio=0.05), 256),
    (dict(repair="none"), 16),
])
def test_reuse_prefill_flops_match_the_counter(gqa_engine, monkeypatch, kw, block_rows):
    monkeypatch.setattr(attention, "BLOCK_ROWS", block_rows)
    prompt = docs_prompt([CORPUS[2], CORPUS[0], CORPUS[4], CORPUS[1]], " Who repairs bicycles in town?")
    with record_traces() as traces:
        counted = _counted(lambda: gqa_engine.prefill(prompt, store_prefix=False, **kw))
    shape = Shape.of(gqa_engine.model.config)
    flops = trace_flops(shape, traces)
    assert traces and flops.implemented == counted
    total = traces[-1].length
    assert flops.ideal <= flops.implemented < full_prefill_flops(shape, total) * (3 if block_rows == 0 else 1.01)
    if kw["repair"] == "cacheblend":
        assert traces[-1].kv_only_tokens > 0 and flops.ideal < flops.implemented  # the check layer's extra Q

"""Block attention for sparse recomputed rows (kvboost_core.model.attention): each query block reads keys only up to its
last row, with one float mask per forward and grouped-query K/V passed natively. Checked against a dense float64
reference over random selections, lengths, GQA ratios, windows and block sizes (the block holding the question
spans every key; empty and full selections included), and end to end against the former dense mask on every path
(single prefill, canonical/batched prefill, decode) and against a full prefill at r=1.0."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for, full_logits

from kvboost_core.model import attention
from kvboost_core.model.forward import decode_step
from kvboost_core.serving.batch import prefill as batch_prefill


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
    """Dense causal attention in float64: q (1, H, n, D), k/v (1, H_kv, T, D) -> (1, n, H, D)."""
    h, h_kv, t = q.shape[1], k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // h_kv, dim=1)  # (1, H, T, D)
    vv = v.double().repeat_interleave(h // h_kv, dim=1)
    logits = q.double() @ kk.transpose(-1, -2) * scale  # (1, H, n, T)
    kp = torch.arange(t).view(1, -1)
    allowed = kp <= q_pos.view(-1, 1)
    if window is not None:
        allowed &= kp > q_pos.view(-1, 1) - window
    logits = logits.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(logits, dim=-1) @ vv).transpose(1, 2)  # (1, n, H, D)


def _selection(gen: torch.Generator, length: int, share: float, question: int) -> torch.Tensor:
    """Sorted positions: a random ``share`` of [0, length - question) and the last ``question`` positions."""
    body = length - question
    picked = torch.randperm(body, generator=gen)[: int(round(share * body))]
    return torch.cat((torch.sort(picked).values, torch.arange(body, length)))


CASES = [  # (length, heads, kv heads, block rows, window, share)
    (1, 4, 4, 256, None, 0.0),  # one row, one key
    (37, 4, 2, 1, None, 0.5),  # one row per block
    (200, 9, 3, 7, None, 0.3),  # SmolLM2's GQA ratio, blocks that split the question
    (200, 9, 3, 64, None, 0.0),  # empty selection: the question alone
    (200, 8, 2, 64, None, 1.0),  # full selection: a causal prefill
    (513, 6, 1, 128, None, 0.7),  # multi-query attention
    (300, 4, 2, 32, 50, 0.6),  # sliding window: blocks start at their first row's window
    (300, 4, 4, 1000, 17, 1.0),  # one block holding every row, window smaller than the block's span
    (900, 9, 3, 256, None, 0.02),  # sparse rows far apart: blocks cut at the gaps
    (900, 4, 2, 256, 40, 0.05),  # ... under a sliding window
]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_block_attention_matches_a_dense_reference(tiny_llama, impl, case):
    length, h, h_kv, rows, window, share = case
    gen = torch.Generator().manual_seed(length * 31 + h + rows)
    q_pos = _selection(gen, length, share, question=min(5, length))
    d = 16
    q = torch.randn(1, h, q_pos.numel(), d, generator=gen)
    k = torch.randn(1, h_kv, length, d, generator=gen)
    v = torch.randn(1, h_kv, length, d, generator=gen)
    module = tiny_llama.model.layers[0].self_attn  # the family's eager function reads num_key_value_groups
    before = module.num_key_value_groups
    module.num_key_value_groups = h // h_kv
    try:
        plan = attention.row_blocks(q_pos, length, window, impl=impl, dtype=torch.float32, block_rows=rows)
        out = attention.block_attention(impl, module, q, k, v, plan, scaling=d ** -0.5, dropout=0.0)
    finally:
        module.num_key_value_groups = before
    ref = _reference(q, k, v, q_pos, window, d ** -0.5)
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() < 1e-5
    # causal cost: no block reads a key past its last row, and the last block (the question) spans to the end
    assert all(b.k_hi == int(q_pos[b.end - 1]) + 1 for b in plan.blocks)
    assert plan.blocks[-1].k_hi == length
    assert sum(b.end - b.start for b in plan.blocks) == q_pos.numel()
    if window is not None:
        assert all(b.k_lo == max(0, int(q_pos[b.start]) - window + 1) for b in plan.blocks)


def _pairs(plan: attention.RowBlocks) -> int:
    return sum((b.end - b.start) * (b.k_hi - b.k_lo) for b in plan.blocks)


def test_row_blocks_cut_a_block_at_a_gap():
    # the system prompt's rows and the question's, 4K positions apart, in one 256-row block: the system rows
    # would each read ~4K keys they mask
    q_pos = torch.cat((torch.arange(32), torch.arange(4128, 4192)))
    kw = dict(impl="sdpa", dtype=torch.float32, block_rows=256)
    whole = attention.row_blocks(q_pos, 4192, None, split_gain=0.0, **kw)
    cut = attention.row_blocks(q_pos, 4192, None, **kw)
    assert [(b.start, b.end, b.k_hi) for b in whole.blocks] == [(0, 96, 4192)]
    assert [(b.start, b.end, b.k_lo, b.k_hi) for b in cut.blocks] == [(0, 32, 0, 32), (32, 96, 0, 4192)]
    assert _pairs(cut) == 32 * 32 + 64 * 4192  # the causal span of each row's block, nothing more
    # a cut that saves little is not made: a contiguous run stays one block (one kernel call)
    run = attention.row_blocks(torch.arange(4000, 4192), 4192, None, **kw)
    assert len(run.blocks) == 1


@pytest.mark.parametrize("seed", range(6))
def test_row_blocks_cuts_never_add_pairs(seed):
    gen = torch.Generator().manual_seed(seed)
    length = 3000
    q_pos = _selection(gen, length, [0.01, 0.1, 0.5, 0.9, 0.03, 0.2][seed], question=64)
    window = None if seed % 2 else 700
    kw = dict(impl="sdpa", dtype=torch.float32, block_rows=[64, 256, 512][seed % 3])
    whole = attention.row_blocks(q_pos, length, window, split_gain=0.0, **kw)
    cut = attention.row_blocks(q_pos, length, window, **kw)
    assert _pairs(cut) <= _pairs(whole)
    assert [b.start for b in cut.blocks][0] == 0 and all(
        x.end == y.start for x, y in zip(cut.blocks, cut.blocks[1:]))  # contiguous, in order, every row once
    assert cut.blocks[-1].end == q_pos.numel()
    assert all(b.end - b.start <= kw["block_rows"] for b in cut.blocks)


def test_row_blocks_read_the_module_settings_at_call_time(monkeypatch):
    # benchmarks (--block-rows) and tests set attention.BLOCK_ROWS; a default bound at import ignored them
    q_pos = torch.arange(40)
    monkeypatch.setattr(attention, "BLOCK_ROWS", 8)
    assert len(attention.row_blocks(q_pos, 40, None, impl="sdpa", dtype=torch.float32).blocks) == 5
    monkeypatch.setattr(attention, "BLOCK_ROWS", 40)
    assert len(attention.row_blocks(q_pos, 40, None, impl="sdpa", dtype=torch.float32).blocks) == 1


def test_row_blocks_refuse_bad_input():
    with pytest.raises(ValueError, match="block_rows"):
        attention.row_blocks(torch.tensor([0, 1]), 2, None, impl="sdpa", dtype=torch.float32, block_rows=0)
    with pytest.raises(ValueError, match="past the attended length"):
        attention.row_blocks(torch.tensor([0, 5]), 5, None, impl="sdpa", dtype=torch.float32)


def _paths(engine, prompt):
    """Logits of every planned-forward path: single prefill (cacheblend r=0.7, selective, none), the canonical
    (batched / deterministic-serving) prefill, and three decode steps after it."""
    out = {}
    for repair, r in (("cacheblend", 0.7), ("cacheblend", 0.15), ("selective", 0.0), ("none", 0.0)):
        res = engine.prefill(prompt, repair=repair, recompute_ratio=r, store_prefix=False)
        out[f"{repair}-{r}"] = res.last_logits.float()
    pre = batch_prefill(engine, prompt, store_prefix=False, repair="cacheblend", recompute_ratio=0.7)
    out["canonical"] = pre.result.last_logits.float()
    ids = list(pre.result.token_ids)
    cache = pre.result.cache
    total = len(ids)
    all_ids = torch.tensor(ids + [5, 9, 7], device=engine.driver.device)
    from kvboost_core.model.driver import ScatterCache

    def grown(bufs):  # room for the decoded tokens: (1, H, total + 3, D)
        return [torch.cat((b[:, :, :total], b.new_zeros(*b.shape[:2], 3, b.shape[3])), dim=2) for b in bufs]

    buf = ScatterCache(grown(cache.keys), grown(cache.values))
    for i in range(3):
        out[f"decode{i}"] = decode_step(engine.driver, all_ids, total + i, buf).float()
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_block_attention_equals_the_dense_mask_on_every_path(tokenizer, impl, monkeypatch):
    model = make_tiny_model("llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
    model.config._attn_implementation = impl
    engine = engine_for(model, tokenizer, sink_tokens=2)
    engine.warm(CORPUS)
    prompt = docs_prompt([CORPUS[3], CORPUS[0], CORPUS[5], CORPUS[2]], " Who repairs bicycles in town?")
    monkeypatch.setattr(attention, "BLOCK_ROWS", 8)  # several blocks on a tiny prompt
    new = _paths(engine, prompt)
    monkeypatch.setattr(attention, "BLOCK_ROWS", 0)  # the former dense (n, T) mask
    old = _paths(engine, prompt)
    for name in new:
        assert (new[name] - old[name]).abs().max().item() <= 1e-4, name
    assert model.config._attn_implementation == impl  # restored


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_full_recompute_through_blocks_equals_a_full_prefill(tokenizer, impl, monkeypatch):
    model = make_tiny_model("qwen2", hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
    model.config._attn_implementation = impl
    engine = engine_for(model, tokenizer, sink_tokens=2)
    engine.warm(CORPUS)
    monkeypatch.setattr(attention, "BLOCK_ROWS", 5)
    prompt = docs_prompt([CORPUS[1], CORPUS[4], CORPUS[2]], " Where was Alice born?")
    res = engine.prefill(prompt, repair="cacheblend", recompute_ratio=1.0, store_prefix=False)
    assert res.stats["hits_content"] > 0 and res.stats["recomputed"] > 0
    ref = full_logits(model, res.token_ids)
    assert (res.last_logits.float() - ref).abs().max().item() <= 1e-4

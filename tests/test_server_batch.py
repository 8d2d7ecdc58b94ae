"""Batched decode (kvboost_core.serving.batch): requests of different lengths, joining and leaving mid-batch, give the
same greedy tokens as the engine's own one-request decode loop, with the batch-invariant kernels
(``deterministic``, the default) and without them."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model

from kvboost_core import Segment
from kvboost_core.engine import KVEngine
from kvboost_core.serving.batch import BatchedDecoder, prefill


def _prompts() -> list[list[Segment]]:
    out = []
    for i in range(6):
        docs = [CORPUS[(i + j) % 5] for j in range(1 + i % 3)]  # 1-3 documents: different prompt lengths
        segs: list[Segment] = []
        for d in docs:
            segs += [Segment(text=d, cacheable=True), Segment(text="\n")]
        out.append(segs + [Segment(text=f"Question {i}: who?")])
    return out


def _batched(engine: KVEngine, prompts, n_new: list[int], arrivals: list[int], max_batch: int,
             deterministic: bool = True) -> list[list[int]]:
    """Greedy decode with the batch; request i joins at step arrivals[i] (when a row is free) and leaves at EOS
    or after n_new[i] tokens, as engine.generate does."""
    dec = BatchedDecoder(engine.driver, max_batch, deterministic=deterministic)
    outs: list[list[int]] = [[] for _ in prompts]
    live: dict = {}  # slot -> (request index, next token)
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or live:
        while waiting and dec.free and arrivals[waiting[0]] <= step:
            i = waiting.pop(0)
            pre = prefill(engine, prompts[i], store_prefix=False)
            tok = int(torch.argmax(pre.result.last_logits))
            cap = len(pre.result.token_ids) + n_new[i]
            slot = dec.add(pre.result.cache.keys, pre.result.cache.values, len(pre.result.token_ids), cap)
            live[slot] = (i, tok)
        finished = []
        for slot, (i, tok) in live.items():
            outs[i].append(tok)
            if tok in engine.eos_token_ids or len(outs[i]) >= n_new[i]:
                finished.append(slot)
        for slot in finished:
            del live[slot]
            dec.remove(slot)
        if live:
            logits = dec.step({s: t for s, (_, t) in live.items()})
            live = {s: (i, int(torch.argmax(logits[s]))) for s, (i, _) in live.items()}
        step += 1
    assert dec.size == 0 and dec.nbytes == 0  # idle: buffers released
    return outs


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_greedy_equals_unbatched(tokenizer, arch, deterministic):
    torch.manual_seed(0)
    engine = KVEngine(make_tiny_model(arch), tokenizer, sink_tokens=4)
    engine.warm(CORPUS[:5])
    prompts = _prompts()
    n_new = [12, 5, 20, 9, 16, 7]
    ref = [engine.generate(p, max_new_tokens=n, store_prefix=False).token_ids for p, n in zip(prompts, n_new)]
    got = _batched(engine, prompts, n_new, arrivals=[0, 0, 3, 4, 4, 10], max_batch=4, deterministic=deterministic)
    assert got == ref
    assert len({len(engine.tokenize_ids(p)) for p in prompts}) > 2  # the rows really had different lengths


def test_batch_of_one_and_validation(tokenizer, tiny_llama):
    engine = KVEngine(tiny_llama, tokenizer)
    prompt = [Segment(text=CORPUS[1])]
    ref = engine.generate(prompt, max_new_tokens=6, store_prefix=False).token_ids
    assert _batched(engine, [prompt], [6], [0], max_batch=1) == [ref]
    with pytest.raises(ValueError, match="max_batch"):
        BatchedDecoder(engine.driver, 0)
    with pytest.raises(TypeError, match="deterministic"):
        BatchedDecoder(engine.driver, 1, deterministic=1)  # type: ignore[arg-type]
    dec = BatchedDecoder(engine.driver, 1)
    pre = prefill(engine, prompt, store_prefix=False)
    n = len(pre.result.token_ids)
    slot = dec.add(pre.result.cache.keys, pre.result.cache.values, n, n + 1)
    with pytest.raises(RuntimeError, match="full"):
        dec.add(pre.result.cache.keys, pre.result.cache.values, n, n + 1)
    with pytest.raises(ValueError, match="every active slot"):
        dec.step({})
    dec.step({slot: 5})
    with pytest.raises(RuntimeError, match="capacity"):
        dec.step({slot: 5})
    # one request on a batch of 8 holds one row of n + 1 slots, not eight rows
    wide = BatchedDecoder(engine.driver, 8)
    wide.add(pre.result.cache.keys, pre.result.cache.values, n, n + 1)
    assert wide.nbytes * n == wide.used_bytes() * (n + 1)


def test_prefill_options_are_one_checked_value(tokenizer, tiny_llama):
    """The server's prefill takes the engine's per-call options as one CallOptions or as keywords checked into
    one: the same KV either way, unknown names and bad values refused, never both forms at once."""
    from kvboost_core.call_options import call_options

    engine = KVEngine(tiny_llama, tokenizer)
    engine.warm(CORPUS[:3])
    prompt = [Segment(text=d, cacheable=True) for d in reversed(CORPUS[:3])] + [Segment(text=" who?")]
    kw = {"repair": "cacheblend", "recompute_ratio": 0.5, "store_prefix": False}
    by_kw = prefill(engine, prompt, **kw).result
    by_value = prefill(engine, prompt, call_options(engine.config, engine.driver.num_layers, kw)).result
    assert torch.equal(by_kw.last_logits, by_value.last_logits)
    assert by_kw.stats.recomputed == by_value.stats.recomputed > 0
    with pytest.raises(TypeError, match="not both"):
        prefill(engine, prompt, call_options(engine.config, engine.driver.num_layers, {}), store_prefix=False)
    with pytest.raises(TypeError, match="recompute_raito"):
        prefill(engine, prompt, recompute_raito=0.5)
    with pytest.raises(ValueError, match="recompute_ratio"):
        prefill(engine, prompt, recompute_ratio=1.5)

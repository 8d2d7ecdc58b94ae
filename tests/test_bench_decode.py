"""The decode benchmark's runners (kvboost_rag.app.bench.decode) on the tiny model: every method decodes exactly
the asked number of tokens with EOS masked, and kvboost at fp32 with nothing reused equals plain HF greedy."""

from __future__ import annotations

from conftest import CORPUS, make_tiny_model
from helpers import engine_for

from kvboost_rag import KVBoostRAG
from kvboost_rag.app.bench.decode import hf_decode, kvboost_decode


def test_runners_decode_the_same_tokens(tokenizer):
    rag = KVBoostRAG(engine_for(make_tiny_model("llama"), tokenizer))
    prompt = " ".join(CORPUS[:3])
    ids = list(rag.encode(prompt, True))
    eos = sorted(rag.engine.eos_token_ids) or [tokenizer.eos_token_id]
    hf = hf_decode(rag.engine.model, ids, 12, eos)
    kv = kvboost_decode(rag, prompt, ids, 12, eos)
    assert len(hf["tokens"]) == len(kv["tokens"]) == 12
    assert not set(eos) & set(hf["tokens"])
    assert kv["tokens"] == hf["tokens"]
    for r in (hf, kv):
        assert 0 < r["ttft_s"] <= r["total_s"] and r["decode_s"] > 0

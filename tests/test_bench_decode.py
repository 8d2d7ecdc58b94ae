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


def test_the_decode_step_ablation_runs_each_path_from_the_same_cache(tokenizer):
    from kvboost_core import kernels
    from kvboost_rag.app.bench.decode_step import PATHS, measure

    engine = engine_for(make_tiny_model("llama"), tokenizer)
    if not kernels.has_ext():
        import pytest

        with pytest.raises(ValueError, match="native decode attention"):
            measure(engine, 40, 4)
        return
    r = measure(engine, 40, 4)
    assert set(r["step_ms"]) == set(PATHS) and all(v > 0 for v in r["step_ms"].values())
    assert r["lean_sdpa_bitwise"] and r["lean_native_max_diff"] < 1e-4
    assert set(r["attention_ms"]) == {"sdpa", "native", "read_floor"}
    c = measure(engine, 40, 2, compile=True)
    assert c["step_ms"]["lean_native_compiled"] > 0 and c["compile_s"] > 0 and c["compiled_max_diff"] < 1e-4

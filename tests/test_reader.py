"""The reader adapter: gated LoRA that only the tokens reading re-placed document KV run through.

Each test builds its own tiny model: attaching an adapter rewrites the model's projections in place."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for, full_logits

from kvboost_core.lora.reader import META, WEIGHTS, ReaderAdapter
from kvboost_rag.app import adapt

QUESTION = " Question: where was Alice born? Answer:"


def _prompt():
    return docs_prompt(CORPUS[1:4], QUESTION, head="Read these notes.")


def _saved_reader(tmp_path, model, fingerprint, *, b_scale: float = 0.0, seed: int = 0) -> str:
    """Save an adapter for ``fingerprint`` (B = 0: a no-op; else random B) and detach nothing: the caller's model
    is a throwaway used only to shape the tensors."""
    torch.manual_seed(seed)
    reader = ReaderAdapter.attach(model, rank=4, alpha=8, base_fingerprint=fingerprint)
    if b_scale:
        with torch.no_grad():
            for p in reader.parameters():
                if p.shape[1] == 4:  # lora_b (out, rank)
                    p.normal_(0, b_scale)
    out = str(tmp_path / "reader")
    reader.save(out)
    return out


def _pair(tmp_path, b_scale: float, **kw):
    """(engine with the reader, engine without), on two copies of the same random model."""
    base = make_tiny_model("llama", seed=3)
    plain = engine_for(base, _tok(), **kw)
    path = _saved_reader(tmp_path, make_tiny_model("llama", seed=3), plain.fingerprint, b_scale=b_scale)
    with_reader = engine_for(make_tiny_model("llama", seed=3), _tok(), reader_adapter=path, **kw)
    for e in (plain, with_reader):
        e.warm(CORPUS[1:4])
    return with_reader, plain


def _tok():
    from conftest import _trained_tokenizer

    return _trained_tokenizer()


def test_untrained_reader_changes_nothing(tmp_path):
    eng, plain = _pair(tmp_path, 0.0)
    for kw in ({"repair": "none"}, {"repair": "cacheblend", "recompute_ratio": 0.3}, {"repair": "full"}):
        a = eng.generate(_prompt(), max_new_tokens=8, store_prefix=False, **kw)
        b = plain.generate(_prompt(), max_new_tokens=8, store_prefix=False, **kw)
        assert a.token_ids == b.token_ids, kw
        assert torch.allclose(a.first_logits, b.first_logits, atol=1e-5), kw
        assert a.stats["reader"] == (kw["repair"] != "full")
        assert b.stats["reader"] is False


def test_gate_opens_only_where_reused_kv_is_read(tmp_path):
    eng, plain = _pair(tmp_path, 0.05)
    ids = eng.tokenize_ids(_prompt())
    ref = full_logits(plain.model, ids)
    # full recompute: the gate stays closed, so the answer is exactly the base model's
    full = eng.generate(_prompt(), max_new_tokens=8, repair="full", store_prefix=False)
    assert full.stats["reader"] is False
    assert torch.allclose(full.first_logits, ref, atol=1e-4)
    assert full.token_ids == plain.generate(_prompt(), max_new_tokens=8, repair="full", store_prefix=False).token_ids
    # CacheBlend keeping every candidate reads nothing approximate: closed too
    all_kept = eng.prefill(_prompt(), repair="cacheblend", recompute_ratio=1.0, store_prefix=False)
    assert all_kept.stats["reader"] is False
    assert torch.allclose(all_kept.last_logits, ref, atol=1e-4)
    # re-placed KV read as is: the tail runs through the adapter, so the logits move
    a = eng.prefill(_prompt(), repair="none", store_prefix=False)
    b = plain.prefill(_prompt(), repair="none", store_prefix=False)
    assert a.stats["reader"] is True
    assert not torch.allclose(a.last_logits, b.last_logits, atol=1e-3)
    # ... while every position before the last document keeps the base model's KV
    last_doc_end = len(ids) - len(eng.tokenize(_prompt())[-1].token_ids)
    for layer in range(len(a.cache.keys)):
        assert torch.allclose(a.cache.keys[layer][0, :, :last_doc_end], b.cache.keys[layer][0, :, :last_doc_end],
                              atol=1e-5)
        assert not torch.allclose(a.cache.values[layer][0, :, last_doc_end:len(ids)],
                                  b.cache.values[layer][0, :, last_doc_end:len(ids)], atol=1e-4)
    # the gate is closed again after a call: a plain HF forward on this thread is the base model
    assert torch.allclose(full_logits(eng.model, ids), ref, atol=1e-5)


def test_exact_prefix_hits_close_the_gate(tmp_path):
    eng, plain = _pair(tmp_path, 0.05)
    ids = eng.tokenize_ids(_prompt())
    eng.prefill(_prompt(), repair="full")  # stores the prompt's chunks as an exact prefix
    again = eng.prefill(_prompt(), repair="cacheblend")
    assert again.stats["reused_exact"] > 0 and again.stats["reused_approx"] == 0
    assert again.stats["reader"] is False
    assert torch.allclose(again.last_logits, full_logits(plain.model, ids), atol=1e-4)


def test_load_refuses_foreign_and_broken_adapters(tmp_path):
    eng, _ = _pair(tmp_path, 0.0)
    path = eng.config.reader_adapter
    with pytest.raises(ValueError, match="another base model"):
        ReaderAdapter.load(make_tiny_model("llama", seed=3), path, "f" * 64)
    with pytest.raises(ValueError, match="holds no"):
        ReaderAdapter.load(make_tiny_model("llama", seed=3), str(tmp_path / "missing"), eng.fingerprint)
    meta = json.load(open(os.path.join(path, META)))
    json.dump({**meta, "rank": 2}, open(os.path.join(path, META), "w"))  # the weights are rank 4
    with pytest.raises(ValueError, match="shape|do not match"):
        ReaderAdapter.load(make_tiny_model("llama", seed=3), path, eng.fingerprint)
    open(os.path.join(path, META), "w").write("{not json")
    with pytest.raises(ValueError, match="not a valid"):
        ReaderAdapter.load(make_tiny_model("llama", seed=3), path, eng.fingerprint)
    os.remove(os.path.join(path, WEIGHTS))
    with pytest.raises(ValueError, match="holds no"):
        engine_for(make_tiny_model("llama", seed=3), _tok(), reader_adapter=path)


def test_config_validation():
    from kvboost_core.config import EngineConfig

    with pytest.raises(TypeError, match="reader_adapter"):
        EngineConfig(reader_adapter=3)
    with pytest.raises(ValueError, match="store_repaired"):
        EngineConfig(reader_adapter="/x", store_repaired=True)


def test_distillation_moves_reused_answers_toward_full_prefill(tmp_path):
    """adapt's loss and loop, end to end on one prompt: training lowers KL(full prefill || served), and the
    engine loading the saved adapter serves logits closer to the full prefill than without it."""
    model = make_tiny_model("llama", seed=5)
    eng = engine_for(model, _tok())
    eng.warm(CORPUS[1:4])
    prompt = _prompt()
    segs = eng.tokenize(prompt)
    ids = [t for s in segs for t in s.token_ids]
    gate_from = len(ids) - len(segs[-1].token_ids)  # the question follows the last document
    pre = eng.prefill(prompt, repair="none", store_prefix=False)
    answer, logp = adapt.teacher(model, ids, 6, eos=set())
    sample = adapt.Sample(ids, gate_from, [k[:, :, :gate_from].clone() for k in pre.cache.keys],
                          [v[:, :, :gate_from].clone() for v in pre.cache.values], answer, logp)
    torch.manual_seed(0)
    reader = ReaderAdapter.attach(model, rank=4, alpha=8, base_fingerprint=eng.fingerprint)
    before = adapt.evaluate(model, reader, [sample])
    assert before["none_kl"] == pytest.approx(before["reader_kl"], abs=1e-6)  # B = 0: no change yet
    losses = adapt.train(model, reader, [sample], steps=40, lr=1e-2, seed=0, log=None)
    after = adapt.evaluate(model, reader, [sample])
    assert after["reader_kl"] < 0.5 * before["none_kl"], (before, after, losses[::10])
    assert after["none_kl"] == pytest.approx(before["none_kl"], rel=1e-5)  # the base weights did not move
    reader.save(str(tmp_path / "trained"))
    served = engine_for(make_tiny_model("llama", seed=5), _tok(), reader_adapter=str(tmp_path / "trained"))
    served.warm(CORPUS[1:4])
    ref = full_logits(model, ids)  # gate closed outside the engine: the base model

    def kl(x):
        return float(torch.sum(torch.softmax(ref, -1) * (torch.log_softmax(ref, -1) - torch.log_softmax(x, -1))))

    with_reader = served.prefill(prompt, repair="none", store_prefix=False).last_logits
    assert kl(with_reader) < 0.5 * kl(pre.last_logits)


def test_adapt_trains_with_the_adapters_one_loop(monkeypatch):
    """``kvboost-rag adapt`` has no loop of its own: it hands its loss to kvboost_rag.app.trainer.train (the loop
    ``adapt --block`` uses) with the reader's parameters, and returns that loop's losses."""
    from kvboost_rag.app import trainer

    calls = []

    def loop(params, n_samples, loss_at, **kw):
        calls.append((params, n_samples, kw))
        return trainer.TrainState(step=kw["steps"], losses=[0.5] * kw["steps"])

    monkeypatch.setattr(trainer, "train", loop)
    model = make_tiny_model("llama", seed=5)
    reader = ReaderAdapter.attach(model, rank=2, alpha=4)
    assert adapt.train(model, reader, [None] * 3, steps=7, lr=1e-3, seed=4, log=None) == [0.5] * 7
    (params, n, kw), = calls
    assert [id(p) for p in params] == [id(p) for p in reader.parameters()] and n == 3
    assert (kw["steps"], kw["lr"], kw["seed"]) == (7, 1e-3, 4)
    assert not any(p.requires_grad for p in model.parameters())


def test_batched_decode_refuses_a_reader(tmp_path):
    from kvboost_core.serving.batch import BatchedDecoder

    eng, _ = _pair(tmp_path, 0.0)
    with pytest.raises(ValueError, match="reader"):
        BatchedDecoder(eng.driver, 4)

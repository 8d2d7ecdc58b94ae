"""Block adapter: the training forward is the serving forward, served output equals an independent HF
construction, adapted and base cache entries never mix, and loading refuses foreign adapters."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import docs_prompt, engine_for

from kvboost_core.lora.block_adapter import TARGETS, BlockMeta, LoraHeader, save
from kvboost_core.lora.block_prefill import Run, block_forward, block_greedy, block_runs
from kvboost_core.lora.reader import ReaderAdapter
from kvboost_rag.app import adapt_block

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]
# a head shorter than sink_tokens (4 in engine_for): the first document's first tokens are computed, not placed
PROMPT = docs_prompt(DOCS, " Where was Alice born?", head="Q:")


def _setup(eng, prompt=PROMPT):
    eng.warm(DOCS)
    segs = eng.tokenize(prompt)
    ids = [t for s in segs for t in s.token_ids]
    return ids, block_runs(segs, eng.config.sink_tokens)


def test_block_runs_follow_the_lookup_rule(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer)
    ids, runs = _setup(eng)
    assert runs[0].doc is None and runs[-1].doc is None
    placed = [r for r in runs if r.doc is not None]
    assert len(placed) == len(DOCS)
    assert placed[0].start == eng.config.sink_tokens and placed[0].offset > 0  # straddles the sink
    assert all(r.offset == 0 for r in placed[1:])
    assert sum(r.end - r.start for r in runs) == len(ids)
    with pytest.raises(ValueError, match="contiguous"):
        block_runs(list(reversed(eng.tokenize(PROMPT))), 4)


def test_hf_construction_equals_engine_none(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer)
    ids, runs = _setup(eng)
    lead = list(eng._warm_prefix)
    pre = eng.prefill(PROMPT, repair="none", store_prefix=False)
    assert pre.token_ids == ids
    with torch.inference_mode():
        logits, _ = block_forward(tiny_llama, ids, runs, lead)
    assert (logits[-1] - pre.last_logits).abs().max() < 1e-4
    full = eng.prefill(PROMPT, repair="full", store_prefix=False).last_logits
    assert (full - pre.last_logits).abs().max() > 1e-3  # block attention is not full attention here
    first, tokens = block_greedy(tiny_llama, ids, runs, lead, 12, set())
    res = eng.generate(PROMPT, max_new_tokens=12, repair="none", store_prefix=False)
    assert res.token_ids == tokens
    # a run list that does not match the engine's placement gives other logits (the check can fail)
    shifted = [Run(r.start, r.end, r.doc, r.offset + 1) if r.doc is not None and r.offset == 0 else r for r in runs]
    with torch.inference_mode():
        other, _ = block_forward(tiny_llama, ids, shifted[:1] + [Run(shifted[0].end, len(ids))], lead)
    assert (other[-1] - pre.last_logits).abs().max() > 1e-3


def _train_tiny(model, tokenizer, out_dir, steps=4):
    """A tiny adapter trained for a few steps (recipe b: dense KL + hidden states) on the base model's own
    full-prefill answers, through the trainer's own loop."""
    from kvboost_rag.app import distill
    from kvboost_rag.app.trainer import train

    eng = engine_for(model, tokenizer)
    lead = list(eng._warm_prefix)
    targets = []
    for order in (DOCS, DOCS[::-1], DOCS[1:]):
        segs = eng.tokenize(docs_prompt(order, " Who is Bob?", head="Q:"))
        ids = [t for s in segs for t in s.token_ids]
        targets.append(distill.teacher_target(model, ids, block_runs(segs, eng.config.sink_tokens), 6, set()))
    lora = ReaderAdapter.attach(model, rank=4, alpha=8.0, base_fingerprint=eng.fingerprint)
    for p in model.parameters():
        p.requires_grad_(False)
    with lora.gated(True):
        st = train(lora.parameters(), len(targets),
                   lambda i: distill.student_loss(model, lead, targets[i], distill.RECIPES["b"]),
                   steps=steps, lr=2e-2, seed=0, log=lambda *_: None)
    assert all(torch.isfinite(torch.tensor(st.losses)))
    meta = BlockMeta(LoraHeader(4, 8.0, TARGETS, str(eng.fingerprint)), tuple(lead), eng.config.sink_tokens)
    save(str(out_dir), lora.state_dict(), meta)
    from safetensors.torch import load_file

    # the training forward on the weights as shipped (fp16-rounded), unmerged: the serving side merges them
    lora.load_state_dict({k: t.float() for k, t in load_file(str(out_dir / "block.safetensors")).items()})
    return eng, lora, lead


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("block")
    student = make_tiny_model("llama")
    eng, lora, lead = _train_tiny(student, tokenizer, out)
    ids, runs = _setup(eng)
    with torch.inference_mode(), lora.gated(True):
        train_logits, _ = block_forward(student, ids, runs, lead)
    return out, train_logits[-1], ids


def test_training_forward_equals_serving_forward(trained, tokenizer):
    out, train_logits, ids = trained
    eng = engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out))
    assert eng.config.repair == "none"  # a block adapter serves documents without repair by default
    eng.warm(DOCS)
    pre = eng.prefill(PROMPT, store_prefix=False)
    assert pre.token_ids == ids
    assert (pre.last_logits - train_logits).abs().max() < 1e-4
    base = engine_for(make_tiny_model("llama"), tokenizer)
    base.warm(DOCS)
    base_logits = base.prefill(PROMPT, repair="none", store_prefix=False).last_logits
    assert (base_logits - train_logits).abs().max() > 1e-3  # training moved the weights: the check can fail
    st = pre.stats
    assert st["reused_block"] > 0 and st["reused_approx"] == 0
    blended = eng.prefill(PROMPT, repair="cacheblend", recompute_ratio=0.3, store_prefix=False).stats
    assert blended["reused_block"] == 0 and blended["reused_approx"] > 0  # recompute breaks block-exactness


def test_served_answers_equal_independent_construction(trained, tokenizer):
    out, _, _ = trained
    model = make_tiny_model("llama")
    eng = engine_for(model, tokenizer, block_adapter=str(out))
    ids, runs = _setup(eng)
    res = eng.generate(PROMPT, max_new_tokens=16, store_prefix=False)
    first, tokens = block_greedy(model, ids, runs, list(eng._warm_prefix), 16, set())
    assert res.token_ids == tokens
    assert (res.first_logits - first).abs().max() < 1e-4


def test_adapted_and_base_entries_never_share_a_key(trained, tokenizer, tmp_path):
    out, _, _ = trained
    store = f"disk:{tmp_path / 'kv'}"
    base = engine_for(make_tiny_model("llama"), tokenizer, store=store)
    adapted = engine_for(make_tiny_model("llama"), tokenizer, store=store, block_adapter=str(out))
    assert adapted.fingerprint != base.fingerprint and adapted.base_fingerprint == base.fingerprint
    base.warm(DOCS)
    assert adapted.prefill(PROMPT, store_prefix=False).stats["hits_content"] == 0
    adapted.warm(DOCS)
    assert adapted.prefill(PROMPT, store_prefix=False).stats["hits_content"] > 0


def test_base_weights_restore_the_base_model(trained, tokenizer):
    out, _, _ = trained
    pristine = make_tiny_model("llama")
    eng = engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out))
    ids = torch.tensor([eng.tokenize_ids(PROMPT)])
    with torch.inference_mode():
        want = pristine(input_ids=ids).logits[0, -1]
        adapted = eng.model(input_ids=ids).logits[0, -1]
        with eng.block.base_weights():
            got = eng.model(input_ids=ids).logits[0, -1]
        again = eng.model(input_ids=ids).logits[0, -1]
    assert torch.equal(got, want)
    assert torch.equal(again, adapted) and not torch.equal(adapted, want)


def test_loading_refuses_foreign_adapters(trained, tokenizer, tmp_path):
    out, _, _ = trained
    with pytest.raises(ValueError, match="another base model"):
        engine_for(make_tiny_model("llama", seed=1), tokenizer, block_adapter=str(out))
    with pytest.raises(ValueError, match="lead-in"):
        engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out), warm_prefix=[5, 6])
    with pytest.raises(ValueError, match="holds no block.json"):
        engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(tmp_path))
    with pytest.raises(ValueError, match="cannot be combined"):
        engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out), reader_adapter=str(out))
    with pytest.raises(TypeError, match="block_adapter"):
        engine_for(make_tiny_model("llama"), tokenizer, block_adapter=3)


def test_verify_compares_with_the_block_prefill_and_reports_the_base_model(trained, tokenizer):
    out, _, _ = trained
    eng = engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out))
    eng.warm(DOCS)
    report = eng.verify([PROMPT], repairs=("none", "full"), max_new_tokens=8)
    none, full = report.summary()["none"], report.summary()["full"]
    assert none["max_abs_diff"] < 1e-4 and none["greedy_match"] == 1.0  # exact against its own block prefill
    assert full["max_abs_diff"] < 1e-4  # full recompute against the adapted model's full prefill
    assert none["base_mean_kl"] > 1e-6  # the adapted model is not the base model: reported separately
    base = engine_for(make_tiny_model("llama"), tokenizer)
    assert "base_mean_kl" not in base.verify([PROMPT], repairs=("full",), max_new_tokens=2).summary()["full"]


def test_block_plan_is_the_served_prompt_and_its_reference_the_served_answer(trained, tokenizer, monkeypatch):
    """kvboost_rag.app.block_reference: the one derivation (plan -> tokenize -> runs) the trainer, the RAG
    benchmark's block setting and the real-model test share; a wrong answer or prompt is told apart."""
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.bench.rag_chat import user_message
    from kvboost_rag.app.block_reference import block_plan, block_reference, served_as_reference

    out, _, _ = trained
    rag = KVBoostRAG(engine_for(make_tiny_model("llama"), tokenizer, block_adapter=str(out)))
    rag.warm_documents(DOCS, progress=False)
    prompt = user_message("Where was Alice born?", DOCS)
    plan = block_plan(rag, prompt, True)
    assert plan.documents == len(DOCS) and sum(r.doc is not None for r in plan.runs) == len(DOCS)
    res = rag.generate(prompt, max_new_tokens=12, add_special_tokens=True, store_prefix=False)
    assert res.stats["reused_block"] > 0 and res.stats["reused_approx"] == 0
    assert plan.ids == list(res.prompt_token_ids)
    first, tokens = block_reference(rag, plan, 12)
    assert tokens == list(res.token_ids) and (first - res.first_logits).abs().max() < 1e-4
    assert served_as_reference(rag, prompt, True, res.prompt_token_ids, res.token_ids, 12)
    wrong = [*res.token_ids[:-1], (res.token_ids[-1] + 1) % len(tokenizer)]
    assert not served_as_reference(rag, prompt, True, res.prompt_token_ids, wrong, 12)
    assert not served_as_reference(rag, prompt, True, res.prompt_token_ids[1:], res.token_ids, 12)
    assert block_plan(rag, "Where was Alice born?", True).documents == 0
    # the trainer's target is that plan, with the base model's full-prefill answer as the teacher
    monkeypatch.setattr(rag, "chat_prompt", lambda msgs: msgs[-1]["content"])
    monkeypatch.setattr(rag, "chat_add_special_tokens", lambda text: True)
    target = adapt_block.chat_target(rag, [{"role": "user", "content": prompt}], DOCS, 6)
    assert target is not None and target.ids == plan.ids and target.runs == plan.runs
    assert adapt_block.chat_target(rag, [{"role": "user", "content": "Who?"}], [], 6) is None


def test_dev_targets_refuse_another_selection(monkeypatch, tmp_path):
    """Dev shards hold chats by index: a limited selection gets its own directory, and targets of other
    questions (a directory written for another selection) are refused rather than scored."""
    from types import SimpleNamespace

    from kvboost_rag.app import distill
    from kvboost_rag.app import rag_corpus as rc

    sets = rc.retrieval_sets(rc.load_corpus("dev"), adapt_block.DEV_K, 0)
    roots = []

    def fake(root, n, make, **_):
        roots.append(root)
        return [SimpleNamespace(kind=q.id) for q, _ in sets[:n]]  # the first n, not the selection's spread

    monkeypatch.setattr(distill, "build_targets", fake)
    assert len(adapt_block.dev_targets(None, str(tmp_path / "dev"), 6)) == len(sets)
    with pytest.raises(RuntimeError, match="another selection"):
        adapt_block.dev_targets(None, str(tmp_path / "dev"), 6, limit=len(sets) // 2)
    assert roots == [str(tmp_path / "dev"), f"{tmp_path / 'dev'}-{len(sets) // 2}"]


def test_evaluate_full_attention_arm(trained, tokenizer):
    """``evaluate(full=True)``: each gate's own full prefill. On the base weights it is the teacher itself, so
    its accuracy equals the reference's and block reading's cost is the block arm's difference."""
    from types import SimpleNamespace

    from kvboost_rag.app import distill
    from kvboost_rag.app import rag_corpus as rc

    model = make_tiny_model("llama")
    eng = engine_for(model, tokenizer)
    lead = list(eng._warm_prefix)
    lora = ReaderAdapter.attach(model, rank=4, alpha=8.0, base_fingerprint=eng.fingerprint)
    qs = rc.load_corpus("dev").questions[:3]
    targets = []
    for q, order in zip(qs, (DOCS, DOCS[::-1], DOCS[1:])):
        segs = eng.tokenize(docs_prompt(order, " Who is Bob?", head="Q:"))
        ids = [t for s in segs for t in s.token_ids]
        targets.append(distill.teacher_target(model, ids, block_runs(segs, eng.config.sink_tokens), 6, set(),
                                              kind=q.id))
    rag = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[], model=model))
    out = adapt_block.evaluate(rag, lora, lead, targets, 6, gates=(None,), full=True)
    base = out["base"]
    assert base["full_acc"] == out["full_acc"]
    assert base["block_cost"]["diff"] == pytest.approx(base["diff"])
    assert base["full_answer_kl"] < 2e-3  # the base model's full prefill is the teacher
    torch.manual_seed(2)
    with torch.no_grad():
        for p in lora.parameters():
            p.normal_(0, 0.3)
    moved = adapt_block.evaluate(rag, lora, lead, targets, 6, gates=(True,), full=True)["adapted"]
    assert moved["full_answer_kl"] > 1e-2  # weights that move the full prefill show in its KL

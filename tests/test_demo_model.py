"""The embedded demo model (kvboost_rag/app/assets/demo_model): shape, size, and held-out RAG accuracy.

Accuracy is exact match of the greedy answer on held-out questions about entities never seen in training,
with their documents (gold and distractors) in the prompt. The floor lives in metrics.json next to the model
(written by scripts/train_demo_model.py, and quoted in MODEL_CARD.md).
"""

from __future__ import annotations

import json

import pytest

from kvboost_rag.app import demo_data as dd

N_QUESTIONS = 60  # scripts/train_demo_model.py measures the floor on this same subset

pytestmark = pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is not built")


@pytest.fixture(scope="module")
def rag():
    import torch

    from kvboost_core.engine import KVEngine
    from kvboost_rag import KVBoostRAG

    # 3M parameters: one thread is faster than two (thread sync dominates, and collapses on shared cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    r = KVBoostRAG(KVEngine.from_pretrained(str(dd.DEMO_MODEL_DIR), device="cpu"))
    needed = {i for q in dd.load_heldout()[:N_QUESTIONS] for i in q["context_ids"]}
    r.warm_documents([d["text"] for d in dd.load_corpus() if d["id"] in needed], progress=False)
    yield r
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def metrics():
    return json.loads((dd.DEMO_MODEL_DIR / "metrics.json").read_text())


def test_shape_and_size():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(dd.DEMO_MODEL_DIR)
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.max_position_embeddings >= 2048
    assert (dd.DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20


def test_card_quotes_the_floor(metrics):
    card = (dd.DEMO_MODEL_DIR / "MODEL_CARD.md").read_text()
    assert f"{metrics['floor']:.1%}" in card
    assert 0.0 <= metrics["floor"] < 1.0


def test_closed_book_control(rag, metrics, report):
    """Without its documents the model must not know the answers (it reads them, it did not memorise them)."""
    qs = dd.load_heldout()[:N_QUESTIONS]
    closed = dd.accuracy(dd.evaluate_closed_book(rag, qs))
    report.append(f"demo model closed-book control, {len(qs)} questions: {closed:.0%} "
                  f"(open-book floor {metrics['floor']:.0%})")
    assert closed <= 0.15
    assert closed < metrics["floor"] / 2


def test_corpus_and_questions_are_regenerated_identically():
    """The bundled files are exactly what demo_data generates (no hand edits, no drift from the code)."""
    docs, world = dd.make_corpus()
    assert [d.text for d in docs] == [d["text"] for d in dd.load_corpus()]
    qs = dd.make_heldout(docs, world)
    assert [(q.question, q.answer, q.context_ids) for q in qs] == [
        (q["question"], q["answer"], q["context_ids"]) for q in dd.load_heldout()]


def test_every_answer_step_is_a_fact_in_its_gold_documents():
    """The format's contract: each step "<subject> <relation> <value>" of a trained answer is a sentence of one
    of the question's gold documents, and the gold documents are in its context. (If a step were not, the model
    would be trained to answer what its prompt does not say.)"""
    corpus = {d["id"]: d["text"] for d in dd.load_corpus()}
    qs = dd.load_heldout()
    assert {q["hops"] for q in qs} == {1, 2}
    for q in qs:
        steps = q["target"].split(dd.CHAIN_SEPARATOR)
        assert len(steps) == q["hops"] and dd.normalize_answer(q["target"]) == q["answer"].lower()
        assert set(q["doc_ids"]) <= set(q["context_ids"])
        facts = {fact for i in q["doc_ids"] for fact in corpus[i].rstrip(".").split(". ")}
        for step in steps:
            assert step in facts, (q["question"], step, facts)


def test_keys_and_values_are_single_tokens():
    """Two-token induction needs every subject, relation and value to be one token after a space."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dd.DEMO_MODEL_DIR)
    words = {w for d in dd.load_corpus() for w in d["text"].replace(".", "").split()} | set(dd.RELATIONS)
    multi = [w for w in sorted(words) if len(tok(" " + w, add_special_tokens=False)["input_ids"]) != 1]
    assert not multi, multi[:10]


def test_heldout_accuracy_above_floor(rag, metrics, report):
    qs = dd.load_heldout()[:N_QUESTIONS]
    assert len(qs) >= 40
    corpus = {d["id"]: d["text"] for d in dd.load_corpus()}
    full = dd.evaluate(rag, qs, corpus, repair="full")
    blend = dd.evaluate(rag, qs, corpus, repair="cacheblend")
    report.append(f"demo model, {len(qs)} held-out questions (exact match): full prefill "
                  f"{dd.accuracy(full):.0%} (single-hop {dd.accuracy(full, 1):.0%}, two-hop "
                  f"{dd.accuracy(full, 2):.0%}); cacheblend {dd.accuracy(blend):.0%} (single-hop "
                  f"{dd.accuracy(blend, 1):.0%}, two-hop {dd.accuracy(blend, 2):.0%}, mean reuse ratio "
                  f"{sum(r.reuse_ratio for r in blend) / len(blend):.0%}); floor {metrics['floor']:.0%}")
    same = sum(dd.normalize_answer(a.generated) == dd.normalize_answer(b.generated) for a, b in zip(full, blend))
    report.append(f"  cacheblend gives the full-prefill answer on {same}/{len(qs)} questions "
                  f"(floor {metrics['agreement_floor']:.0%})")
    assert sum(r.reuse_ratio for r in blend) / len(blend) > 0.3, "cacheblend did not reuse the documents"
    assert dd.accuracy(full) >= metrics["floor"]
    assert same / len(qs) >= metrics["agreement_floor"]

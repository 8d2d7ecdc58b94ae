"""The questions without documents (issue #32, item 5) and their base-vs-adapted evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_tiny_model

from kvboost_core.lora.reader import ReaderAdapter
from kvboost_rag.app import nodoc


def test_questions_load():
    qs = nodoc.load_questions()
    assert len(qs) == 64
    kinds = {k: sum(1 for q in qs if q.kind == k) for k in nodoc.KINDS}
    assert all(n >= 16 for n in kinds.values()), kinds
    assert sum(kinds.values()) == len(qs)
    assert len({q.id for q in qs}) == len(qs)
    assert len({q.question for q in qs}) == len(qs)
    for q in qs:
        assert q.answer.strip() and q.question.strip()
        assert all(a.strip() for a in q.aliases)
        # the gold answer counts as right for itself, under the RAG corpus's rule
        assert nodoc.is_correct(q.answer, q)


def test_arithmetic_answers_are_digits_with_word_aliases():
    for q in nodoc.load_questions():
        if q.kind == "arithmetic":
            assert q.answer.isdigit(), q
            assert q.aliases and all(not a.isdigit() for a in q.aliases), q


def test_is_correct_containment():
    q = next(q for q in nodoc.load_questions() if q.answer == "Paris")
    assert nodoc.is_correct("The capital of France is PARIS.", q)
    assert not nodoc.is_correct("Lyon", q)
    seven = nodoc.NoDocQuestion("x", "arithmetic", "What is 3 + 4?", "7", ("seven",))
    assert nodoc.is_correct("Seven.", seven) and nodoc.is_correct("3 + 4 = 7", seven)
    assert not nodoc.is_correct("17", seven)


def test_messages():
    q = nodoc.load_questions()[0]
    assert nodoc.messages(q) == [{"role": "system", "content": "You are a helpful assistant. Be brief."},
                                 {"role": "user", "content": q.question}]


@pytest.mark.parametrize("data", [
    {"version": 2, "questions": [{"id": "a", "kind": "fact", "question": "q?", "answer": "a"}]},
    {"version": 1, "questions": []},
    {"version": 1, "questions": [{"id": "a", "kind": "riddle", "question": "q?", "answer": "a"}]},
    {"version": 1, "questions": [{"id": "a", "kind": "fact", "question": "q?", "answer": ""}]},
    {"version": 1, "questions": [{"id": "a", "kind": "fact", "question": "q?", "answer": "a", "aliases": "b"}]},
    {"version": 1, "questions": [{"id": "a", "kind": "fact", "question": "q?", "answer": "a"},
                                 {"id": "a", "kind": "fact", "question": "r?", "answer": "b"}]},
    [1, 2],
])
def test_malformed_file(tmp_path, data):
    path = tmp_path / "q.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="q.json"):
        nodoc.load_questions(path)


def test_not_json(tmp_path):
    path = tmp_path / "q.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        nodoc.load_questions(path)


def _chat_ids(tokenizer):
    def ids(msgs):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return ids


def test_evaluate_base_only(tokenizer):
    model = make_tiny_model("llama")
    out = nodoc.evaluate(model, tokenizer, _chat_ids(tokenizer), {tokenizer.eos_token_id}, max_new_tokens=4)
    assert out["gates"] == ["base"] and out["n"] == 64 and "paired" not in out
    acc = out["accuracy"]["base"]
    assert 0.0 <= acc["accuracy"] <= 1.0
    assert set(acc["per_kind"]) == set(nodoc.KINDS)
    assert len(out["answers"]) == 64 and all(isinstance(a["base"]["answer"], str) for a in out["answers"])
    json.dumps(out, allow_nan=False)


def test_evaluate_gates_need_lora(tokenizer):
    with pytest.raises(ValueError, match="lora"):
        nodoc.evaluate(make_tiny_model("llama"), tokenizer, _chat_ids(tokenizer), {1}, gates=(None, True))


def test_evaluate_untrained_adapter_matches_base(tokenizer):
    """B = 0: the adapted model is the base model, so both gates answer alike and the paired diff is 0."""
    model = make_tiny_model("llama")
    lora = ReaderAdapter.attach(model, rank=4, alpha=8.0)
    out = nodoc.evaluate(model, tokenizer, _chat_ids(tokenizer), {tokenizer.eos_token_id}, max_new_tokens=6,
                         gates=(None, True), lora=lora)
    assert out["gates"] == ["base", "adapted"]
    for name in out["gates"]:
        assert 0.0 <= out["accuracy"][name]["accuracy"] <= 1.0
    assert all(a["base"] == a["adapted"] for a in out["answers"])
    paired = out["paired"]
    assert paired["reference"] == "base" and paired["setting"] == "adapted" and paired["n"] == 64
    assert paired["diff"] == 0 and paired["lost"] == paired["gained"] == 0 and paired["mcnemar_p"] == 1.0
    json.dumps(out, allow_nan=False)


def test_evaluate_trained_adapter_changes_answers(tokenizer):
    """A nonzero B must reach the adapted gate only: the answers differ, the base gate's equal a plain run's."""
    qs = nodoc.load_questions()[:8]
    eos = {tokenizer.eos_token_id}
    plain = nodoc.evaluate(make_tiny_model("llama"), tokenizer, _chat_ids(tokenizer), eos, max_new_tokens=6,
                           questions=qs)
    model = make_tiny_model("llama")
    lora = ReaderAdapter.attach(model, rank=4, alpha=8.0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lora.parameters():
            if p.shape[1] == 4:  # lora_b (out, rank)
                p.normal_(0, 0.5)
    out = nodoc.evaluate(model, tokenizer, _chat_ids(tokenizer), eos, max_new_tokens=6, gates=(None, True),
                         lora=lora, questions=qs)
    assert [a["base"] for a in out["answers"]] == [a["base"] for a in plain["answers"]]
    assert any(a["base"]["answer"] != a["adapted"]["answer"] for a in out["answers"])
    assert not math.isnan(out["paired"]["diff"])

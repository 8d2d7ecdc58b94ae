"""The chat-turns benchmark's pure parts (issue 33, item 5): the conversation plan, llama.cpp's skip reason,
the per-turn summary and its table. No model runs here."""

from __future__ import annotations

import importlib.util

from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.bench import chat_turns as ct


def test_plan_shows_k_documents_then_follow_ups_and_one_added_document():
    corpus = rc.load_corpus("tune")
    plan = ct.plan_conversation(corpus, k=5, turns=6, seed=3)
    assert [len(docs) for docs, _ in plan] == [5, 0, 0, 1, 0, 0]
    shown = {d.id for d in plan[0][0]}
    assert plan[0][1].doc_id in shown and plan[3][0][0].id not in shown  # turn 4's document is new
    assert plan[3][1].doc_id == plan[3][0][0].id
    shown.add(plan[3][0][0].id)
    assert all(q.doc_id in shown for _, q in plan)  # follow-ups ask about documents in the chat
    assert len({q.id for _, q in plan}) == 6
    assert ct.plan_conversation(corpus, 5, 6, 3) == plan  # deterministic in its seed


def test_common_prefix():
    assert ct.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert ct.common_prefix([], [1]) == 0 and ct.common_prefix([1, 2], [1, 2, 3]) == 2


def test_llamacpp_is_skipped_without_llama_cpp(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert "llama_cpp is not installed" in (ct.llamacpp_skip_reason("smollm2-135m-instruct") or "")


def _row(turn: int, conv: int, hf: float, llama: float | None, kv: float) -> dict:
    row = {"conversation": conv, "turn": turn, "prompt_tokens": 1000 + turn, "new_doc": turn == 1,
           "hf": {"ttft_s": hf}, "kvboost_think_backfill": {"ttft_s": kv, "exact": 0.9, "same_answer": True,
                                                           "top1": True, "backfill_cpu_s": 0.5,
                                                           "backfill_wall_s": 0.6}}
    if llama is not None:
        row["llamacpp"] = {"ttft_s": llama, "reused": 0.9, "top1": True}
    return row


def test_summary_speedups_are_ratios_of_medians_and_a_skipped_method_has_no_column():
    rows = [_row(2, 0, 4.0, 0.2, 0.4), _row(2, 1, 6.0, 0.4, 0.2), _row(2, 2, 5.0, 0.3, 0.3)]
    (p,) = ct.summarize(rows, ["backfill"])
    kv = p["kvboost_think_backfill"]
    assert p["hf_ttft_s"] == 5.0 and kv["ttft_s"] == 0.3 and kv["vs_hf"] == 5.0 / 0.3
    assert kv["vs_llamacpp"] == 1.0 and kv["same_answer"] == 3
    table = ct.markdown_table({"per_turn": [p], "think": ["backfill"]})
    assert "16.67x faster vs HF, 1.00x faster vs llama.cpp" in table and "kvboost, think backfill" in table
    (q,) = ct.summarize([_row(2, 0, 4.0, None, 8.0)], ["backfill"])
    assert "llamacpp" not in q and q["kvboost_think_backfill"]["vs_llamacpp"] is None
    table = ct.markdown_table({"per_turn": [q], "think": ["backfill"]})
    assert "skipped" in table and "2.00x slower vs HF" in table and "vs llama.cpp" not in table


def test_exact_turns_have_their_own_column_at_think_0_only():
    row = _row(2, 0, 4.0, 0.2, 0.4)
    cell = dict(row["kvboost_think_backfill"], ttft_s=0.5)
    row |= {"exact_think_0": cell, "exact_think_backfill": cell, "kvboost_think_0": cell}
    (p,) = ct.summarize([row], ["0", "backfill"])
    assert {"exact_think_0", "exact_think_backfill", "kvboost_think_0"} <= set(p)
    head = ct.markdown_table({"per_turn": [p], "think": ["0", "backfill"]}).splitlines()[0]
    assert "kvboost exact turns, think 0" in head and "exact turns, think backfill" not in head
    assert head.index("kvboost, think 0") < head.index("kvboost exact turns, think 0")

"""The multi-turn benchmark's conversation plan (tune split only, follow-ups over retrieved documents, new
retrievals on some turns) and its per-turn summary. The timed run itself is a benchmark, not a test."""

from __future__ import annotations

import pytest

from kvboost_rag.app import rag_corpus as rc
from kvboost_rag.app.bench.multiturn import (
    RETRIEVE_TURNS,
    Reuse,
    Turn,
    main,
    plan_conversation,
    summarize,
    user_turn,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_retrieves_on_some_turns_and_follows_up_on_shown_documents(seed):
    corpus = rc.load_corpus("tune")
    plan = plan_conversation(corpus, k=10, turns=8, seed=seed)
    assert len(plan) == 8
    shown: set[str] = set()
    for t, (docs, q) in enumerate(plan, start=1):
        assert bool(docs) == (t in RETRIEVE_TURNS)
        ids = {d.id for d in docs}
        assert not ids & shown  # a retrieval brings documents not in the history yet
        if docs:
            assert len(docs) == 10 and q.doc_id in ids
        shown |= ids
        assert q.doc_id in shown  # every question is answerable from the history
    assert len({q.id for _, q in plan}) == 8  # no question asked twice
    assert "Documents:" in user_turn(["a"], "q?") and user_turn([], "q?") == "Question: q?"


def _turn(turn: int, conv: int, apc_hit: float, hit: float, approx: float, same: bool) -> Turn:
    kv = {"defaults": Reuse(0.5, hit, hit - approx, approx, approx == 0, same, 0.0),
          "backfill": Reuse(0.25, max(hit, apc_hit), max(hit, apc_hit), 0.0, True, True, 1.5)}
    return Turn(conv, turn, turn == 1, 100 * turn, 2.0, 1.0, apc_hit, True, kv)


def test_summary_reports_speedups_hits_and_exact_only_answers():
    rows = [_turn(1, 0, 0.0, 0.8, 0.8, False), _turn(2, 0, 0.9, 0.95, 0.0, True),
            _turn(1, 1, 0.0, 0.7, 0.7, True), _turn(2, 1, 0.9, 0.85, 0.0, False)]
    s = summarize(rows)
    assert [p["turn"] for p in s] == [1, 2]
    d, b = s[0]["kvboost"]["defaults"], s[1]["kvboost"]["defaults"]
    assert d["speedup"] == pytest.approx(4.0) and s[0]["apc_speedup"] == pytest.approx(2.0)
    assert b["exact_only_turns"] == 2 and b["exact_only_same_answer"] == 1
    assert d["hit_at_least_apc"] and not b["hit_at_least_apc"]
    bf = s[1]["kvboost"]["backfill"]
    assert bf["speedup"] == pytest.approx(8.0) and bf["hit_at_least_apc"] and bf["backfill_s"] == 1.5


def test_cli_refuses_unknown_variants(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--variants", "defaults,nope"])
    assert e.value.code == 2 and "--variants" in capsys.readouterr().err

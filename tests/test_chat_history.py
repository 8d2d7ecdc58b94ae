"""A chat's history is exact from turn 2 on (issue 33): chat calls (``history_tokens``) never re-place the
history's documents, backfill every turn from the first as canonical chunks, and give bitwise the same output
whether the history comes from the store (backfilled), is being backfilled, or was evicted (computed now)."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS
from helpers import compare_logits, engine_for, full_logits

from kvboost_core import Segment
from kvboost_core.engine import KVEngine
from kvboost_core.serving.backfill import conversation_job, run_job

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]
QUESTIONS = [" Where was Alice born?", " And where did she go next?", " Why?"]
KW = dict(repair="cacheblend", recompute_ratio=0.3)


def _warmed(model, tok, **kw):
    eng = engine_for(model, tok, **{**KW, **kw})
    eng.warm(CORPUS[:5])
    return eng


def _ids(eng, text):
    return eng.tokenize_ids(Segment(text=text), add_special_tokens=False)


def _prompt(eng, answers):
    """Turn ``len(answers) + 1`` of a chat over DOCS, and its history's length in tokens: the documents (a
    warmed, re-placeable segment each) and one text segment holding every question and answer so far, as a chat
    template renders a chat whose first user message holds the documents."""
    tail: list[int] = []
    for q, a in zip(QUESTIONS, answers):
        tail += _ids(eng, q) + list(a)
    history = len(tail)
    tail += _ids(eng, QUESTIONS[len(answers)])
    segs = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=tail)]
    doc_len = len(eng.tokenize_ids([Segment(text=d, cacheable=True) for d in DOCS]))
    return segs, (doc_len + history) if answers else 0


def _chat(eng, turns=3, *, evict=False, wait=True):
    """Run a chat; each turn's (result, history tokens)."""
    answers: list[list[int]] = []
    out = []
    for _ in range(turns):
        segs, history = _prompt(eng, answers)
        if evict:
            eng.store.clear()
            eng.warm(CORPUS[:5])
        res = eng.generate(segs, max_new_tokens=5, history_tokens=history)
        if wait:
            assert eng.wait_backfill(timeout=60)
        answers.append(res.token_ids)
        out.append((res, history))
    return out


def test_turn_two_finds_its_history_exact_after_turn_one(tiny_llama, tokenizer):
    eng = _warmed(tiny_llama, tokenizer)
    (first, _), (second, h2), (third, h3) = _chat(eng)
    assert first.stats["reused_approx"] > 0  # turn 1 re-placed its documents
    assert eng.stats()["backfill_tokens"] > 0
    # turn 2's history is the whole of turn 1 (prompt and answer): all of it reused exactly, nothing re-placed
    assert h2 == len(first.prompt_token_ids) + len(first.token_ids)
    assert second.stats["reused_exact"] == h2 and second.stats["reused_approx"] == 0
    assert third.stats["reused_exact"] == h3 and third.stats["reused_approx"] == 0
    ids = second.prompt_token_ids
    assert compare_logits(full_logits(tiny_llama, ids), second.first_logits)["max_abs_diff"] < 1e-4


def test_without_the_backfill_turn_two_is_not_exact(tiny_llama, tokenizer):
    """The check above can fail: with backfill off, turn 2 computes its history now (exactly, never re-placed)
    rather than reading it from the store."""
    eng = _warmed(tiny_llama, tokenizer, backfill=False)
    (first, _), (second, h2), _ = _chat(eng)
    assert eng.stats()["backfill_tokens"] == 0
    assert second.stats["reused_exact"] < h2 - eng.config.chunk_size
    assert second.stats["reused_approx"] == 0 and second.stats["computed"] > h2 // 2


def _same(a, b):
    assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids
    assert torch.equal(a.first_logits, b.first_logits)


def _recording(eng):
    """Keys of the prefix entries stored from now on (the backfill's and the calls' canonical chunks)."""
    keys: list = []
    put = eng.store.put

    def record(key, block, **kw):
        if block.kind == "prefix":
            keys.append(key)
        return put(key, block, **kw)

    eng.store.put = record
    return keys


def test_chat_output_is_bitwise_the_same_cold_warm_mid_backfill_and_evicted(tiny_llama, tokenizer):
    warm = _warmed(tiny_llama, tokenizer)
    stored = _recording(warm)
    ref = _chat(warm)  # each turn after the previous turn's backfill finished: its history from the store
    assert ref[2][0].stats["reused_exact"] > 0
    answers = [r.token_ids for r, _ in ref]
    for t in (1, 2):
        segs, history = _prompt(warm, answers[:t])
        # cold: a new engine with the same warmed documents, no history in its store
        cold = _warmed(tiny_llama, tokenizer, backfill=False)
        _same(ref[t][0], cold.generate(segs, max_new_tokens=5, history_tokens=history))
        # mid-backfill: the previous turn's backfill stopped after its first step
        mid = _warmed(tiny_llama, tokenizer, backfill=False)
        prev, prev_history = _prompt(mid, answers[:t - 1])
        steps = iter([True, False])
        segs_t, _, chunks = mid.prompt_chunks(prev, None)
        job = conversation_job(segs_t, chunks, answers[t - 1], mid.spans, canonical=True)
        part = run_job(job, mid._backfill_step, step_tokens=32, may_continue=steps.__next__)
        assert not part.complete and 0 < part.computed < len(job.token_ids)
        got = mid.generate(segs, max_new_tokens=5, history_tokens=history)
        assert 0 < got.stats["reused_exact"] < ref[t][0].stats["reused_exact"]
        _same(ref[t][0], got)
    # evicted: the backfilled entries gone (the middle ones first, then all), the documents still warm
    segs, history = _prompt(warm, answers[:2])
    for key in stored[len(stored) // 3: 2 * len(stored) // 3]:
        warm.store.delete(key)
    again = warm.generate(segs, max_new_tokens=5, history_tokens=history, store_prefix=False)
    assert again.stats["reused_exact"] < ref[2][0].stats["reused_exact"]
    _same(ref[2][0], again)
    for key in stored:
        warm.store.delete(key)
    _same(ref[2][0], warm.generate(segs, max_new_tokens=5, history_tokens=history, store_prefix=False))


def test_chat_history_survives_a_restart_from_the_disk_tier(tiny_llama, tokenizer, tmp_path):
    """A chat backfilled into a memory + disk store, then a new engine (a restarted process: empty memory tier)
    over the same directory: its next turn reads the whole history from disk, bitwise as the first engine."""
    tiers = ["memory", f"disk:{tmp_path}"]
    first = _warmed(tiny_llama, tokenizer, store=tiers)
    ref = _chat(first)
    answers = [r.token_ids for r, _ in ref]
    restarted = _warmed(tiny_llama, tokenizer, store=tiers)
    segs, history = _prompt(restarted, answers[:2])
    got = restarted.generate(segs, max_new_tokens=5, history_tokens=history)
    assert got.stats["reused_exact"] >= history > 0 and got.stats["reused_approx"] == 0
    _same(ref[2][0], got)


def test_one_shot_completions_keep_their_path_and_bad_history_is_refused(tiny_llama, tokenizer):
    eng = _warmed(tiny_llama, tokenizer)
    segs, _ = _prompt(eng, [])
    eng.generate(segs, max_new_tokens=3)  # no history_tokens: a one-shot completion, not backfilled
    assert eng.wait_backfill(timeout=60) and eng.stats()["backfill_tokens"] == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="history_tokens"):
            eng.generate(segs, max_new_tokens=3, history_tokens=bad)
    with pytest.raises(ValueError, match="longer than the prompt"):
        eng.generate(segs, max_new_tokens=3, history_tokens=10**6)


@pytest.mark.parametrize("backfill", ["auto", False])
def test_chat_kvboost_turn_two_history_is_exact_after_turn_one(backfill):
    """Through LangChain: the first turn re-places the warmed documents of its user message; its reply is
    backfilled, so turn 2 reads the whole history (documents, question, reply) exactly and re-places nothing.
    Without the backfill turn 2 computes its history now (exactly, never re-placed) and reads none of it."""
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_kvboost import ChatKVBoost

    from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(layers=2)
    chat = ChatKVBoost(engine=KVEngine(model, tok, backfill=backfill, repair="cacheblend", recompute_ratio=0.3),
                       max_tokens=6)
    facts = synthetic_facts(6)
    chat.rag.warm_documents(facts)
    messages = [SystemMessage("Answer from the records."),
                HumanMessage("Records:\n" + "\n".join(facts[:3]) + "\nQuestion: where does Dana live?")]
    stats = []
    for question in ("And her job?", "Thanks."):
        reply = chat.invoke(messages)
        stats.append(reply.response_metadata["kvboost"] | {"history": chat.last_stats["chat_history_tokens"]})
        assert chat.rag.engine.wait_backfill(timeout=60)
        messages += [AIMessage(reply.content), HumanMessage(question)]
    reply = chat.invoke(messages)
    stats.append(chat.last_stats)
    assert stats[0]["history"] == 0 and stats[0]["cached_tokens_approximate"] > 0  # turn 1 re-placed documents
    assert chat.last_stats["reused_approx"] == 0
    second = stats[1]
    assert second["history"] > 0 and stats[2]["chat_history_tokens"] > second["history"]
    if backfill:
        assert second["cached_tokens"] == second["history"] and second["cached_tokens_approximate"] == 0
        assert stats[2]["reused_exact"] == stats[2]["chat_history_tokens"]
    else:
        assert second["cached_tokens"] < second["history"] // 2 and second["cached_tokens_approximate"] == 0


# ---- a history cut per message (turn_end): each backfill computes only what its turn added ----

def _marked_chat(eng, turns, marker, *, wait=True):
    """A chat whose messages each end with ``marker`` (the ids a chat template writes after a message), run
    with ``turn_end=marker``: each turn's (result, history tokens, the backfill job's tokens)."""
    answers: list[list[int]] = []
    out = []
    for t in range(turns):
        tail: list[int] = []
        for q, a in zip(QUESTIONS * 3, answers):
            tail += _ids(eng, q) + marker + a
        history = len(tail)
        tail += _ids(eng, (QUESTIONS * 3)[t]) + marker
        segs = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=tail)]
        doc_len = len(eng.tokenize_ids([Segment(text=d, cacheable=True) for d in DOCS]))
        history = doc_len + history if answers else 0
        res = eng.generate(segs, max_new_tokens=6, history_tokens=history, turn_end=marker)
        if wait:
            assert eng.wait_backfill(timeout=60)
        answers.append(eng.turn_answer(res.token_ids, res.text, marker))
        out.append((res, history, len(res.prompt_token_ids) + len(answers[-1])))
    return out


def test_a_follow_ups_backfill_computes_only_its_new_question_and_answer(tiny_llama, tokenizer):
    """Issue 33: the backfill used to re-cut the last message's chunk (ending at the old history end) and compute
    again everything from the last natural chunk boundary before it, up to a chunk more than the turn added.
    Cut after every message, it finds the whole history the turn read, and computes only tokens after it."""
    eng = _warmed(tiny_llama, tokenizer)
    marker = _ids(eng, "\n##\n")
    chat = _marked_chat(eng, 5, marker)
    jobs = eng.backfill_results[-5:]
    assert [j.tokens for j in jobs] == [n for _, _, n in chat] and all(j.complete for j in jobs)
    for (res, history, _), job in zip(chat[1:], jobs[1:]):
        assert res.stats["reused_exact"] == history and res.stats["reused_approx"] == 0
        # the history the turn read is found whole (and the turn's own exact tail, stored by the call)
        assert job.reused_exact >= history and job.computed == job.tokens - job.reused_exact
    # the same chat without turn_end re-cuts: some follow-up's backfill computes more than its turn added
    plain = _warmed(tiny_llama, tokenizer)
    extra = 0
    for res, history, _ in chat:
        segs = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=res.prompt_token_ids[
            len(plain.tokenize_ids([Segment(text=d, cacheable=True) for d in DOCS])):])]
        plain.generate(segs, max_new_tokens=6, history_tokens=history)
        assert plain.wait_backfill(timeout=60)
        job = plain.backfill_results[-1]
        if history:
            extra += max(0, history - job.reused_exact)  # history tokens the backfill computed again
    assert extra > 0


def test_turn_end_cuts_keep_the_output_bitwise_the_same_in_every_store_state(tiny_llama, tokenizer):
    """With turn_end, a turn's output is the same whether its history comes from the store, from a cold
    engine (computed now), or after the backfilled entries were evicted; and its logits are full prefill's."""
    warm = _warmed(tiny_llama, tokenizer)
    marker = _ids(warm, "\n##\n")
    ref = _marked_chat(warm, 4, marker)
    for res, history, _ in ref[1:]:
        segs = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=res.prompt_token_ids[
            len(warm.tokenize_ids([Segment(text=d, cacheable=True) for d in DOCS])):])]
        cold = _warmed(tiny_llama, tokenizer, backfill=False)
        _same(res, cold.generate(segs, max_new_tokens=6, history_tokens=history, turn_end=marker))
        assert compare_logits(full_logits(tiny_llama, res.prompt_token_ids), res.first_logits)["max_abs_diff"] < 1e-4
    warm.store.clear()
    warm.warm(CORPUS[:5])
    res, history, _ = ref[-1]
    segs = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=res.prompt_token_ids[
        len(warm.tokenize_ids([Segment(text=d, cacheable=True) for d in DOCS])):])]
    _same(res, warm.generate(segs, max_new_tokens=6, history_tokens=history, turn_end=marker, store_prefix=False))

"""Exact history (kvboost_core.serving.backfill): after a turn served from re-placed documents, the next turn's history
is reused exactly and answered as a full prefill answers it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import CORPUS
from helpers import compare_logits, engine_for, full_logits

from kvboost_core import Segment
from kvboost_core.assembly import Chunk
from kvboost_core.segments import TokenizedSegment
from kvboost_core.serving.backfill import (
    Backfiller,
    BackfillJob,
    FollowUps,
    conversation_job,
    run_job,
    step_ends,
)

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]
QUESTION = " Where was Alice born?"
FOLLOW_UP = " And where did she go next?"


def _turn1(eng):
    return [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(text=QUESTION)]


def _turn2(eng, generated):
    """The next turn as a chat template renders it: the question's text segment continues with the answer and
    the follow-up (token ids, so that the answer is exactly the generated tokens)."""
    q = eng.tokenize_ids(Segment(text=QUESTION), add_special_tokens=False)
    f = eng.tokenize_ids(Segment(text=FOLLOW_UP), add_special_tokens=False)
    return [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=q + list(generated) + f)]


def _warmed(model, tok, **kw):
    eng = engine_for(model, tok, **kw)
    eng.warm(CORPUS[:5])
    return eng


@torch.inference_mode()
def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_next_turn_is_exact_after_backfill_and_approximate_without(tiny_llama, tokenizer):
    kw = dict(repair="cacheblend", recompute_ratio=0.3)
    plain, filled = _warmed(tiny_llama, tokenizer), _warmed(tiny_llama, tokenizer)
    first = filled.generate(_turn1(filled), max_new_tokens=6, **kw)
    assert first.stats["reused_approx"] > 0  # turn 1 was served from re-placed documents
    res = filled.backfill(_turn1(filled), first.token_ids)
    history = len(first.prompt_token_ids) + len(first.token_ids)
    assert res.complete and res.tokens == history and res.computed > 0

    turn2 = _turn2(filled, first.token_ids)
    ids = filled.tokenize_ids(turn2)
    assert ids[:history] == first.prompt_token_ids + first.token_ids
    ref = full_logits(tiny_llama, ids)
    before = plain.prefill(turn2, store_prefix=False, **kw)
    after = filled.prefill(turn2, store_prefix=False, **kw)
    # Without backfill the history's documents are re-placed again: approximate, and it shows in the logits.
    assert before.stats["reused_approx"] > 0 and compare_logits(ref, before.last_logits)["max_abs_diff"] > 1e-3
    assert after.stats["reused_exact"] == history and after.stats["reused_approx"] == 0
    assert compare_logits(ref, after.last_logits)["max_abs_diff"] < 1e-4
    # answers, not only the first token: greedy decoding equals HF's on the exact history
    gen = filled.generate(turn2, max_new_tokens=8, store_prefix=False, **kw)
    assert gen.token_ids == _hf_greedy(tiny_llama, ids, len(gen.token_ids))


def test_background_backfill_after_generate(tiny_llama, tokenizer):
    eng = _warmed(tiny_llama, tokenizer, backfill=True, repair="cacheblend", recompute_ratio=0.3)
    first = eng.generate(_turn1(eng), max_new_tokens=6)
    assert eng.wait_backfill(timeout=60)
    assert eng.stats()["backfill_tokens"] > 0 and eng.stats()["backfill_pending"] == 0
    turn2 = _turn2(eng, first.token_ids)
    after = eng.prefill(turn2, store_prefix=False)
    assert after.stats["reused_exact"] == len(first.prompt_token_ids) + len(first.token_ids)
    assert compare_logits(full_logits(tiny_llama, eng.tokenize_ids(turn2)), after.last_logits)["max_abs_diff"] < 1e-4


def test_auto_backfills_from_a_chats_second_turn_on_and_never_after_one_shot_questions(tiny_llama, tokenizer):
    """The default, backfill="auto": a prompt that continues an earlier prompt (a chat's later turn) is backfilled,
    so the turn after it finds its whole history exact; questions over the same documents are not."""
    eng = _warmed(tiny_llama, tokenizer, repair="cacheblend", recompute_ratio=0.3)
    assert eng.config.backfill == "auto"
    first = eng.generate(_turn1(eng), max_new_tokens=4)
    other = [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(text=" Who was Bob?")]
    eng.generate(other, max_new_tokens=4)  # the same documents, another question: not a follow-up
    eng.generate(_turn1(eng), max_new_tokens=4)  # the same prompt again: not a follow-up either
    assert eng.stats()["backfill_tokens"] == 0 and eng.stats()["backfill_pending"] == 0
    turn2 = _turn2(eng, first.token_ids)
    second = eng.generate(turn2, max_new_tokens=4)
    assert second.stats["reused_approx"] > 0  # turn 1 was never backfilled: its documents are re-placed again
    assert eng.wait_backfill(timeout=60) and eng.stats()["backfill_tokens"] > 0
    history = second.prompt_token_ids + second.token_ids
    turn3 = _turn2(eng, [*first.token_ids, *eng.tokenize_ids(Segment(text=FOLLOW_UP), add_special_tokens=False),
                         *second.token_ids])  # turn 2's question segment, continued by its answer and one more
    ids = eng.tokenize_ids(turn3)
    assert ids[:len(history)] == history
    after = eng.prefill(turn3, store_prefix=False)
    assert after.stats["reused_exact"] == len(history) and after.stats["reused_approx"] == 0
    assert compare_logits(full_logits(tiny_llama, ids), after.last_logits)["max_abs_diff"] < 1e-4


def test_follow_ups_are_prompts_that_continue_a_remembered_one():
    f = FollowUps(remember=2)
    assert not f.observe([1, 2, 3]) and not f.observe([1, 2, 3]) and not f.observe([1, 2, 4, 5])
    assert f.observe([1, 2, 3, 9]) and f.observe([1, 2, 4, 5, 6])
    f.observe([7]), f.observe([8])  # [1, 2, 3] and the others are forgotten
    assert not f.observe([1, 2, 3, 9, 9])


def test_backfill_false_never_and_steps_resume_from_stored_prefix(tiny_llama, tokenizer):
    eng = _warmed(tiny_llama, tokenizer, repair="cacheblend", recompute_ratio=0.3, backfill=False)
    first = eng.generate(_turn1(eng), max_new_tokens=4)
    eng.generate(_turn2(eng, first.token_ids), max_new_tokens=4)  # a follow-up: still no backfill
    assert eng.stats()["backfill_tokens"] == 0 and eng.stats()["backfill_pending"] == 0
    segs = eng.tokenize(_turn1(eng))
    chunks = [Chunk(s.start + a, s.start + b, i) for i, s in enumerate(segs) for a, b in eng.spans(s.token_ids)]
    job = conversation_job(segs, chunks, [5, 6, 7], eng.spans)
    res = run_job(job, eng._backfill_step, step_tokens=20)  # several steps: each resumes from the last one
    assert res.computed + res.reused_exact == res.tokens
    assert res.steps == len(step_ends(job.chunks, 20)) and 0 < res.max_step_s <= res.seconds
    again = run_job(job, eng._backfill_step, step_tokens=20)
    assert len(step_ends(job.chunks, 20)) > 1 and again.computed == 0  # all stored exact by the first run


def test_backfill_refuses_bad_input(tiny_llama, tokenizer):
    eng = _warmed(tiny_llama, tokenizer)
    with pytest.raises(ValueError, match="generated"):
        eng.backfill(_turn1(eng), [10**9])
    with pytest.raises(ValueError, match="store_prefix"):
        engine_for(tiny_llama, tokenizer, store_prefix=False).backfill(_turn1(eng))
    with pytest.raises(TypeError, match="backfill"):
        engine_for(tiny_llama, tokenizer, backfill="yes")


def _seg(ids, start, cacheable):
    return TokenizedSegment(token_ids=tuple(ids), start=start, cacheable=cacheable)


def test_conversation_job_extends_the_last_text_segment_and_recuts_it():
    spans = lambda ids: [(i, min(i + 4, len(ids))) for i in range(0, len(ids), 4)]  # noqa: E731
    segs = [_seg(range(10, 16), 0, True), _seg([1, 2, 3], 6, False)]
    chunks = [Chunk(0, 4, 0), Chunk(4, 6, 0), Chunk(6, 9, 1)]
    job = conversation_job(segs, chunks, [7, 8, 9, 10, 11], spans)
    assert job.token_ids == (*range(10, 16), 1, 2, 3, 7, 8, 9, 10, 11)
    # the question segment [6, 9) grows to [6, 14) and is re-cut as the next prompt will cut it
    assert job.chunks == (Chunk(0, 4, 0), Chunk(4, 6, 0), Chunk(6, 10, 1), Chunk(10, 14, 1))
    # after a document, the answer is a segment of its own
    job = conversation_job(segs[:1], chunks[:2], [7, 8], spans)
    assert job.chunks[-1] == Chunk(6, 8, 1)
    with pytest.raises(ValueError, match="contiguous"):
        BackfillJob(token_ids=(1, 2, 3), chunks=(Chunk(0, 1, 0), Chunk(2, 3, 0)))
    assert step_ends(job.chunks, 5) == [6, 8] and step_ends(job.chunks, 100) == [8]


def test_worker_waits_for_requests_and_drops_superseded_jobs():
    ran: list[tuple[tuple[int, ...], int]] = []
    bf = Backfiller(lambda job, end: ran.append((job.token_ids, end)) or (0, end), step_tokens=2)
    short = BackfillJob(token_ids=(1, 2), chunks=(Chunk(0, 2, 0),))
    long = BackfillJob(token_ids=(1, 2, 3, 4), chunks=(Chunk(0, 2, 0), Chunk(2, 4, 0)))
    with bf.request():
        bf.submit(short)
        bf.submit(long)  # extends the pending short job: replaces it
        time.sleep(0.2)
        assert ran == [] and bf.pending == 1  # nothing starts while a request is in flight
    assert bf.wait(timeout=10)
    assert ran == [((1, 2, 3, 4), 2), ((1, 2, 3, 4), 4)]
    assert bf.results[-1].complete and bf.results[-1].computed == 6


def test_worker_survives_a_failing_job(caplog):
    calls = threading.Event()

    def step(job, end):
        if job.token_ids == (9,):
            raise RuntimeError("boom")
        calls.set()
        return 0, end

    bf = Backfiller(step)
    bf.submit(BackfillJob(token_ids=(9,), chunks=(Chunk(0, 1, 0),)))
    bf.submit(BackfillJob(token_ids=(1,), chunks=(Chunk(0, 1, 0),)))
    assert bf.wait(timeout=10) and calls.is_set()
    assert "backfill job failed" in caplog.text
    bf.close()
    bf.submit(BackfillJob(token_ids=(2,), chunks=(Chunk(0, 1, 0),)))
    assert bf.pending == 0


def test_exit_closes_workers_and_waits_for_the_running_step():
    """A daemon thread left inside torch at interpreter exit aborts the process: the atexit hook must stop every
    worker after its running step."""
    from kvboost_core.serving import backfill

    started, finished = threading.Event(), threading.Event()

    def step(job, end):
        started.set()
        time.sleep(0.3)
        finished.set()
        return 0, end

    bf = Backfiller(step)
    bf.submit(BackfillJob(token_ids=(1, 2), chunks=(Chunk(0, 1, 0), Chunk(1, 2, 0))))
    assert started.wait(10)
    backfill._close_all()
    assert finished.is_set() and bf._thread is not None and not bf._thread.is_alive()
    assert bf.pending == 0


def test_quick_follow_up_waits_for_its_history(tiny_llama, tokenizer):
    """A follow-up sent before its history's backfill has finished waits for it: its answer does not depend on
    the backfill's timing."""
    eng = _warmed(tiny_llama, tokenizer, backfill=True, repair="cacheblend", recompute_ratio=0.3)
    slow_step = eng._backfill._run_step

    def step(job, end):
        time.sleep(0.5)  # a slow machine: the follow-up arrives while the job runs
        return slow_step(job, end)

    eng._backfill._run_step = step
    first = eng.generate(_turn1(eng), max_new_tokens=6)
    turn2 = _turn2(eng, first.token_ids)
    after = eng.generate(turn2, max_new_tokens=1, store_prefix=False)  # no wait_backfill()
    assert after.stats["reused_exact"] == len(first.prompt_token_ids) + len(first.token_ids)
    assert after.stats["reused_approx"] == 0


def test_wait_for_times_out_and_ignores_other_conversations():
    release = threading.Event()
    bf = Backfiller(lambda job, end: (release.wait(10), (0, end))[1])
    job = BackfillJob(token_ids=(1, 2, 3, 4), chunks=(Chunk(0, 4, 0),), prompt_len=2)
    bf.submit(job)
    assert job.continued_by([1, 2, 9]) and not job.continued_by([1, 2]) and not job.continued_by([7, 2, 9])
    assert bf.wait_for([7, 8, 9], timeout=5)  # another conversation: no wait
    t0 = time.monotonic()
    assert not bf.wait_for([1, 2, 3, 4, 5], timeout=0.2) and time.monotonic() - t0 >= 0.2
    release.set()
    assert bf.wait_for([1, 2, 3, 4, 5], timeout=10)


def test_cut_messages_cuts_text_after_each_turn_end_up_to_the_end():
    from kvboost_core.segments import cut_messages

    lead = TokenizedSegment((1,), 0, cacheable=False, is_lead=True)
    doc = TokenizedSegment((9, 8, 7, 7), 1, cacheable=True)  # a document holding the marker is never cut
    text = TokenizedSegment((5, 7, 7, 6, 7, 7, 4, 3, 7, 7, 2), 5, cacheable=False, source_ids=(0, 5, 7, 7, 6),
                            source_offset=1)
    got = cut_messages([lead, doc, text], 5 + 10, (7, 7))
    assert got[:2] == [lead, doc]
    assert [(s.start, s.token_ids) for s in got[2:]] == [(5, (5, 7, 7)), (8, (6, 7, 7)), (11, (4, 3, 7, 7)),
                                                        (15, (2,))]
    assert [s.source_offset for s in got[2:]] == [1, 4, 7, 11]  # token i of a piece is source_ids[i + offset]
    # a marker that ends after `end` does not cut (the new turn stays whole); without a marker only `end` cuts
    assert [s.token_ids for s in cut_messages([text], 5 + 9, (7, 7))] == [(5, 7, 7), (6, 7, 7), (4, 3, 7),
                                                                         (7, 2)]
    assert [s.token_ids for s in cut_messages([text], 7, ())] == [(5, 7), (7, 6, 7, 7, 4, 3, 7, 7, 2)]
    assert cut_messages([text], 0, ()) == [text]

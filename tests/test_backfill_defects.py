"""Two defects an outside audit of exact history found (issue #33), each reproduced deterministically (the third,
an engine built during another's forward, is in test_concurrent_engines.py):

- a stream neither finished nor closed held the backfill off for its whole life, so a follow-up waiting for its
  history blocked for two minutes;
- past 8 concurrent chats the backfill queue dropped the oldest job silently, and their follow-ups were
  re-placed instead of exact.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import CORPUS
from helpers import engine_for

from kvboost_core import Segment
from kvboost_core.assembly import Chunk
from kvboost_core.serving.backfill import Backfiller, BackfillJob, FollowUps

DOCS = [CORPUS[4], CORPUS[2], CORPUS[1]]
QUESTION = " Where was Alice born?"
FOLLOW_UP = " And where did she go next?"
REPAIR = dict(repair="cacheblend", recompute_ratio=0.3)
WAIT_S = 30.0  # liveness bounds only: each wait ends at once when the code is right


def _chat(eng, question: str, *history: int) -> list[Segment]:
    """A chat's prompt as a template renders it: the documents, then one text segment that holds the first
    question and every later answer and question (token ids, so the answers are exactly the generated tokens)."""
    q = eng.tokenize_ids(Segment(text=question), add_special_tokens=False)
    return [Segment(text=d, cacheable=True) for d in DOCS] + [Segment(token_ids=q + list(history))]


def _follow_up_ids(eng) -> list[int]:
    return eng.tokenize_ids(Segment(text=FOLLOW_UP), add_special_tokens=False)


def _no_eos(eng):
    eos = torch.tensor(sorted(eng._eos))

    def processor(generated, logits):
        return logits.index_fill_(0, eos, float("-inf"))

    return processor


# ------------------------------------------------------------------ 2. an abandoned stream
def test_an_abandoned_stream_does_not_hold_off_the_backfill_a_follow_up_waits_for(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer, backfill=True, **REPAIR)
    eng.warm(DOCS)
    stream = eng.stream(_chat(eng, " Who was Bob?"), max_new_tokens=40, store_prefix=False,
                        logits_processor=_no_eos(eng))
    assert next(stream) and stream.result is None  # one piece taken, then abandoned: neither finished nor closed
    try:
        first = eng.generate(_chat(eng, QUESTION), max_new_tokens=6)  # its backfill is submitted now
        turn2 = _chat(eng, QUESTION, *first.token_ids, *_follow_up_ids(eng))
        out: dict = {}
        follow = threading.Thread(target=lambda: out.update(r=eng.generate(turn2, max_new_tokens=4)))
        follow.start()
        follow.join(WAIT_S)  # waits for its history's backfill, which the abandoned stream must not hold off
        assert not follow.is_alive(), "the follow-up is still waiting for a backfill the open stream holds off"
    finally:
        stream._it.close()  # what the stream's garbage collection would do; lets a stuck follow-up finish
        follow.join(WAIT_S)
    history = len(first.prompt_token_ids) + len(first.token_ids)
    assert out["r"].stats["reused_exact"] >= history  # it found its history exact, not re-placed again


def test_a_stream_holds_off_the_backfill_only_while_it_computes(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer, backfill=False)
    busy: list[int] = []
    real = eng._backfill.request

    def spy():
        busy.append(1)
        return real()

    eng._backfill.request = spy  # type: ignore[method-assign]
    stream = eng.stream("Bob repairs bicycles", max_new_tokens=5, store_prefix=False, logits_processor=_no_eos(eng))
    pieces = list(stream)
    assert pieces and stream.result is not None and len(stream.result.token_ids) == 5
    assert len(busy) == 5  # the prefill and each of the 4 decode steps, each released before its piece is yielded
    assert eng._backfill._busy == 0


# ------------------------------------------------------------------ 3. many concurrent chats
def test_sixteen_concurrent_chats_all_find_their_history_exact(tiny_llama, tokenizer):
    """Turn 2 of 16 chats while a request is in flight: 16 backfill jobs wait at once (the queue held 8 and
    dropped the rest silently). Every turn 3 then finds its whole history exact."""
    eng = engine_for(tiny_llama, tokenizer, **REPAIR)  # backfill="auto": from each chat's second turn on
    eng.warm(DOCS)
    questions = [f" Where was Alice born? ({i})" for i in range(16)]
    firsts = [eng.generate(_chat(eng, q), max_new_tokens=3) for q in questions]
    f = _follow_up_ids(eng)
    turn2 = [_chat(eng, q, *r.token_ids, *f) for q, r in zip(questions, firsts)]
    assert eng.wait_backfill(WAIT_S)  # nothing else queued or running
    with eng._backfill.request():  # another request in flight: no backfill step starts, the jobs queue up
        seconds = [eng.generate(p, max_new_tokens=3) for p in turn2]
        assert eng.stats()["backfill_pending"] == 16
    for q, r1, r2 in zip(questions, firsts, seconds):
        history = len(r2.prompt_token_ids) + len(r2.token_ids)
        turn3 = _chat(eng, q, *r1.token_ids, *f, *r2.token_ids, *f)
        assert eng.tokenize_ids(turn3)[:history] == r2.prompt_token_ids + r2.token_ids
        r3 = eng.generate(turn3, max_new_tokens=2)  # waits for its own history's backfill
        assert r3.stats["reused_exact"] >= history and r3.stats["reused_approx"] == 0
    assert eng.wait_backfill(WAIT_S)
    assert eng.stats()["backfill_dropped"] == 0 and eng.stats()["follow_ups_forgotten"] == 0


def _job(*ids: int) -> BackfillJob:
    return BackfillJob(token_ids=ids, chunks=(Chunk(0, len(ids), 0),))


def test_a_full_backfill_queue_counts_what_it_drops():
    ran: list[tuple[int, ...]] = []
    bf = Backfiller(lambda job, end: ran.append(job.token_ids) or (0, end), max_pending=3, max_pending_tokens=100)
    with bf.request():  # while a request is in flight every job waits in the queue, none is taken
        bf.submit(_job(99))
        time.sleep(0.2)
        for i in range(5):
            bf.submit(_job(10 + i, 1))
        bf.submit(_job(10 + 4, 1, 2))  # supersedes its own earlier turn: not a drop
        assert bf.pending == 3 and bf.dropped == 3
    assert bf.wait(WAIT_S) and ran == [(12, 1), (13, 1), (14, 1, 2)]
    # the token budget bounds the queue too (the newest job is always kept)
    bf = Backfiller(lambda job, end: (0, end), max_pending=100, max_pending_tokens=5)
    with bf.request():
        bf.submit(_job(1, 2, 3))
        bf.submit(_job(4, 5, 6))
        bf.submit(_job(*range(20, 30)))
        assert bf.pending == 1 and bf.dropped == 2
    assert bf.wait(WAIT_S)
    with pytest.raises(ValueError, match="max_pending_tokens"):
        Backfiller(lambda job, end: (0, end), max_pending_tokens=0)


def test_follow_ups_recognise_many_chats_and_count_what_they_forget():
    f = FollowUps()
    chats = [[7, i, i + 1] for i in range(1000)]
    assert not any(f.observe(c) for c in chats)
    assert all(f.observe([*c, 5, 6]) for c in chats)  # every chat's second turn is recognised
    assert f.forgotten == 0
    small = FollowUps(remember=2)
    small.observe([1]), small.observe([2]), small.observe([3])
    assert small.forgotten == 1 and not small.observe([1, 9]) and small.observe([3, 9])

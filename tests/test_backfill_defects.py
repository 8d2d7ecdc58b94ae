"""Defects an outside audit of exact history found (issue #33), each reproduced deterministically (an engine
built during another's forward is in test_concurrent_engines.py):

- a stream neither finished nor closed held the backfill off for its whole life, so a follow-up waiting for its
  history blocked for two minutes.
"""

from __future__ import annotations

import threading

import torch
from conftest import CORPUS
from helpers import engine_for

from kvboost_core import Segment

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

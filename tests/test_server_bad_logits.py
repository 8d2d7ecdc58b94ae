"""One request whose logits cannot be sampled (NaN, or every token masked: kvboost_core.decode.BadLogits) fails
alone: that client gets the server's 500 ``server_error``, and every other request in the batch decodes on to
exactly the output it gets when it runs alone.

The fault is injected where a real one would come from: NaN in one request's KV (its rows of the batch
buffers), or NaN in its prefill logits. The poisoned request is the longest prompt, so its stale rows would sit
under the masked tail of the shorter requests that take its row later (0 * NaN poisons a masked slot when the
attention spans the batch's longest row, i.e. without the batch-invariant kernels)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import CORPUS
from test_server_scheduler import Events

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app.server import scheduler as scheduler_mod
from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

N_NEW = 10
# The longest prompt (index 1) is the one poisoned; the others are shorter, of different lengths.
PROMPTS = [
    CORPUS[2] + "\nQuestion: what is the capital?",
    "\n\n".join(CORPUS[:4]) + "\nQuestion: who is Alice?",
    "Bob?",
    CORPUS[4][:30],
]
POISONED = 1


@pytest.fixture()
def rag(tokenizer, tiny_llama):
    r = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    r.warm_documents(CORPUS[:3], progress=False)
    return r


def _n_tokens(rag: KVBoostRAG, prompt: str) -> int:
    plan = rag.plan(prompt)
    return sum(len(s.token_ids) for s in plan.segments if s.token_ids is not None)


def _run(sched: Scheduler, rag: KVBoostRAG, prompts: list[str]) -> list[Events]:
    """Submit every prompt at once (greedy, N_NEW tokens each, EOS ignored) and wait for all of them."""
    evs = [Events() for _ in prompts]
    for p, ev in zip(prompts, evs):
        sched.submit(GenRequest(rag=rag, params=SamplingParams.create(N_NEW), emit=ev, prompt=p, ignore_eos=True))
    for ev in evs:
        ev.wait()
    return evs


def _solo(rag: KVBoostRAG, deterministic: bool) -> list[str]:
    sched = Scheduler(rag.engine.driver, max_batch=3, deterministic=deterministic)
    sched.start()
    try:
        out = []
        for p in PROMPTS:
            (ev,) = _run(sched, rag, [p])
            assert ev.items[-1][0] == "done", ev.items[-1]
            out.append(ev.text)
        return out
    finally:
        sched.shutdown()


def _poison_kv(sched: Scheduler, n_poisoned: int) -> None:
    """NaN in the KV of the request whose prompt has ``n_poisoned`` tokens, once it joins the batch."""
    dec = sched.decoder
    real_add = dec.add

    def add(keys: Any, values: Any, length: int, capacity: int) -> Any:
        slot = real_add(keys, values, length, capacity)
        if length == n_poisoned:
            with torch.inference_mode():
                for buf in dec._keys:
                    buf[slot.row, :, :length] = float("nan")
        return slot

    dec.add = add  # type: ignore[method-assign]


def _poison_prefill(monkeypatch: pytest.MonkeyPatch, n_poisoned: int) -> None:
    """NaN first-token logits for the request whose prompt has ``n_poisoned`` tokens."""
    real_start = scheduler_mod.start_prefill

    class Task:
        def __init__(self, task: Any) -> None:
            self._task = task

        def __getattr__(self, name: str) -> Any:
            return getattr(self._task, name)

        def finish(self) -> Any:
            pre = self._task.finish()
            if len(pre.result.token_ids) == n_poisoned:
                bad = torch.full_like(pre.result.last_logits, float("nan"))
                pre.result = dataclasses.replace(pre.result, last_logits=bad)
            return pre

    monkeypatch.setattr(scheduler_mod, "start_prefill", lambda *a, **kw: Task(real_start(*a, **kw)))


def _check(evs: list[Events], solo: list[str]) -> None:
    kind, err = evs[POISONED].items[-1]
    assert kind == "error", evs[POISONED].items
    assert err.status == 500 and err.type == "server_error" and "NaN" in err.message
    for i, ev in enumerate(evs):
        if i == POISONED:
            continue
        kind, fin = ev.items[-1]
        assert kind == "done", (i, ev.items[-1])
        assert fin.completion_tokens == N_NEW and ev.text == solo[i], i


@pytest.mark.parametrize("deterministic", [True, False])
def test_nan_kv_in_one_row_fails_that_request_only(rag, deterministic):
    lengths = [_n_tokens(rag, p) for p in PROMPTS]
    assert lengths[POISONED] == max(lengths) and len(set(lengths)) == len(lengths)
    solo = _solo(rag, deterministic)
    sched = Scheduler(rag.engine.driver, max_batch=3, deterministic=deterministic)
    _poison_kv(sched, lengths[POISONED])
    sched.start()
    try:
        _check(_run(sched, rag, PROMPTS), solo)
        # the poisoned row left nothing behind: the same prompts again (unpoisoned rows) give the solo outputs
        again = _run(sched, rag, [p for i, p in enumerate(PROMPTS) if i != POISONED])
        assert [e.text for e in again] == [t for i, t in enumerate(solo) if i != POISONED]
    finally:
        sched.shutdown()


def test_nan_first_token_logits_fail_that_request_only(rag, monkeypatch):
    lengths = [_n_tokens(rag, p) for p in PROMPTS]
    solo = _solo(rag, True)
    _poison_prefill(monkeypatch, lengths[POISONED])
    for chunk in (None, 8):  # whole prefill in one iteration, and chunked
        sched = Scheduler(rag.engine.driver, max_batch=3, prefill_chunk=chunk)
        sched.start()
        try:
            _check(_run(sched, rag, PROMPTS), solo)
        finally:
            sched.shutdown()

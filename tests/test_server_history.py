"""Exact chat history through the server (issue 33, kvboost_rag.app.server.history): a chat completion's history
(everything up to its last assistant message) is never re-placed, and after each turn the server backfills the
prompt and answer as canonical chunks between requests. So turn 2 on finds its whole history as cached (exact)
tokens, and a turn's logits are bitwise the same at every decode step whatever the store holds: a cold store,
a fully backfilled one, one slice into the backfill, after eviction, and after a restart from the disk tier.

The scheduler's idle backfill is replaced by explicit slices on the engine thread (``_Slices``), so each store
state is reached exactly, not by timing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.server.history import TurnBackfills
from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

pytestmark = pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is missing")

NEW = 6
QUESTIONS = ["What is the country of Dethik?", "And its river?", "Which document named it?", "Thanks. Once more?"]


@pytest.fixture(scope="module")
def demo() -> Any:
    from kvboost_rag.app.loading import load_engine

    return load_engine("demo").engine


@pytest.fixture(scope="module")
def docs() -> list[str]:
    records = [d["text"] for d in dd.load_corpus()]
    return [" ".join(records[i:i + 8]) for i in range(0, 32, 8)]  # 4 documents of about 100 tokens


class _Slices:
    """The scheduler's backfill, run only when the test says so (``run(n)``: n slices on the engine thread)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.real = sched, sched.backfills.step
        sched.backfills.step = lambda: None  # type: ignore[method-assign]

    def run(self, n: int | None = None) -> None:
        def go() -> None:
            k = 0
            while self.sched.backfills.pending and (n is None or k < n):
                self.real()
                k += 1
        self.sched.call(go).result(timeout=120)


def _turn(sched: Scheduler, rag: Any, messages: list[dict[str, str]]) -> tuple[str, Any]:
    """One chat completion: (text, Started)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def emit(kind: str, payload: Any) -> None:
        box.setdefault(kind, payload)
        if kind in ("done", "error"):
            done.set()

    sched.submit(GenRequest(rag=rag, params=SamplingParams.create(NEW), emit=emit, messages=messages))
    assert done.wait(120), "the request did not finish"
    assert "error" not in box, box.get("error")
    return box["done"].text, box["start"]


def _chat(demo: Any, docs: list[str], state: str, tmp: Path, *, namespace: str = "default",
          store: Any = None, backfilled: list[int] | None = None) -> list[tuple[str, list[torch.Tensor], Any, int]]:
    """A 4-turn RAG chat with the store in ``state`` before every turn from the second: (text, logits, Started,
    history tokens) per turn. The history holds the answers this run gave. ``backfilled``: gets the tokens the
    backfills computed so far, before every turn from the second (``"warm"``)."""
    cfg = demo.config.with_(namespace=namespace, **({"store": store} if store is not None else {}))
    if state == "disk":
        cfg = cfg.with_(store=["memory", f"disk:{tmp}"])

    def fresh() -> KVBoostRAG:
        rag = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, cfg))
        rag.warm_documents(docs, progress=False)
        return rag

    sched = Scheduler(demo.driver, max_batch=2, warm_budget=1)  # a backfill slice is one chunk
    slices = _Slices(sched)
    sched.start()
    rag = fresh()
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": dd.build_prompt(docs, QUESTIONS[0])}]
    out = []
    try:
        for i, q in enumerate(QUESTIONS):
            if i:
                messages += [{"role": "user", "content": q}]
                if state == "cold":  # nothing stored but the warmed documents
                    rag = fresh()
                elif state == "warm":
                    slices.run()
                    if backfilled is not None:
                        backfilled.append(sched.backfills.totals.tokens)
                elif state == "mid":  # one slice into the previous turn's backfill
                    slices.run(1)
                    assert sched.backfills.pending == 1
                elif state == "evicted":
                    slices.run()
                    sched.call(rag.engine.store.clear).result()
                    sched.call(lambda r=rag: r.warm_documents(docs, progress=False)).result()
                elif state == "disk":  # a restart: a new engine (empty memory tier) over the same directory
                    slices.run()
                    rag = fresh()
            past = rag.chat_history(messages)
            history = len(rag.engine.tokenize_ids(past, add_special_tokens=False)) if past else 0
            logits: list[torch.Tensor] = []
            sched._thread._kv_record = logits  # type: ignore[attr-defined]
            text, started = _turn(sched, rag, messages)
            out.append((text, logits, started, history))
            messages += [{"role": "assistant", "content": text}]
    finally:
        sched.shutdown()
    return out


STATES = ["cold", "warm", "mid", "evicted", "disk"]


@pytest.fixture(scope="module")
def runs(demo: Any, docs: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import kvboost_rag.app.server.scheduler as sm

    real = sm.sample

    def sample(logits: torch.Tensor, params: Any, generator: Any) -> int:
        out = getattr(threading.current_thread(), "_kv_record", None)
        if out is not None:
            out.append(logits.detach().float().clone())
        return real(logits, params, generator)

    sm.sample = sample
    try:
        return {s: _chat(demo, docs, s, tmp_path_factory.mktemp(s)) for s in STATES}
    finally:
        sm.sample = real


@pytest.mark.parametrize("state", STATES[1:])
def test_a_chat_is_bitwise_the_same_whatever_the_store_holds(runs: dict[str, Any], state: str) -> None:
    cold = runs["cold"]
    for turn, ((t0, l0, _, h0), (t1, l1, _, h1)) in enumerate(zip(cold, runs[state])):
        assert t0 == t1 and h0 == h1, f"turn {turn + 1}: {state} answered differently"
        assert len(l0) == len(l1) > 0
        for step, (a, b) in enumerate(zip(l0, l1)):
            assert torch.equal(a, b), (f"turn {turn + 1}, step {step}: {state} differs from cold "
                                       f"(max {float((a - b).abs().max()):.3g})")


def test_a_follow_ups_backfill_computes_only_what_its_turn_added(demo: Any, docs: list[str],
                                                                 tmp_path: Path) -> None:
    """The history is cut after every message, as the next turn reads it: after turn 1's backfill (its whole
    prompt and answer) each turn's backfill computes at most the tokens after the history it read. (Cut at the
    history's end only, the backfill re-cut the last message's chunk and computed up to a chunk more.)"""
    computed: list[int] = []
    turns = _chat(demo, docs, "warm", tmp_path, backfilled=computed)
    histories = [h for *_, h in turns]
    assert len(computed) == 3
    for t in (1, 2):  # turns 2 and 3: the job of turn t+1, read by turn t+2
        assert 0 < computed[t] - computed[t - 1] <= histories[t + 1] - histories[t] + 2, t


def test_turn_two_on_finds_its_history_cached(runs: dict[str, Any]) -> None:
    """With the backfill done, every later turn's history is cached (exact) tokens; cold, it is computed."""
    for turn, (_, _, started, history) in enumerate(runs["warm"]):
        if turn == 0:
            assert history == 0 and started.counts.approximate > 0  # turn 1 re-placed its documents
            continue
        assert history > 128 and started.counts.cached >= history  # at least the whole history
        # the re-placed documents sit in turn 1's user message: history, never re-placed again
        assert started.counts.approximate == 0
    for _, _, started, history in runs["cold"][1:]:
        assert started.counts.cached < history  # the check above can fail: nothing was backfilled
    # evicted: the store was cleared, so the history is computed again, and nothing partial is served
    assert all(s.counts.cached < h for _, _, s, h in runs["evicted"][1:])
    # a restart from the disk tier finds the history on disk
    assert all(s.counts.cached >= h for _, _, s, h in runs["disk"][1:])


def test_a_tenant_never_reads_another_tenants_history(demo: Any, docs: list[str], tmp_path: Path) -> None:
    """Two namespaces on one shared store object (the keys alone must keep them apart): tenant a's chat is
    backfilled; tenant b's identical turn 2 finds none of it, and gets the same bits computed."""
    from kvboost_core.store.memory import MemoryStore

    shared = MemoryStore(max_bytes=1 << 30)
    a = _chat(demo, docs, "warm", tmp_path, namespace="tenant-a", store=shared)
    cfg = demo.config.with_(namespace="tenant-b", store=shared)
    rag = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, cfg))
    rag.warm_documents(docs, progress=False)
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": dd.build_prompt(docs, QUESTIONS[0])},
                {"role": "assistant", "content": a[0][0]}, {"role": "user", "content": QUESTIONS[1]}]
    sched = Scheduler(demo.driver, max_batch=2)
    _Slices(sched)
    sched.start()
    try:
        text, started = _turn(sched, rag, messages)
    finally:
        sched.shutdown()
    assert a[1][2].counts.cached >= a[1][3] > 0  # tenant a read its own history
    assert started.counts.cached == 0 and text == a[1][0]


def test_queue_bounds_supersede_and_count_drops() -> None:
    from kvboost_core.assembly import Chunk
    from kvboost_core.serving.backfill import BackfillJob

    def job(n: int, start: int = 0) -> BackfillJob:
        ids = tuple(range(start, start + n))
        return BackfillJob(token_ids=ids, chunks=(Chunk(0, n, 0),))

    q = TurnBackfills(4, max_pending=2)
    eng, other = object(), object()
    q.submit(eng, job(4))
    q.submit(eng, job(8))  # the same chat's next turn (starts with the first): replaces it
    assert q.pending == 1 and q.totals.superseded == 1
    q.submit(other, job(8))  # same tokens, another engine (tenant): kept apart
    q.submit(eng, job(5, start=100))  # a third chat: past max_pending, the oldest is dropped and counted
    assert q.pending == 2 and q.totals.dropped == 1
    with pytest.raises(ValueError, match="step_tokens"):
        TurnBackfills(0)


def test_a_waiting_request_waits_for_one_backfill_slice_at_most(demo: Any, docs: list[str]) -> None:
    """The backfill runs a slice per scheduler iteration only while nothing else is queued or running: a request
    submitted while a long backfill runs is admitted after the slice in progress, and the rest of the job waits
    until the request is done."""
    import time

    rag = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, demo.config))
    rag.warm_documents(docs, progress=False)
    sched = Scheduler(demo.driver, max_batch=2, warm_budget=1)  # a slice is one chunk
    events: list[tuple[str, float]] = []
    real_step = sched.backfills.step

    def step() -> None:
        events.append(("slice", time.perf_counter()))
        real_step()
        time.sleep(0.05)  # a slice that takes a while, so the request surely arrives during one

    sched.backfills.step = step  # type: ignore[method-assign]
    sched.start()
    try:
        messages = [{"role": "user", "content": dd.build_prompt(docs, QUESTIONS[0])}]
        text, _ = _turn(sched, rag, messages)  # its backfill (several chunks) starts once it is done
        while not any(e == "slice" for e, _ in events):
            time.sleep(0.01)
        submitted = time.perf_counter()
        _turn(sched, rag, [{"role": "user", "content": "A one-shot question."}])  # prefill and 6 decode steps
        done = time.perf_counter()
        during = [t for e, t in events if e == "slice" and submitted <= t <= done]
        assert len(during) <= 1  # none started while it waited, prefilled or decoded (one may have been under way)
        assert sched.backfills.pending or sched.backfills.totals.jobs  # the job went on (or finished) after
    finally:
        sched.shutdown()


def test_a_rewritten_answer_is_history_computed_exactly_and_changes_nothing_stored(demo: Any, docs: list[str]
                                                                                   ) -> None:
    """A client that rewrites the assistant's answer sends a history nothing stored continues: it reads the
    stored chunks up to the first changed token and computes the rest, with the bits a cold server gives; the
    stored entries of the real history are left as they were."""
    cfg = demo.config

    def rag_with(store: Any = None) -> KVBoostRAG:
        rag = KVBoostRAG(KVEngine(demo.model, demo.tokenizer, cfg if store is None else cfg.with_(store=store)))
        rag.warm_documents(docs, progress=False)
        return rag

    sched = Scheduler(demo.driver, max_batch=2, warm_budget=1)
    slices = _Slices(sched)
    sched.start()
    try:
        rag = rag_with()
        stored: list[Any] = []
        put = rag.engine.store.put

        def record(key: Any, block: Any, **kw: Any) -> bool:
            stored.append(key)
            return put(key, block, **kw)

        rag.engine.store.put = record  # type: ignore[method-assign]
        first = [{"role": "user", "content": dd.build_prompt(docs, QUESTIONS[0])}]
        answer, _ = _turn(sched, rag, first)
        slices.run()
        history_keys = list(stored)
        rewritten = [*first, {"role": "assistant", "content": answer + " (edited by the client)"},
                     {"role": "user", "content": QUESTIONS[1]}]
        text, started = _turn(sched, rag, rewritten)
        cold_text, cold = _turn(sched, rag_with(), rewritten)
        assert text == cold_text and 0 < started.counts.cached  # the unchanged part was read
        assert started.counts.prompt_tokens == cold.counts.prompt_tokens
        assert history_keys and all(rag.engine.store.contains(k) for k in history_keys)  # left as they were
    finally:
        sched.shutdown()

"""The scheduler in process (no HTTP): an engine failure answers that request with a 500 that carries no
internals, and the loop keeps serving; a cancelled request leaves the batch; outputs equal engine.generate."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import CORPUS

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app.server.scheduler import Finished, GenRequest, Scheduler, Started


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.done = threading.Event()

    def __call__(self, kind: str, payload: Any) -> None:
        self.items.append((kind, payload))
        if kind in ("done", "error"):
            self.done.set()

    def wait(self) -> tuple[str, Any]:
        assert self.done.wait(60), f"no final event; got {self.items}"
        return self.items[-1]

    @property
    def text(self) -> str:
        return "".join(p for k, p in self.items if k == "text")


class Exploding:
    """A KVBoostRAG whose prompt planning fails inside the engine thread."""

    def __init__(self, rag: KVBoostRAG) -> None:
        self.engine, self.tokenizer = rag.engine, rag.tokenizer

    def plan(self, *a: Any, **kw: Any) -> Any:
        raise RuntimeError("secret internal detail")


@pytest.fixture()
def rig(tokenizer, tiny_llama):
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    rag.warm_documents(CORPUS[:3], progress=False)
    sched = Scheduler(rag.engine.driver, max_batch=2, max_queue=4)
    sched.start()
    yield rag, sched
    sched.shutdown()


def _submit(sched: Scheduler, rag: Any, prompt: str, n: int = 6, **kw: Any) -> Events:
    ev = Events()
    sched.submit(GenRequest(rag=rag, params=SamplingParams.create(n), emit=ev, prompt=prompt, **kw))
    return ev


def test_engine_error_is_a_500_and_the_loop_keeps_serving(rig):
    rag, sched = rig
    bad = _submit(sched, Exploding(rag), "anything")
    kind, err = bad.wait()
    assert kind == "error" and err.status == 500 and "secret" not in err.message
    prompt = CORPUS[1] + "\n\n" + CORPUS[0] + "\nQuestion:"
    good = _submit(sched, rag, prompt, 6)
    kind, fin = good.wait()
    assert kind == "done" and isinstance(fin, Finished)
    started = next(p for k, p in good.items if k == "start")
    assert isinstance(started, Started) and started.counts.cached + started.counts.approximate > 0
    ref = KVBoostRAG(KVEngine(rag.engine.model, rag.tokenizer, sink_tokens=4))
    ref.warm_documents(CORPUS[:3], progress=False)
    assert good.text == ref.generate(prompt, max_new_tokens=6).text


def test_failed_decode_step_fails_running_requests_only(rig, monkeypatch):
    rag, sched = rig
    calls = {"n": 0}
    real = sched.decoder.step

    def flaky(tokens):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("decode blew up")
        return real(tokens)

    monkeypatch.setattr(sched.decoder, "step", flaky)
    first = _submit(sched, rag, CORPUS[2], 8, ignore_eos=True)
    assert first.wait()[0] == "error" and first.wait()[1].status == 500
    assert sched.decoder.size == 0
    again = _submit(sched, rag, CORPUS[2], 4, ignore_eos=True)
    kind, fin = again.wait()
    assert kind == "done" and fin.completion_tokens == 4


def test_cancel_frees_the_slot_and_queue_bound(rig):
    rag, sched = rig
    reqs = [GenRequest(rag=rag, params=SamplingParams.create(800), emit=Events(), prompt=CORPUS[i],
                       ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    for _ in range(400):  # bounded: until two run and one waits
        if sched.running == 2:
            break
        threading.Event().wait(0.01)
    assert sched.running == 2 and sched.queue_depth == 1
    for r in reqs:
        sched.cancel(r)
    for _ in range(400):
        if sched.running == 0 and sched.queue_depth == 0:
            break
        threading.Event().wait(0.01)
    assert sched.running == 0 and sched.queue_depth == 0 and sched.decoder.nbytes == 0
    assert not any(k in ("done", "error") for r in reqs for k, _ in r.emit.items)  # cancelled: no reply
    with pytest.raises(ValueError, match="max_queue"):
        Scheduler(rag.engine.driver, max_queue=-1)

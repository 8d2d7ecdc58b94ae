"""POST /v1/documents shares the engine with decoding (issue: 6 documents, 967 tokens, stalled every running
stream for 115 s), request limits, and the server's smaller answers: an image_url part is a 400, an
over-context document a 400 with token counts, GET /v1/models/{id}, /metrics behind the keys, and a stream
whose client went away is not counted as a 200."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import CORPUS

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

DOCS = [f"Document {i}: " + " ".join(f"fact{i}-{j} is true." for j in range(12)) for i in range(8)]


def _decode_while_warming(rag: Any, warm_rag: Any, docs: list[str], budget: int, log: list[str],
                          share: float | None = None) -> Any:
    """A request decodes; ``docs`` are warmed into ``warm_rag`` through the scheduler meanwhile. Logs "step"
    per decode step and "layer" per layer the warm computes; returns the finished job. ``share``: the
    scheduler's warm_step_share (None: the token budget alone)."""
    sched = Scheduler(rag.engine.driver, max_batch=2, max_queue=4, warm_budget=budget, warm_step_share=share)
    step = sched.decoder.step
    sched.decoder.step = lambda *a, **kw: (log.append("step"), step(*a, **kw))[1]  # type: ignore[method-assign]
    done = threading.Event()
    req = GenRequest(rag=rag, params=SamplingParams.create(200), ignore_eos=True, prompt=CORPUS[0],
                     emit=lambda kind, payload: (kind in ("done", "error")) and done.set())
    sched.start()
    try:
        sched.submit(req)
        while "step" not in log:  # the stream is running
            threading.Event().wait(0.01)
        job = sched.warm(warm_rag, docs)
        job.future.result(timeout=120)
        sched.cancel(req)  # a cancelled request is dropped without an event: wait until it has left the batch
        for _ in range(6000):
            if not sched.running or done.is_set():
                break
            threading.Event().wait(0.01)
        assert not sched.running or done.is_set()
    finally:
        sched.shutdown()
    return job


@pytest.fixture
def layer_log(monkeypatch):
    """'layer' in the returned list for every layer a sliced call (the warm's thread) computes."""
    from kvboost_core.model import slices

    log: list[str] = []
    own = slices.layer_done

    def spy(rows: int, layers: int) -> None:
        if getattr(slices._LOCAL, "hook", None) is not None:
            log.append("layer")
        own(rows, layers)

    monkeypatch.setattr(slices, "layer_done", spy)
    return log


def test_warm_requests_are_interleaved_with_decode_steps(tokenizer, tiny_llama, layer_log):
    """A warm runs a slice per scheduler iteration, with a decode step of the running request between every
    two slices. It used to run whole, as one task, between two decode steps, and then a document at a time:
    a long document still stalled every stream for its whole forward. Budget 1: one layer per slice."""
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    warm_rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    job = _decode_while_warming(rag, warm_rag, DOCS, 1, layer_log)
    totals = job.future.result()
    layers = warm_rag.engine.driver.num_layers
    assert totals.documents == len(DOCS) and totals.warmed == len(DOCS)
    assert all(warm_rag.is_warm(d) for d in DOCS)
    first, last = layer_log.index("layer"), len(layer_log) - 1 - layer_log[::-1].index("layer")
    between = layer_log[first:last + 1]
    assert between.count("layer") == len(DOCS) * layers and job.steps >= len(DOCS) * layers
    # every two warm slices (a layer each) have a decode step between them
    assert all(between[i + 1] == "step" for i, e in enumerate(between[:-1]) if e == "layer"), between


def test_a_larger_budget_takes_fewer_slices(tokenizer, tiny_llama, layer_log):
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    warm_rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    tokens = sum(len(warm_rag.engine.tokenize_ids(d)) for d in DOCS[:4])
    job = _decode_while_warming(rag, warm_rag, DOCS[:4], tokens // 2, layer_log)
    assert 2 <= job.steps <= 4 and job.future.result().warmed == 4  # about half the tokens per slice


def test_while_requests_decode_a_slice_ends_after_its_share_of_a_decode_step(tokenizer, tiny_llama, layer_log):
    """The default time bound: with a token budget that would warm everything at once, a slice still ends once
    it has run its share of the last decode step (here a tiny share: one layer per slice)."""
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    warm_rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    job = _decode_while_warming(rag, warm_rag, DOCS[:3], 10**9, layer_log, share=1e-9)
    assert job.future.result().warmed == 3 and job.steps >= 3 * warm_rag.engine.driver.num_layers
    with pytest.raises(ValueError, match="warm_step_share"):
        Scheduler(rag.engine.driver, warm_step_share=0)


def test_a_sliced_warm_stores_the_same_bits_as_an_in_process_warm(tokenizer, tiny_llama):
    """Pausing between layers changes no computation: every stored tensor equals the plain warm's."""
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    sliced = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    plain = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    stored: dict[str, dict[Any, Any]] = {"sliced": {}, "plain": {}}
    for name, r in (("sliced", sliced), ("plain", plain)):
        put = r.engine.store.put
        r.engine.store.put = (lambda key, block, _put=put, _seen=stored[name], **kw:  # type: ignore[method-assign]
                              (_seen.__setitem__(key, block), _put(key, block, **kw))[1])
    _decode_while_warming(rag, sliced, DOCS[:3], 1, [])
    plain.warm_documents(DOCS[:3], progress=False)
    assert stored["plain"] and stored["plain"].keys() == stored["sliced"].keys()
    for key, a in stored["plain"].items():
        b = stored["sliced"][key]
        assert list(a.token_ids) == list(b.token_ids) and a.base_position == b.base_position
        (ka, va), (kb, vb) = a.payload.to_dense(torch.float32, "cpu"), b.payload.to_dense(torch.float32, "cpu")
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_shutdown_stops_a_paused_warm(tokenizer, tiny_llama):
    """A server shutting down in the middle of a warm answers it 503 and its paused thread ends."""
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    sched = Scheduler(rag.engine.driver, max_batch=1, warm_budget=1)
    job = sched.warm(rag, DOCS)  # queued before the loop starts: shut down after its first slices
    sched.start()
    while job.steps < 2 and not job.future.done():
        threading.Event().wait(0.001)
    sched.shutdown()
    with pytest.raises(Exception) as err:
        job.future.result(timeout=60)
    assert getattr(err.value, "status", None) == 503
    assert job._call is not None and job._call.done
    assert not any(t.name == "kvboost-warm" and t.is_alive() for t in threading.enumerate())


def test_a_refused_document_fails_its_warm_only(tokenizer, tiny_llama):
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    sched = Scheduler(rag.engine.driver, max_batch=1, warm_budget=64)
    sched.start()
    try:
        ctx = rag.engine.driver.max_context
        job = sched.warm(rag, [DOCS[0], "word " * (ctx + 50)])
        with pytest.raises(Exception) as err:
            job.future.result(timeout=120)
        assert getattr(err.value, "status", None) == 400 and "documents[1]" in str(err.value)
        assert "tokens" in str(err.value) and str(ctx) in str(err.value)
        assert sched.warm(rag, [DOCS[2]]).future.result(timeout=120).warmed == 1  # the loop goes on
    finally:
        sched.shutdown()


# ---------------------------------------------------------------------------------------------- HTTP
def _args(*argv: str) -> argparse.Namespace:
    from kvboost_rag.app.server import main as server_main

    p = argparse.ArgumentParser()
    server_main.add_arguments(p)
    return p.parse_args(["--model", "demo", *argv])


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvboost_rag.app.server.factory import build

    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"sk-tenant-a-0001": "tenant-a", "sk-tenant-b-0002": "tenant-b"}))
    app, _ = build(_args("--max-documents", "3", "--max-document-bytes", "20000", "--namespace-keys", str(keys),
                         "--threads", "1"))
    with TestClient(app) as c:
        c.headers["Authorization"] = "Bearer sk-tenant-a-0001"
        yield c


def test_documents_request_limits_are_413(client):
    r = client.post("/v1/documents", json={"documents": ["a", "b", "c", "d"]})
    assert r.status_code == 413 and "at most 3" in r.json()["error"]["message"]
    r = client.post("/v1/documents", json={"documents": ["x" * 20001]})
    assert r.status_code == 413 and "20001 bytes" in r.json()["error"]["message"]
    r = client.post("/v1/documents", json={"documents": ["Alice lives in Portvale."]})
    assert r.status_code == 200 and r.json()["warmed"] == 1


def test_over_context_document_is_a_400_with_token_counts(client):
    ctx = client.app.state.kv.base.engine.driver.max_context
    r = client.post("/v1/documents", json={"documents": ["ab " * (ctx + 10)]})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "documents[0]" in msg and f"context is {ctx} tokens" in msg and "has" in msg


def test_image_url_part_is_a_400(client):
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    r = client.post("/v1/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_models_retrieve(client):
    assert client.get("/v1/models/demo").json()["id"] == "demo"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_need_a_key_and_show_the_callers_namespace_only(client):
    r = client.get("/metrics", headers={"Authorization": ""})
    assert r.status_code == 401 and "tenant" not in r.text
    body = client.get("/metrics").text
    assert 'namespace="tenant-a"' in body and "tenant-b" not in body


def test_a_stream_whose_client_went_away_is_not_a_200():
    from kvboost_core import CacheCounts
    from kvboost_rag.app.server.app import _sse
    from kvboost_rag.app.server.metrics import Metrics
    from kvboost_rag.app.server.scheduler import Started

    metrics = Metrics()
    state: Any = SimpleNamespace(model_name="m", metrics=metrics, scheduler=SimpleNamespace(cancel=lambda r: None))

    async def go() -> None:
        q: asyncio.Queue = asyncio.Queue()
        for piece in ("a", "b"):
            q.put_nowait(("text", piece))
        gen = _sse(state, q, object(), Started(3, CacheCounts(3, 0, 0, 0, 3), 0.1), 1e12, "id", 0, False, False,
                   "/v1/completions")
        await gen.__anext__()  # one chunk sent, then the client goes away
        await gen.aclose()

    asyncio.run(go())
    counts = {s.labels["status"]: s.value for m in metrics.requests.collect() for s in m.samples
              if s.name.endswith("_total")}
    assert counts.get("200", 0) == 0 and counts.get("499") == 1

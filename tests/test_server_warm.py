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
from conftest import CORPUS

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

DOCS = [f"Document {i}: " + " ".join(f"fact{i}-{j} is true." for j in range(12)) for i in range(8)]


def test_warm_requests_are_interleaved_with_decode_steps(tokenizer, tiny_llama):
    """A warm of several documents runs a piece per scheduler iteration, with a decode step of the running
    request between every two pieces (it used to run whole, as one task, between two decode steps)."""
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    warm_rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    sched = Scheduler(rag.engine.adapter, max_batch=2, max_queue=4, warm_budget=1)  # one document a piece
    log: list[str] = []
    step, warm = sched.decoder.step, warm_rag.warm_documents
    sched.decoder.step = lambda *a, **kw: (log.append("step"), step(*a, **kw))[1]  # type: ignore[method-assign]
    warm_rag.warm_documents = lambda *a, **kw: (log.append("warm"), warm(*a, **kw))[1]  # type: ignore[method-assign]
    done = threading.Event()
    req = GenRequest(rag=rag, params=SamplingParams.create(200), ignore_eos=True, prompt=CORPUS[0],
                     emit=lambda kind, payload: (kind in ("done", "error")) and done.set())
    sched.start()
    try:
        sched.submit(req)
        while "step" not in log:  # the stream is running
            threading.Event().wait(0.01)
        job = sched.warm(warm_rag, DOCS)
        totals = job.future.result(timeout=120)
        sched.cancel(req)  # a cancelled request is dropped without an event: wait until it has left the batch
        for _ in range(6000):
            if not sched.running or done.is_set():
                break
            threading.Event().wait(0.01)
        assert not sched.running or done.is_set()
    finally:
        sched.shutdown()
    assert totals.documents == len(DOCS) and totals.warmed == len(DOCS) and job.steps == len(DOCS)
    assert all(warm_rag.is_warm(d) for d in DOCS)
    first, last = log.index("warm"), len(log) - 1 - log[::-1].index("warm")
    between = log[first:last + 1]
    assert between.count("warm") == len(DOCS)
    # every two warm pieces have a decode step between them
    assert all(between[i + 1] == "step" for i, e in enumerate(between[:-1]) if e == "warm"), between


def test_a_refused_document_fails_its_warm_only(tokenizer, tiny_llama):
    rag = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    sched = Scheduler(rag.engine.adapter, max_batch=1, warm_budget=64)
    sched.start()
    try:
        ctx = rag.engine.adapter.max_context
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
    ctx = client.app.state.kv.base.engine.adapter.max_context
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
    from kvboost_rag.app.server.app import _sse
    from kvboost_rag.app.server.metrics import Metrics
    from kvboost_rag.app.server.scheduler import Started

    metrics = Metrics()
    state: Any = SimpleNamespace(model_name="m", metrics=metrics, scheduler=SimpleNamespace(cancel=lambda r: None))

    async def go() -> None:
        q: asyncio.Queue = asyncio.Queue()
        for piece in ("a", "b"):
            q.put_nowait(("text", piece))
        gen = _sse(state, q, object(), Started(3, 0, 0.1), 1e12, "id", 0, False, False, "/v1/completions")
        await gen.__anext__()  # one chunk sent, then the client goes away
        await gen.aclose()

    asyncio.run(go())
    counts = {s.labels["status"]: s.value for m in metrics.requests.collect() for s in m.samples
              if s.name.endswith("_total")}
    assert counts.get("200", 0) == 0 and counts.get("499") == 1

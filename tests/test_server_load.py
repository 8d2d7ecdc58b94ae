"""Continuous batching under load, and backpressure: 64 requests at concurrency 8 give the sequential greedy
outputs with no errors; a client disconnect frees its batch slot; a full queue answers 429 with Retry-After; a
request past its timeout answers 504."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _server_fixture import demo_workload, running_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def _wait_for(srv, pred, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(srv)
        if pred(h):
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; /health says {h}")
        time.sleep(0.05)


def test_load_64_requests_at_concurrency_8_equal_sequential(tmp_path):
    corpus, work = demo_workload(64)
    prompts = [p for p, _ in work]
    with running_server(tmp_path, "--max-batch", "8") as srv:
        assert httpx.post(srv.v1 + "/documents", json={"documents": corpus}, timeout=120).status_code == 200
        client = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)

        def ask(prompt: str) -> tuple[str, int, int]:
            out = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
            d = out.usage.prompt_tokens_details  # exact (cached_tokens) and approximate reuse, counted apart
            return out.choices[0].text, out.usage.completion_tokens, d.cached_tokens + d.model_extra[
                "cached_tokens_approximate"]

        sequential = [ask(p) for p in prompts]
        steps_sequential = _steps(srv)
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, p) for p in prompts]
            concurrent = [f.result() for f in futures]  # raises on any error: 0 errors allowed
        steps_concurrent = _steps(srv) - steps_sequential
    assert [c[0] for c in concurrent] == [s[0] for s in sequential]
    assert all(c[2] > 0 for c in concurrent)  # warmed documents (and the first pass's prefixes) were reused
    # one request at a time needs (tokens - 1) decode steps each; batched, the requests shared steps
    assert steps_sequential == sum(s[1] - 1 for s in sequential)
    assert steps_concurrent < steps_sequential / 2


def _steps(srv) -> float:
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(next(ln.split()[-1] for ln in metrics.splitlines()
                      if ln.startswith("kvboost_decode_step_seconds_count")))


def test_disconnect_queue_full_and_timeout(tmp_path):
    # one slot, one queue place, slow decode (a test-only delay) so the states can be observed deterministically
    args = ("--max-batch", "1", "--max-queue", "1", "--request-timeout", "4", "--debug-step-delay", "0.02")
    with running_server(tmp_path, *args) as srv:
        long = {"model": "demo", "prompt": "Documents:\n\n", "max_tokens": 1500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        # a disconnect mid-stream frees the slot
        with httpx.Client(timeout=30) as c, c.stream("POST", srv.v1 + "/completions", json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert _health(srv)["running"] == 1
        _wait_for(srv, lambda h: h["running"] == 0, "the slot to be freed after the client disconnected")

        # slot taken (streaming), queue place taken (waiting), the next one gets 429 with Retry-After
        with httpx.Client(timeout=30) as c, c.stream("POST", srv.v1 + "/completions", json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: a collected one closes the stream (a disconnect)
            assert next(lines).startswith("data: ")
            waited: dict = {}

            def queued() -> None:
                waited["r"] = httpx.post(srv.v1 + "/completions", timeout=30, json={**long, "stream": False})

            t = threading.Thread(target=queued)
            t.start()
            _wait_for(srv, lambda h: h["queued"] == 1, "the second request to queue")
            full = httpx.post(srv.v1 + "/completions", json={"model": "demo", "prompt": "x"}, timeout=30)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            # --request-timeout covers streams too: the first one ends with an error chunk after 4 s ...
            rest = [ln for ln in lines if ln]
            assert any('"timeout_error"' in ln for ln in rest) and rest[-1] == "data: [DONE]"
            t.join(timeout=30)
            # ... and the queued one, admitted then, runs out of time before its 1500 tokens: 504, OpenAI-shaped
            assert waited["r"].status_code == 504 and waited["r"].json()["error"]["type"] == "timeout_error"
        _wait_for(srv, lambda h: h["running"] == 0 and h["queued"] == 0, "the server to drain")
        ok = httpx.post(srv.v1 + "/completions", json={"model": "demo", "prompt": "Question:", "max_tokens": 3,
                                                       "temperature": 0}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1

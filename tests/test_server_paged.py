"""The server's scheduler over a page pool (serve --kv-pool, issue #36): outputs equal engine.generate, concurrent
requests over the same documents share pages, a request the pool cannot hold yet waits (parked) and then runs, one
it can never hold gets a 400 naming max_tokens, every page returns to the pool, and /metrics shows the pages."""

from __future__ import annotations

import pytest
from conftest import CORPUS
from test_server_scheduler import Events

from kvboost_core.decode import SamplingParams
from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

MB = 1 << 20


@pytest.fixture()
def rag(tokenizer, tiny_llama):
    r = KVBoostRAG(KVEngine(tiny_llama, tokenizer, sink_tokens=4))
    r.warm_documents(CORPUS[:3], progress=False)
    return r


def _prompt(i: int) -> str:
    return f"{CORPUS[0]}\n\n{CORPUS[1]}\n\nQuestion {i}: where was Alice born?"


def _run(sched: Scheduler, rag, prompts: list[str], n: int) -> list[Events]:
    events = []
    for p in prompts:
        ev = Events()
        sched.submit(GenRequest(rag=rag, params=SamplingParams.create(n), emit=ev, prompt=p, ignore_eos=True))
        events.append(ev)
    for ev in events:
        ev.wait()
    return events


def _page_bytes(rag, p_tok: int) -> int:
    d = rag.engine.driver
    return 2 * d.num_layers * d.num_kv_heads * p_tok * d.head_dim * 4


def test_paged_requests_share_pages_and_answer_as_generate(rag):
    sched = Scheduler(rag.engine.driver, max_batch=4, kv_pool_bytes=4 * MB, page_tokens=8, step_delay=0.02)
    sched.start()
    seen: list = []
    try:
        prompts = [_prompt(i) for i in range(3)]
        events = [Events() for _ in prompts]
        for p, ev in zip(prompts, events):
            sched.submit(GenRequest(rag=rag, params=SamplingParams.create(10), emit=ev, prompt=p, ignore_eos=True))
        while not all(ev.done.is_set() for ev in events):  # the pool's counts, read on the engine thread
            seen.append(sched.call(lambda: sched.decoder.stats()).result(timeout=60))
        ref = [rag.generate(p, max_new_tokens=10, store_prefix=False).text for p in prompts]
        assert [ev.text for ev in events] == ref
        assert max(s.shared for s in seen) > 0  # the documents' pages, held once for the requests decoding
        final = sched.call(lambda: sched.decoder.stats()).result(timeout=60)
        assert final.used == 0 and final.published == 0
    finally:
        sched.shutdown()


def test_a_request_the_pool_cannot_hold_yet_waits_and_one_it_never_can_is_refused(rag):
    n_prompt = len(rag.token_ids(_prompt(0)))
    p_tok = 8
    one = -(-(n_prompt + 12) // p_tok)  # one request's pages at its capacity
    sched = Scheduler(rag.engine.driver, max_batch=4, kv_pool_bytes=(one + one // 2) * _page_bytes(rag, p_tok),
                      page_tokens=p_tok)
    sched.start()
    try:
        # different questions after the documents: the shared pages do not make two fit at once
        prompts = [f"Question {i}: who? " * 3 + _prompt(i) for i in range(2)]
        events = _run(sched, rag, prompts, 12)
        ref = [rag.generate(p, max_new_tokens=12, store_prefix=False).text for p in prompts]
        assert [ev.items[-1][0] for ev in events] == ["done", "done"] and [ev.text for ev in events] == ref
        big = _run(sched, rag, [_prompt(9)], 2 * one * p_tok)[0]  # more pages than the whole pool, within context
        kind, err = big.items[-1]
        assert kind == "error" and err.status == 400 and err.param == "max_tokens" and "KV pool" in str(err)
        assert sched.call(lambda: sched.decoder.stats().used).result(timeout=60) == 0
    finally:
        sched.shutdown()


def test_metrics_show_the_pool(rag):
    pytest.importorskip("prometheus_client")
    from kvboost_rag.app.server.metrics import Metrics

    sched = Scheduler(rag.engine.driver, max_batch=2, kv_pool_bytes=2 * MB, page_tokens=8)
    text = Metrics().render(sched, lambda: {}).decode()
    free = sched.decoder.pool.num_pages
    assert f'kvboost_kv_pages{{state="free"}} {free:.1f}' in text and 'kvboost_kv_pages{state="used"} 0.0' in text


def test_the_pool_benchmark_runs_and_shares(rag):
    """benchmarks/bench_kv_pool.py's measurement on the tiny model: both decoders give the same tokens, and the
    pool holds the shared documents once (the figures themselves come from the benchmark, not from here)."""
    from kvboost_rag.app.bench.kv_pool import measure

    r = measure(rag, c=3, doc_tokens=500, steps=2, page_tokens=8, budget_requests=2)  # several documents
    assert r["same_tokens"] and r["paged"]["pages_shared"] > 0
    assert r["paged"]["kv_bytes"] < r["dense"]["kv_bytes"]
    assert r["budget"]["paged_requests"] > r["budget"]["dense_requests"] == 2
    moved = r["paged_shuffled"]  # documents in other orders: equal pages only where positions agree
    assert r["paged"]["pages_shared"] > moved["pages_shared"] and moved["kv_bytes"] > r["paged"]["kv_bytes"]


def test_cancelled_and_failed_requests_return_their_pages(rag, monkeypatch):
    """A request cancelled mid-decode, and every request of a failed step, give their pages back."""
    import time

    sched = Scheduler(rag.engine.driver, max_batch=4, kv_pool_bytes=4 * MB, page_tokens=8, step_delay=0.02)
    sched.start()
    try:
        ev = Events()
        req = GenRequest(rag=rag, params=SamplingParams.create(200), emit=ev, prompt=_prompt(0), ignore_eos=True)
        sched.submit(req)
        deadline = time.time() + 60
        while not any(k == "text" for k, _ in ev.items) and time.time() < deadline:
            time.sleep(0.01)
        assert sched.call(lambda: sched.decoder.stats().used).result(timeout=60) > 0
        sched.cancel(req)
        while sched.call(lambda: sched.running).result(timeout=60) and time.time() < deadline:
            time.sleep(0.01)
        assert sched.call(lambda: sched.decoder.stats().used).result(timeout=60) == 0

        def broken(*a, **k):
            raise RuntimeError("step failed")

        events = [Events() for _ in range(2)]
        for i, e in enumerate(events):
            sched.submit(GenRequest(rag=rag, params=SamplingParams.create(50), emit=e, prompt=_prompt(i),
                                    ignore_eos=True))
        while sched.call(lambda: sched.running).result(timeout=60) < 1 and time.time() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(sched.decoder, "step", broken)
        for e in events:
            assert e.wait()[0] == "error"
        assert sched.call(lambda: sched.decoder.stats().used).result(timeout=60) == 0
    finally:
        sched.shutdown()

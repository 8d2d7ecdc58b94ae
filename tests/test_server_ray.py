"""`kvboost-rag serve --ray`: two Ray Serve replicas of the server on this machine share one real redis-server,
so a document warmed through one replica is a hit on the other. Also the flags' errors (no Ray needed) and the
shared document catalogue on its own (redis only)."""

from __future__ import annotations

import argparse
import time

import pytest
from _redis_fixture import free_port, redis_server, redis_url  # noqa: F401
from _server_fixture import demo_workload

from kvboost_rag.app.server import factory as server_factory
from kvboost_rag.app.server import main as server_main

httpx = pytest.importorskip("httpx")


def _args(*argv: str):
    p = argparse.ArgumentParser()
    server_main.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray-address", "auto"], "--ray-address needs --ray"),
    (["--ray", "--replicas", "2"], "needs a shared --store redis://"),
    (["--ray", "--replicas", "3", "--store", "disk:/tmp/x"], "needs a shared --store redis://"),
])
def test_flag_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        server_factory.access(_args(*argv))


def test_replicas_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        _args("--ray", "--replicas", "0")
    assert "must be >= 1" in capsys.readouterr().err


def test_one_replica_may_use_any_store():
    keys, host = server_factory.access(_args("--ray", "--replicas", "1"))
    assert keys is None and host == "127.0.0.1"


def test_catalogue_shares_texts_once_per_namespace(redis_url):  # noqa: F811
    pytest.importorskip("redis")
    from kvboost_rag.app.server.catalogue import DocumentCatalogue

    a, b = DocumentCatalogue(redis_url, "fp1"), DocumentCatalogue(redis_url, "fp1")
    assert a.publish("default", ["doc one", "doc two", "doc one", ""]) == 2
    assert b.publish("default", ["doc two", "doc three"]) == 1  # doc two was already published by a
    assert b.pull("default") == ["doc one", "doc two", "doc three"]
    assert b.pull("default") == []  # each text once per process
    assert a.pull("default", limit=2) == ["doc one", "doc two"] and a.pull("default") == ["doc three"]
    assert a.pull("tenant-b") == [] and DocumentCatalogue(redis_url, "fp2").pull("default") == []
    with pytest.raises(ValueError, match="url"):
        DocumentCatalogue("memory", "fp1")


def test_catalogue_degrades_when_redis_is_down():
    pytest.importorskip("redis")
    from kvboost_rag.app.server.catalogue import DocumentCatalogue

    cat = DocumentCatalogue(f"redis://127.0.0.1:{free_port()}/0", "fp1", socket_timeout=0.2)
    assert cat.publish("default", ["a document"]) == 0 and cat.pull("default") == []


@pytest.mark.slow
@pytest.mark.redis
def test_document_warmed_through_one_replica_is_a_hit_on_the_other(redis_url):  # noqa: F811
    pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'kvboost-rag[ray]')")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'kvboost-rag[ray]')")
    pytest.importorskip("fastapi")
    from kvboost_rag.app import demo_data as dd
    from kvboost_rag.app.server import ray_serve

    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    corpus, work = demo_workload(4)
    prompts = [p for p, _ in work]
    docs = [t for t in corpus if any(t in p for p in prompts)]
    assert docs, "the demo prompts contain no corpus document"
    args = _args("--ray", "--replicas", "2", "--model", "demo", "--store", redis_url, "--port", str(free_port()),
                 "--default-temperature", "0", "--max-queue", "8")
    keys, host = server_factory.access(args)
    t0 = time.monotonic()
    started = ray_serve.connect("local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024**2,
                                log_to_driver=False)
    try:
        url = ray_serve.deploy(args, keys, host)
        with httpx.Client(base_url=url, timeout=60) as http:
            warm = http.post("/v1/documents", json={"documents": docs})
            assert warm.status_code == 200, warm.text
            assert warm.json()["warmed"] == len(docs)
            warmer = warm.headers[ray_serve.REPLICA_HEADER]
            answers: list[tuple[str, int]] = []
            for i in range(16):  # Ray picks a replica per request: stop once both have answered, at most 16
                r = http.post("/v1/chat/completions", json={
                    "model": "demo", "max_tokens": 3,
                    "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]})
                assert r.status_code == 200, r.text
                details = r.json()["usage"]["prompt_tokens_details"]  # exact and approximate reuse, apart
                answers.append((r.headers[ray_serve.REPLICA_HEADER],
                                details["cached_tokens"] + details["cached_tokens_approximate"]))
                if len({name for name, _ in answers}) == 2:
                    break
            other = [cached for name, cached in answers if name != warmer]
            assert other, f"Ray routed all {len(answers)} requests to the warming replica"
            assert all(cached > 0 for cached in other), answers  # B reused KV that A computed, via redis
            stats = {}
            for _ in range(16):  # the stats name their replica; the other one registered the documents too
                s = http.get("/v1/documents/stats")
                assert s.status_code == 200 and s.json()["replica"] == s.headers[ray_serve.REPLICA_HEADER]
                stats[s.json()["replica"]] = s.json()
                if len(stats) == 2:
                    break
            print(stats)
            assert len(stats) == 2 and all(v["documents"] == len(docs) for v in stats.values()), stats
    finally:
        ray_serve.stop(started)
    print(f"ray serve test: {time.monotonic() - t0:.1f} s with {len(answers)} chat requests")

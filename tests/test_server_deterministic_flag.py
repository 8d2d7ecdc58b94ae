"""``kvboost-rag serve --deterministic/--no-deterministic``: parsed (on by default), carried to Ray Serve
replicas, built into the scheduler's decoder and reported by /health."""

from __future__ import annotations

import argparse

import pytest

from kvboost_rag.app import demo_data as dd
from kvboost_rag.app.server import main as server_main
from kvboost_rag.app.server.ray_serve import replica_params


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    server_main.add_arguments(p)
    return p.parse_args(["--model", "demo", *argv])  # serve defaults to SmolLM2: too slow here


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--deterministic"], True),
                                                 (["--no-deterministic"], False)])
def test_flag_parses_and_travels_to_replicas(argv, expected):
    args = _args(*argv)
    assert args.deterministic is expected
    assert replica_params(args)["deterministic"] is expected
    with pytest.raises(TypeError, match="args"):
        replica_params(vars(args))  # type: ignore[arg-type]


@pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is missing")
@pytest.mark.parametrize("deterministic", [True, False])
def test_flag_reaches_the_decoder_and_health(deterministic):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from kvboost_rag.app.server.factory import build

    args = _args() if deterministic else _args("--no-deterministic")
    app, _host = build(args)
    with TestClient(app) as client:  # its exit runs the app's shutdown: the scheduler stops
        assert app.state.kv.scheduler.decoder.deterministic is deterministic
        body = client.get("/health").json()
    assert body["status"] == "ok" and body["deterministic"] is deterministic

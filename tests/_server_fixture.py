"""A real ``kvboost-rag serve`` on loopback for the server tests: started in a subprocess on a free port,
waited for through /health (bounded), stopped by its PID."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvboost_rag.app.server.launch import free_port, launched

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"sk-tenant-a-0001": "tenant-a", "sk-tenant-b-0002": "tenant-b"}
KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    pid: int

    @property
    def v1(self) -> str:
        return self.url + "/v1"


_free_port = free_port  # the tests' name for it


@contextmanager
def running_server(tmp: Path, *args: str, keys: dict[str, str] | None = None,
                   start_timeout: float = 90.0) -> Iterator[Server]:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")

    from kvboost_rag.app import demo_data as dd

    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    model = [] if "--model" in args else ["--model", "demo"]  # serve's default is SmolLM2: too slow for tests
    cmd = [*model, *args]
    if keys is not None:
        key_file = tmp / "keys.json"
        key_file.write_text(json.dumps(keys))
        cmd += ["--namespace-keys", str(key_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations"),
                                                       os.environ.get("PYTHONPATH", "")]))
    with tempfile.NamedTemporaryFile("w+", dir=tmp, prefix="server-", suffix=".log", delete=False) as log, launched(cmd, env=env, log=log, start_timeout=start_timeout) as (
            url, proc):
        yield Server(url, proc.pid)


def demo_workload(n: int) -> tuple[list[str], list[tuple[str, str]]]:
    """(corpus texts, [(RAG prompt, expected answer)]) from the demo model's corpus and held-out questions."""
    from kvboost_rag.app import demo_data as dd

    corpus = {d["id"]: d["text"] for d in dd.load_corpus()}
    qs = dd.load_heldout()[:n]
    return list(corpus.values()), [(dd.heldout_prompt(q, corpus), q["answer"]) for q in qs]

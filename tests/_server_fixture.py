"""A real ``kvboost-rag serve`` on loopback for the server tests: started in a subprocess on a free port,
waited for through /health (bounded), stopped by its PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(tmp: Path, *args: str, keys: dict[str, str] | None = None,
                   start_timeout: float = 90.0) -> Iterator[Server]:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx

    from kvboost_rag.app import demo_data as dd

    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    port = _free_port()
    model = [] if "--model" in args else ["--model", "demo"]  # serve's default is SmolLM2: too slow for tests
    cmd = [sys.executable, "-m", "kvboost_rag.app.cli", "serve", "--port", str(port), *model, *args]
    if keys is not None:
        key_file = tmp / "keys.json"
        key_file.write_text(json.dumps(keys))
        cmd += ["--namespace-keys", str(key_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations"),
                                                       os.environ.get("PYTHONPATH", "")]))
    log = open(tmp / f"server-{port}.log", "w+")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {start_timeout:.0f} s")
            time.sleep(0.3)
        yield Server(url, proc.pid)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        log.close()


def demo_workload(n: int) -> tuple[list[str], list[tuple[str, str]]]:
    """(corpus texts, [(RAG prompt, expected answer)]) from the demo model's corpus and held-out questions."""
    from kvboost_rag.app import demo_data as dd

    corpus = {d["id"]: d["text"] for d in dd.load_corpus()}
    qs = dd.load_heldout()[:n]
    return list(corpus.values()), [(dd.heldout_prompt(q, corpus), q["answer"]) for q in qs]

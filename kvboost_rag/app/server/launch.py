"""``kvboost-rag serve`` in a subprocess on a free loopback port: what the benchmarks and the server tests start.

Bounded start (``/health`` polled until ``start_timeout``; an early exit raises with the log's tail), stopped by
its PID (SIGTERM, then SIGKILL after ``stop_timeout``). The port is chosen here and passed as ``--port``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def launched(args: Sequence[str], *, env: Mapping[str, str] | None = None, log: IO[str] | None = None,
             start_timeout: float = 90.0, stop_timeout: float = 15.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvboost-rag serve ARGS --port P``: (``http://127.0.0.1:P``, the process) once ``/health`` answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kvboost_rag.app.cli", "serve", *args, "--port", str(port)]
    out = log if log is not None else tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=dict(env) if env is not None else None, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                out.seek(0)
                raise RuntimeError(f"kvboost-rag serve exited with {proc.returncode}:\n{out.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvboost-rag serve did not answer /health within {start_timeout:.0f} s")
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if log is None:
            out.close()

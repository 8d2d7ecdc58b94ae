"""``kvboost-rag serve`` start and stop (issue 34, item 7): a taken port or a wrong ``--model`` is one error line
and exit status 2 before anything loads; ``--help`` states every default; SIGTERM is a clean exit (status 0)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _server_fixture import ROOT, _free_port

from kvboost_rag.app import cli
from kvboost_rag.app.cli_util import UserError

ERROR = re.compile(r"^kvboost-rag: error: [^\n]+\n$")


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "integrations"), os.environ.get("PYTHONPATH", "")]), **extra)


def _serve(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvboost_rag.app.cli", "serve", *args], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=60)
    return proc, time.perf_counter() - t0


def test_serve_port_in_use_is_one_line_at_once():
    """A taken port loaded the model for 16 s, announced serving, then failed in uvicorn's words (exit 3)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, seconds = _serve("--port", str(port))  # the default model: never loaded, the port comes first
    assert proc.returncode == 2, proc.stderr
    assert ERROR.match(proc.stderr) and f"--port {port}" in proc.stderr and "in use" in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert seconds < 2.0, seconds


@pytest.mark.parametrize("model, env", [("/nonexistent/kvboost-model", {}),
                                        ("no-such-model", {"HF_HUB_OFFLINE": "1"})])
def test_serve_wrong_model_is_one_line_at_once(model, env):
    """A wrong --model took 17 s to fail (torch, transformers and the app were imported first)."""
    proc, seconds = _serve("--model", model, "--port", str(_free_port()), **env)
    assert proc.returncode == 2, proc.stderr
    assert ERROR.match(proc.stderr) and f"--model {model}" in proc.stderr, proc.stderr
    assert seconds < 2.0, seconds


def test_bind_binds_the_port_or_names_it():
    from kvboost_rag.app.server.main import bind

    sock = bind("127.0.0.1", _free_port())
    try:
        port = sock.getsockname()[1]
        sock.listen()  # as uvicorn does with it
        with pytest.raises(UserError, match=f"--port {port}: cannot listen on 127.0.0.1:{port} .in use"):
            bind("127.0.0.1", port)
    finally:
        sock.close()
    with pytest.raises(UserError, match="--host no-such-host.invalid"):
        bind("no-such-host.invalid", 8000)


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_serve_help_states_every_default():
    """--max-batch, --max-queue, --request-timeout and --default-temperature did not say their defaults."""
    parser = _serve_parser()
    checked = 0
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or action.default in (None, False, argparse.SUPPRESS):
            continue
        name = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            assert f"(default {'on' if action.default else 'off'})" in action.help, name
            checked += 1
            continue
        found = re.search(r"\(default:? ([^;,)\s]+)", action.help)
        assert found, f"{name}: its help does not state its default {action.default!r}"
        text = found.group(1)
        convert = action.type if callable(action.type) else type(action.default)
        assert convert(text) == action.default, f"{name}: help says {text!r}, the default is {action.default!r}"
        checked += 1
    assert checked >= 12  # --model, --port, --store, --max-batch, ... --default-temperature


def test_serve_help_points_at_the_serving_page():
    text = _serve_parser().format_help()
    assert "README" not in text and "docs/serving.md" in text
    assert (ROOT / "docs" / "serving.md").is_file()


def test_sigterm_while_loading_exits_zero(monkeypatch, capsys):
    """SIGTERM before the server serves (here: while the engine loads) stops the command with status 0."""
    from kvboost_rag.app.server import main as server_main

    def build(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the load")

    monkeypatch.setattr(server_main, "build", build)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["serve", "--port", str(_free_port())]) == 0  # the default model: never loaded here
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    assert "error" not in capsys.readouterr().err


def test_sigterm_while_serving_exits_zero(tmp_path):
    """`serve` exited 143 on SIGTERM (uvicorn raises it again after its graceful shutdown)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx

    from kvboost_rag.app import demo_data as dd

    if not dd.demo_model_available():
        pytest.skip("the embedded demo model is missing")
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvboost_rag.app.cli", "serve", "--model", "demo",
                                 "--port", str(port)], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not answer /health within 90 s"
                time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    assert rc == 0, log_path.read_text()[-3000:]
    assert "Traceback" not in Path(log_path).read_text()

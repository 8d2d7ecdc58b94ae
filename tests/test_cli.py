"""Smoke tests of the ``kvboost-rag`` CLI: demo, warm, fidelity (and bench's forwarding, when present)."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import SHARED_STORIES

from kvboost_rag.app import cli
from kvboost_rag.app import demo_data as dd


@pytest.fixture(autouse=True)
def _restore_threads():
    """cli.main sets torch's thread count (--threads); keep that from leaking into other test modules."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)



def test_demo_runs_end_to_end(capsys):
    pytest.importorskip("langchain_classic")
    pytest.importorskip("faiss")
    assert cli.main(["demo", "--model", "demo", "--questions", "2", "--top-k", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("Q: ") == 2
    assert "TTFT reuse" in out and "full prefill" in out and "reuse ratio" in out
    assert "median TTFT" in out and "same answer as full prefill on" in out
    if dd.demo_model_available():
        assert "accuracy: with reuse" in out
    else:
        assert "tiny random model" in out


def test_demo_on_another_chat_model(tiny_dir, capsys):
    """A model with a chat template gets the chat demo (the tiny model's answers are noise; the run is real)."""
    pytest.importorskip("langchain_classic")
    assert cli.main(["demo", "--model", str(tiny_dir), "--questions", "1", "--top-k", "2", "--no-progress",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "Part 1" in out and "Part 2" in out and "reuse: " in out and "full: " in out
    assert "Where the time went" in out and "docs/figures.md" in out
    assert "x faster" in out or "x slower" in out


def test_demo_context_overflow_is_one_line(tiny_dir, capsys):
    assert cli.main(["demo", "--model", str(tiny_dir), "--questions", "1", "--no-progress", "--threads", "1"]) == 2
    assert "context is 2048 tokens" in capsys.readouterr().err


def test_warm_to_disk_store(tiny_dir, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(["Alice lives in Portvale and works as a chemist.",
                              "Bruno was born in Essberg in 1961.", "Chen spends weekends sailing."]):
        (docs / f"{i}.txt").write_text(text, encoding="utf-8")
    store = tmp_path / "kv"
    args = ["warm", "--model", str(tiny_dir), "--docs", str(docs), "--store", f"disk:{store}", "--no-progress",
            "--threads", "1"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "documents 3: warmed 3" in out
    assert any(store.rglob("*")), "the disk store wrote nothing"
    disk_line = next(line for line in out.splitlines() if line.startswith("store disk"))
    assert " 0 entries" not in disk_line and "DEGRADED" not in disk_line
    assert cli.main(args) == 0  # a second process finds the documents in the disk store
    out = capsys.readouterr().out
    assert "warmed 0, already warm 3" in out
    # the disk tier reports its own entries (it used to print the empty memory tier's "0 entries")
    assert next(line for line in out.splitlines() if line.startswith("store disk")) == disk_line


def test_warm_reads_jsonl_and_rejects_bad_input(tiny_dir, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["one document here", "another one"]) + "\n")
    assert cli.main(["warm", "--model", str(tiny_dir), "--docs", str(src), "--store", "memory",
                     "--no-progress", "--threads", "1"]) == 0
    assert "documents 2: warmed 2" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    assert cli.main(["warm", "--model", str(tiny_dir), "--docs", str(bad), "--store", "memory"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "no string 'text' field" in err


def test_fidelity_json_parses(tiny_dir, capsys):
    assert cli.main(["fidelity", "--model", str(tiny_dir), "--prompts", "3", "--max-new-tokens", "4",
                     "--json", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["summary"]) == {"none", "selective", "cacheblend"}
    assert report["summary"]["cacheblend"]["prompts"] == 3
    assert report["summary"]["none"]["reuse_ratio"] > 0.3  # the reordered documents were re-placed


@pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is not built")
def test_fidelity_table_on_demo_model(capsys):
    assert cli.main(["fidelity", "--model", "demo", "--prompts", "3", "--max-new-tokens", "4", "--repairs",
                     "none,cacheblend"]) == 0
    out = capsys.readouterr().out
    assert "cacheblend" in out and "mean KL" in out


def test_fidelity_passes_cacheblend_knobs(tiny_dir, capsys):
    """--recompute-ratio 1.0 recomputes every re-placed token: cacheblend then equals full prefill."""
    assert cli.main(["fidelity", "--model", str(tiny_dir), "--prompts", "2", "--max-new-tokens", "2", "--repairs",
                     "cacheblend", "--recompute-ratio", "1.0", "--check-layer", "0", "--json", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]["cacheblend"]
    assert summary["mean_kl"] < 1e-6 and summary["top1_agree"] == 1.0


def test_bench_forwards_arguments(capsys):
    assert cli.main(["bench", "--help"]) == 0  # bench's own parser, run under the CLI's one-line guard
    assert "--shape" in capsys.readouterr().out


def test_missing_subcommand_is_an_error():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_bench_runs_on_tiny_settings(tmp_path):
    import json

    from kvboost_rag.app.bench.ttft import main as bench_main

    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    stories = SHARED_STORIES if SHARED_STORIES.exists() else tmp_path / "no-stories"
    assert bench_main(["--shape", "tiny", "--sizes", "2", "--rounds", "1", "--doc-tokens", "64",
                       "--question-tokens", "8", "--chat-turns", "2", "--json", str(out), "--plot", str(png),
                       "--demo-questions", "3", "--stories", str(stories), "--stories-prompts", "2"]) == 0
    data = json.loads(out.read_text())
    methods = data["workload_a"]["sizes"]["2"]["methods"]
    assert {"full", "prefix_cache", "cold", "none", "selective", "cacheblend", "exact_repeat"} <= set(methods)
    assert methods["exact_repeat"]["reuse_ratio"] > 0.9 and methods["cold"]["reuse_ratio"] == 0
    assert len(data["workload_b"]["turns"]) == 2 and data["workload_b"]["turns"][1]["reused_exact"] > 0
    assert png.stat().st_size > 0
    quality = data["quality"]
    acc = quality["demo_accuracy"]
    if dd.demo_model_available():
        assert set(acc["methods"]) == {"full", "none", "selective", "cacheblend"} and acc["questions"] == 3
        assert acc["methods"]["full"]["agreement_with_full"] == 1.0
        assert acc["methods"]["full"]["reuse_ratio"] == 0 < acc["methods"]["cacheblend"]["reuse_ratio"]
    else:
        assert "no demo model" in acc["skipped"]
    fid = quality["stories_fidelity"]
    if SHARED_STORIES.exists():
        summary = fid["summary"]
        assert set(summary) == {"none", "selective", "cacheblend"} and fid["prompts"] == 2
        assert all(0 <= s["top1_agree"] <= 1 and s["mean_kl"] >= 0 and s["reuse_ratio"] > 0 for s in summary.values())
    else:
        assert "no model at" in fid["skipped"]


def test_demo_accuracy_rejects_no_questions():
    from kvboost_rag.app.bench.quality import demo_accuracy

    with pytest.raises(ValueError, match="n_questions"):
        demo_accuracy(0)


def test_calibrate_writes_defaults_beside_the_weights(tiny_dir, tmp_path, capsys):
    import shutil

    from kvboost_core.tuning.calibrate import DEFAULTS_FILE, load_defaults

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    assert cli.main(["calibrate", "--model", str(model_dir), "--prompts", "2", "--max-kl", "1e9", "--min-top1", "0",
                     "--write", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "meets the target" in out and DEFAULTS_FILE in out
    assert load_defaults(model_dir) == {"recompute_ratio": 0.15, "check_layer": 1}


def test_help_imports_neither_torch_nor_transformers():
    """`kvboost-rag --help` must be instant: nothing heavy is imported before a command runs."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvboost_rag.app import cli\nfor argv in (['--help'], ['warm', '--help'], "
            "['fidelity', '--help']):\n    try:\n        cli.main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('torch', 'transformers', 'langchain_core', 'llama_index.core') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "--allow-degraded" in out.stdout and "cacheblend" in out.stdout  # options and choices documented


LIGHT = [(["bench", "--help"], 0), (["bench", "rag", "--help"], 0), (["bench", "multiturn", "--help"], 0),
         (["bench", "multiturn", "--turns", "x"], 2), (["bench", "multiturn", "--model", "nope"], 2),
         (["adapt", "--help"], 0),
         (["adapt", "--block", "--help"], 0), (["bench", "rag", "--settings", "bogus"], 2),
         (["bench", "rag", "--k", "0"], 2), (["bench", "--rounds", "x"], 2), (["adapt", "--out", "o", "--k", "a"], 2),
         (["adapt", "--block", "--out", "o", "--synth-share", "2"], 2),
         (["adapt", "--block", "--out", "o", "--data-worker", "0/2"], 2),
         (["adapt", "--block", "--out", "o", "--data-only", "--data-worker", "2/2"], 2),
         (["bench", "rag", "--model", "nope"], 2), (["bench", "--model", "nope"], 2),
         (["adapt", "--model", "nope", "--out", "o"], 2), (["adapt", "--block", "--model", "nope", "--out", "o"], 2)]


def test_bench_and_adapt_help_and_errors_import_no_torch():
    """`bench --help`, `bench rag --help` and `adapt --help` took 7-9 s: torch was imported before argparse ran.
    Help, argument errors and a --model that names nothing loadable must come before torch loads."""
    import os
    import subprocess
    import sys

    code = ("import json, sys\nfrom kvboost_rag.app import cli\nrcs = []\nfor argv in json.loads(sys.argv[1]):\n"
            "    try:\n        rcs.append(cli.main(argv))\n    except SystemExit as e:\n        rcs.append(e.code)\n"
            "print(json.dumps([rcs, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps([a for a, _ in LIGHT])], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rcs, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert rcs == [rc for _, rc in LIGHT], out.stderr
    assert heavy == []
    assert "Traceback" not in out.stderr, out.stderr


BAD_MODEL = [["bench", "rag", "--model", "nope"], ["bench", "rag", "--model", "/nonexistent/model-dir"],
             ["bench", "--model", "nope"], ["bench", "multiturn", "--model", "nope"],
             ["adapt", "--model", "nope", "--out", "o"],
             ["adapt", "--block", "--model", "nope", "--out", "o"]]


@pytest.mark.parametrize("argv", BAD_MODEL, ids=[" ".join(a) for a in BAD_MODEL])
def test_bench_and_adapt_unknown_model_is_one_line(argv, monkeypatch, capsys):
    """`bench rag --model nope` printed a 92-line traceback after 63 s."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model {argv[argv.index('--model') + 1]}" in err, err
    assert "Traceback" not in err and "error:" in err


def test_every_option_has_help():
    import argparse

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in subs.choices.items():
        if name == "bench":
            continue
        for action in sp._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


BAD_ARGS = [
    (["warm", "--docs", "x", "--store", "bogus"], "--store"),
    (["warm", "--docs", "x", "--store", "memory", "--chunk-size", "-5"], "--chunk-size"),
    (["warm", "--docs", "x", "--store", "memory", "--batch-size", "0"], "--batch-size"),
    (["fidelity", "--recompute-ratio", "2"], "--recompute-ratio"),
    (["fidelity", "--repairs", "none,bogus"], "bogus"),
    (["fidelity", "--prompts", "0"], "--prompts"),
    (["fidelity", "--check-layer", "-1"], "--check-layer"),
    (["calibrate", "--min-top1", "1.5"], "--min-top1"),
    (["demo", "--questions", "0"], "--questions"),
    (["demo", "--threads", "0"], "--threads"),
    (["fidelity", "--model", "/nonexistent/model-dir", "--threads", "1"], "/nonexistent/model-dir"),
    (["warm", "--docs", "/nonexistent/docs", "--store", "memory"], "/nonexistent/docs"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_user_errors_are_one_line_and_exit_2(argv, named, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "error:" in captured.err and named in captured.err, captured.err
    assert "Traceback" not in captured.err


def test_debug_shows_the_traceback():
    with pytest.raises(Exception, match="no such model directory"):
        cli.main(["fidelity", "--model", "/nonexistent/model-dir", "--debug", "--threads", "1"])


def test_warm_against_redis_that_is_down_fails_unless_degraded_is_allowed(tiny_dir, tmp_path, capsys):
    pytest.importorskip("redis")
    from _redis_fixture import free_port

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Alice lives in Portvale and works as a chemist."}) + "\n")
    base = ["warm", "--model", str(tiny_dir), "--docs", str(docs), "--store", f"redis://127.0.0.1:{free_port()}/0",
            "--no-progress", "--threads", "1"]
    with pytest.warns(RuntimeWarning):
        assert cli.main(base) == 1
    captured = capsys.readouterr()
    assert "unavailable" in captured.err and "redis" in captured.err and "documents 1" not in captured.out
    with pytest.warns(RuntimeWarning):
        assert cli.main(base + ["--allow-degraded"]) == 0
    out = capsys.readouterr().out
    assert "documents 1: warmed 1" in out
    assert "store memory: 1 entries" in out or "store memory: 2 entries" in out
    assert "store redis" in out and "DEGRADED" in out


def test_fidelity_table_speaks_of_speedup_as_full_over_reuse(tiny_dir, capsys):
    assert cli.main(["fidelity", "--model", str(tiny_dir), "--prompts", "2", "--max-new-tokens", "1",
                     "--repairs", "cacheblend", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "TTFT speedup" in out and "full-prefill TTFT / reuse TTFT" in out
    assert "x faster" in out or "x slower" in out  # a measured timing: reuse on the tiny model can be slower


def test_format_speedup():
    from kvboost_rag.app.cli_util import format_speedup

    assert format_speedup(4.0, 1.0) == "4.00x faster"
    assert format_speedup(0.86, 1.0) == "1.16x slower"  # printed "0.86x faster"
    assert format_speedup(1.0, 0.0) == "n/a"


def test_verify_table_prints_slower_below_one():
    """The engine quick start's `engine.verify([prompt]).table()` printed "0.86x faster" for a reuse slower than
    full prefill; the docs' convention is full/reuse "N.NNx faster", or "N.NNx slower" below 1."""
    from kvboost_core.tuning.fidelity import FidelityReport, PromptFidelity, speedup_text
    from kvboost_rag.app.cli_util import fidelity_table
    from kvboost_rag.app.fmt import speedup

    def row(repair, ttft_ratio):  # ttft_ratio: reuse TTFT / full TTFT
        return PromptFidelity(0, repair, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, ttft_ratio)

    report = FidelityReport([row("none", 1 / 0.86), row("full", 0.25)])
    for table in (report.table(), fidelity_table(report.summary())):  # the engine's and the CLI's
        assert "1.16x slower" in table and "4.00x faster" in table and "0.86x" not in table, table
    for ratio in (0.25, 0.5, 0.996, 1.0, 1.004, 1.0866, 1.27, 4.0):  # the same wording as every other figure
        assert speedup_text(ratio) == speedup(1.0, ratio), ratio
    assert speedup_text(0.0) == speedup_text(float("nan")) == "n/a"


def test_serve_applies_threads(monkeypatch):
    """`kvboost-rag serve --threads N` sets torch's thread count before the server starts (it was ignored:
    _run returned run_serve before set_threads)."""
    import torch

    from kvboost_rag.app.server import main as server_main

    seen = {}

    def fake_run(args, sock=None):
        seen["threads"] = torch.get_num_threads()
        if sock is not None:  # the port, bound by serve's checks before torch loads
            sock.close()
        return 0

    monkeypatch.setattr(server_main, "run", fake_run)
    want = 3 if torch.get_num_threads() != 3 else 2
    with socket.socket() as s:  # a free port: the checks bind it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["serve", "--model", "demo", "--threads", str(want), "--port", str(port)]) == 0
    assert seen["threads"] == want


def test_calibrate_write_refuses_a_setting_that_missed_the_target(tiny_dir, tmp_path, monkeypatch, capsys):
    """A calibration whose every setting missed the target writes nothing and exits 1 (it used to write the
    lowest-KL setting over the model's kvboost.json while printing "no setting met the target")."""
    import shutil

    from kvboost_core.tuning import calibrate as cal_mod
    from kvboost_core.tuning.calibrate import DEFAULTS_FILE, Calibration, Trial

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    shipped = model_dir / DEFAULTS_FILE
    shipped.write_text(json.dumps({"engine": {"recompute_ratio": 0.7}}))
    missed = Calibration(0.5, 1, False, 0.05, 0.95, (Trial(1, 0.5, 0.5, 0.3, 0.5, 0.5),))
    monkeypatch.setattr(cal_mod, "calibrate", lambda *a, **kw: missed)
    rc = cli.main(["calibrate", "--model", str(model_dir), "--prompts", "2", "--write", "--threads", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "no setting met the target" in captured.out and "nothing was written" in captured.err
    assert json.loads(shipped.read_text()) == {"engine": {"recompute_ratio": 0.7}}  # untouched


def test_calibrate_write_keeps_other_settings_of_the_file(tiny_dir, tmp_path, capsys):
    import shutil

    from kvboost_core.tuning.calibrate import DEFAULTS_FILE, load_defaults

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    (model_dir / DEFAULTS_FILE).write_text(json.dumps({"engine": {"chunk_size": 64, "recompute_ratio": 0.9}}))
    assert cli.main(["calibrate", "--model", str(model_dir), "--prompts", "2", "--max-kl", "1e9", "--min-top1", "0",
                     "--write", "--threads", "1"]) == 0
    assert load_defaults(model_dir) == {"chunk_size": 64, "recompute_ratio": 0.15, "check_layer": 1}


def test_calibrate_write_refuses_a_zoo_name(capsys):
    assert cli.main(["calibrate", "--model", "smollm2-135m-instruct", "--write", "--threads", "1"]) == 2
    assert "shipped" in capsys.readouterr().err


def test_model_defaults_are_the_real_model_everywhere():
    """demo defaulted to SmolLM2 while warm, fidelity, calibrate and serve defaulted to the 2M demo model."""
    base = {"demo": [], "warm": ["--docs", "x", "--store", "memory"], "fidelity": [], "calibrate": [],
            "serve": []}
    parser = cli.build_parser()
    for command, extra in base.items():
        assert parser.parse_args([command, *extra]).model == cli.REAL_MODEL, command


@pytest.mark.parametrize("offline", [True, False])
def test_unknown_model_name_is_one_line_at_once(tmp_path, monkeypatch, capsys, offline):
    """`warm --model no-such-model` retried the hub for 62 s when offline; now one line before any loading."""
    import time

    from kvboost_rag.app import loading

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Alice lives in Portvale."}) + "\n")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=2.0: False)
    t0 = time.perf_counter()
    rc = cli.main(["warm", "--model", "no-such-model", "--docs", str(docs), "--store", "memory", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no-such-model" in err and "known short name" in err, err
    assert ("HF_HUB_OFFLINE" in err) is offline
    assert time.perf_counter() - t0 < 30  # no hub retries (generous: the machine may be loaded)


def test_fidelity_greedy_match_stops_at_eos():
    """A continuation that ended at EOS where the reference did was counted as a mismatch (the reference ran on
    past EOS)."""
    from kvboost_core.tuning.fidelity import greedy_match

    assert greedy_match([5, 2], [5, 2, 7, 7], {2}) == 1.0
    assert greedy_match([5, 3, 4, 4], [5, 2, 7, 7], {2}) == 0.5  # diverged at the reference's EOS
    assert greedy_match([5, 6, 2], [5, 6, 7, 8], {2}) == 0.5
    assert greedy_match([1, 2, 3], [1, 2, 3], set()) == 1.0

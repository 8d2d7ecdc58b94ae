"""Smoke tests of the ``kvboost-rag`` CLI: demo, warm, fidelity (and bench's forwarding, when present)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import SHARED_STORIES

from kvboost_rag import cli
from kvboost_rag import demo_data as dd


@pytest.fixture(autouse=True)
def _restore_threads():
    """cli.main sets torch's thread count (--threads); keep that from leaking into other test modules."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random model of kvboost_rag.tiny saved as a HF directory: a stand-in for "any other model"."""
    from kvboost_rag.tiny import tiny_model_and_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_demo_runs_end_to_end(capsys):
    pytest.importorskip("langchain_classic")
    pytest.importorskip("faiss")
    assert cli.main(["demo", "--questions", "2", "--top-k", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("Q: ") == 2
    assert "TTFT reuse" in out and "full prefill" in out and "reuse ratio" in out
    assert "median TTFT" in out and "same answer as full prefill on" in out
    if dd.demo_model_available():
        assert "accuracy: with reuse" in out
    else:
        assert "tiny random model" in out


def test_demo_on_another_model_without_answers(tiny_dir, capsys):
    pytest.importorskip("langchain_classic")
    assert cli.main(["demo", "--model", str(tiny_dir), "--questions", "1", "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "A (reuse)" in out and "n/a" in out  # a generic model gets generic questions with no key


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
    assert cli.main(args) == 0  # a second process finds the documents in the disk store
    assert "warmed 0, already warm 3" in capsys.readouterr().out


def test_warm_reads_jsonl_and_rejects_bad_input(tiny_dir, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["one document here", "another one"]) + "\n")
    assert cli.main(["warm", "--model", str(tiny_dir), "--docs", str(src), "--store", "memory",
                     "--no-progress", "--threads", "1"]) == 0
    assert "documents 2: warmed 2" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(SystemExit, match="no string 'text' field"):
        cli.main(["warm", "--model", str(tiny_dir), "--docs", str(bad), "--store", "memory"])


def test_fidelity_json_parses(tiny_dir, capsys):
    assert cli.main(["fidelity", "--model", str(tiny_dir), "--prompts", "3", "--max-new-tokens", "4",
                     "--json", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["summary"]) == {"none", "selective", "cacheblend"}
    assert report["summary"]["cacheblend"]["prompts"] == 3
    assert report["summary"]["none"]["reuse_ratio"] > 0.3  # the reordered documents were re-placed


@pytest.mark.skipif(not dd.demo_model_available(), reason="the embedded demo model is not built")
def test_fidelity_table_on_demo_model(capsys):
    assert cli.main(["fidelity", "--prompts", "3", "--max-new-tokens", "4", "--repairs", "none,cacheblend"]) == 0
    out = capsys.readouterr().out
    assert "cacheblend" in out and "mean KL" in out


def test_fidelity_passes_cacheblend_knobs(tiny_dir, capsys):
    """--recompute-ratio 1.0 recomputes every re-placed token: cacheblend then equals full prefill."""
    assert cli.main(["fidelity", "--model", str(tiny_dir), "--prompts", "2", "--max-new-tokens", "2", "--repairs",
                     "cacheblend", "--recompute-ratio", "1.0", "--check-layer", "0", "--json", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]["cacheblend"]
    assert summary["mean_kl"] < 1e-6 and summary["top1_agree"] == 1.0


def test_bench_forwards_arguments():
    if importlib.util.find_spec("kvboost_rag.bench") is None:
        pytest.skip("kvboost_rag.bench is not written yet")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0


def test_missing_subcommand_is_an_error():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_bench_runs_on_tiny_settings(tmp_path):
    import json

    from kvboost_rag.bench import main as bench_main

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
    from kvboost_rag.bench_quality import demo_accuracy

    with pytest.raises(ValueError, match="n_questions"):
        demo_accuracy(0)


def test_calibrate_writes_defaults_beside_the_weights(tiny_dir, tmp_path, capsys):
    import shutil

    from kvboost_core.calibrate import DEFAULTS_FILE, load_defaults

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    assert cli.main(["calibrate", "--model", str(model_dir), "--prompts", "2", "--max-kl", "1e9", "--min-top1", "0",
                     "--write", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "meets the target" in out and DEFAULTS_FILE in out
    assert load_defaults(model_dir) == {"recompute_ratio": 0.15, "check_layer": 1}

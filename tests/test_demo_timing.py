"""The chat demo's timing (kvboost_rag.app.demo_timing): repeated TTFT runs, the load, noise, warming progress."""

from __future__ import annotations

import io
import re

import pytest

from kvboost_rag.app import demo_timing as dt
from kvboost_rag.warming import WarmReport


class FakeChat:
    """Records invoke calls; each returns the next (ttft, prompt ids, reuse ratio)."""

    def __init__(self, runs):
        self.runs, self.calls = list(runs), []
        self.last_stats: dict = {}
        self.rag = self

    def invoke(self, messages, **kw):
        self.calls.append(kw)
        ttft, ids, ratio = self.runs.pop(0)
        self.last_stats = {"ttft_s": ttft, "reuse_ratio": ratio}
        self.last_result = type("R", (), {"prompt_token_ids": ids})()

    def warm_documents(self, docs, show_progress=None):
        self.calls.append({"docs": list(docs), "show_progress": show_progress})
        return WarmReport(documents=len(docs), warmed=len(docs), already_warm=0, tokens=10 * len(docs),
                          bytes=100 * len(docs), seconds=0.01)


def test_both_sides_are_repeated_alike_and_only_when_a_full_prefill_is_cheap():
    assert dt.extra_runs(0.5, n=3, cheap_s=1.0) == 2
    assert dt.extra_runs(6.0, n=3, cheap_s=1.0) == 0  # a slow full prefill: each call runs once
    order: list[str] = []
    probes, fulls = dt.alternate(2, lambda: order.append("reuse") or dt.Probe(0.1, ()),
                                 lambda: order.append("full") or 0.4)
    assert order == ["reuse", "full", "reuse", "full"] and len(probes) == 2 and fulls == [0.4, 0.4]


def test_reuse_probes_store_nothing():
    chat = FakeChat([(0.2, [1, 2], 0.5)])
    probe = dt.reuse_probe(chat, ["m"])
    assert probe.ttft_s == 0.2 and probe.key == ((1, 2), 0.5, 0, 0, 0)
    assert chat.calls == [{"max_tokens": 1, "store_prefix": False}]  # one token, no prefix, no backfill


def test_only_probes_that_did_the_answers_work_count_and_both_sides_keep_as_many_runs():
    chat = FakeChat([(0.2, [1, 2], 0.5), (0.1, [1, 2, 3], 0.5), (0.9, [1, 2], 0.5)])
    probes = [dt.reuse_probe(chat, ["m"]) for _ in range(2)]
    chat.invoke(["m"])  # the answer's own call: ids [1, 2], ratio 0.5
    reuse, full = dt.paired(0.9, dt.probe_key(chat), probes, [2.0, 1.5, 1.4])
    assert reuse == [0.9, 0.2]  # the probe with other ids is left out...
    assert full == [2.0, 1.5]  # ...and the full side is cut to as many runs, the reference's own first
    assert dt.paired(0.9, dt.probe_key(chat), [], [2.0]) == ([0.9], [2.0])


def _m(load_now, load_start=0.5, cores=2):
    return dt.Machine(cores=cores, threads=2, load_start=load_start, load_now=load_now)


def test_noise_lines_print_the_load_and_say_when_timings_are_noisy():
    steady = dt.noise_lines(_m(1.5), [([0.10, 0.11], [1.0, 1.05])])
    text = "\n".join(steady)
    assert "load average 1.50 now, 0.50 when the demo started, on 2 cores" in text
    assert "steady" in text and "NOISY" not in text
    loaded = "\n".join(dt.noise_lines(_m(3.2), [([0.10, 0.11], [1.0, 1.05])]))
    assert "NOISY" in loaded and "above the core count" in loaded
    swinging = "\n".join(dt.noise_lines(_m(1.0), [([0.10, 0.32], [1.0])]))
    assert "NOISY" in swinging and "3.20x" in swinging
    single = "\n".join(dt.noise_lines(_m(None, None), [([2.0], [7.0])]))
    assert "load average n/a" in single and "ran once" in single


def test_warming_prints_plain_lines_in_a_logged_run(monkeypatch):
    monkeypatch.setattr(dt.sys, "stderr", io.StringIO())  # not a TTY: no bar would show
    chat, lines = FakeChat([]), []
    texts = [f"doc {i}" for i in range(19)]
    report = dt.warm(chat, texts, None, log=lines.append)
    assert [re.match(r"  warming: (\d+)/19 documents", x).group(1) for x in lines] == ["8", "16", "19"]
    assert "left" in lines[0] and "left" not in lines[-1]
    assert (report.documents, report.warmed, report.tokens, report.bytes) == (19, 19, 190, 1900)
    assert [c["docs"] for c in chat.calls] == [texts[:8], texts[8:16], texts[16:]]  # the default batches
    quiet, lines = FakeChat([]), []
    dt.warm(quiet, texts, False, log=lines.append)
    assert lines == [] and quiet.calls == [{"docs": texts, "show_progress": False}]


def test_payoff_says_after_how_many_questions_warming_pays_off():
    assert dt.payoff_lines(10.0, 30, {"a": 2.0, "b": 3.0})[0].endswith(
        "it pays off after about 4 questions that retrieve these documents.")
    assert "did not pay off" in dt.payoff_lines(10.0, 30, {"a": -0.5})[0]
    assert dt.payoff_lines(0.0, 0, {}) == []
    assert "once at ingestion" in dt.WARM_PAYS and "reused across questions" in dt.WARM_PAYS



def test_chat_demo_repeats_timings_prints_load_and_warming_progress(tiny_dir, capsys):
    """The chat demo end to end on the tiny model, its output captured (not a TTY, as in a logged run)."""
    pytest.importorskip("langchain_classic")
    import torch

    from kvboost_rag.app import cli

    threads = torch.get_num_threads()
    try:
        assert cli.main(["demo", "--model", str(tiny_dir), "--questions", "1", "--top-k", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"^  warming: \d+/\d+ documents", out, re.M)  # progress in a logged run
    assert "Machine load: 1-min load average" in out and "fastest of up to 3 runs" in out
    assert ("NOISY" in out) != ("steady" in out) or "ran once" in out
    # The tiny model's calls are cheap, so they are repeated, and the repeats did the answers' own work (same
    # prompt ids and reuse): at least one row reports three runs each way.
    assert re.search(r"fastest of 3 each", out)
    assert "pays off" in out and "once at ingestion" in out

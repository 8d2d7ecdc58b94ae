"""Render every figure table in README.md and docs/ from benchmarks/results/*.json (figures are never typed).

    python scripts/render_figures.py           # rewrite the marked blocks, copy the plots into docs/figures/
    python scripts/render_figures.py --check   # exit 1 (and name the blocks) when a committed block is stale

A page marks a generated block with two HTML comments; everything between them is replaced:

    <!-- figures:rag_eval -->
    ...
    <!-- /figures -->

Each block name is one :class:`Table` in ``TABLES``: the results files it reads and a function from their
parsed JSON to Markdown. To add a figure, add a results file, one ``Table`` (a few lines) and the marker on a
page. A table whose results file is absent renders as an empty block, so a checkout without it still checks
clean; a marker naming no table is an error. Uncertainty: accuracy and same-answer rates carry 95% bootstrap
intervals over questions, differences against full prefill and speedups paired bootstrap intervals (the same
resampled questions on both sides), from a fixed seed, so a rerun renders the same text.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")
PAGES = ("README.md", "docs")  # README.md and every docs/**/*.md
PLOTS_DIR = Path("docs/figures")  # mkdocs serves only docs/: the plots are copied here
BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
BOOT = 2000  # bootstrap resamples (numpy, vectorised: the whole render takes about a second)
SEED = 0
SMOLLM2 = "SmolLM2-135M-Instruct"
CPU = "2-core x86 CPU, fp32, 1 thread, other jobs running"

sys.path.insert(0, str(ROOT / "benchmarks"))  # readme_table.py: the TTFT and demo-model tables
sys.path.insert(0, str(ROOT))


def _fmt_speedup(ratio: float) -> str:
    from kvboost_rag.app.fmt import ratio_speedup

    return ratio_speedup(ratio)


# ------------------------------------------------------------------------------------------- statistics
@functools.lru_cache(maxsize=8)
def _draws(n: int, seed: int = SEED) -> Any:
    """(BOOT, n) resampled indices. numpy's legacy RandomState: its stream is fixed across numpy versions."""
    import numpy as np

    return np.random.RandomState(seed).randint(0, n, size=(BOOT, n))


def _interval(values: Any) -> tuple[float, float]:
    import numpy as np

    v = np.sort(np.asarray(values, dtype=float))
    return float(v[int(0.025 * (len(v) - 1))]), float(v[int(0.975 * (len(v) - 1))])


def rate_ci(flags: Sequence[bool]) -> tuple[float, float, float]:
    """(rate, low, high): a share with its 95% bootstrap interval over the items."""
    import numpy as np

    x = np.asarray(flags, dtype=float)
    lo, hi = _interval(x[_draws(len(x))].mean(axis=1))
    return float(x.mean()), lo, hi


def paired_diff_ci(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high) with the same questions resampled on both sides."""
    import numpy as np

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    lo, hi = _interval(d[_draws(len(d))].mean(axis=1))
    return float(d.mean()), lo, hi


def paired_speedup_ci(full: Sequence[float], reuse: Sequence[float]) -> tuple[float, float, float]:
    """(median(full) / median(reuse), low, high), questions resampled in pairs."""
    import numpy as np

    f, r = np.asarray(full, dtype=float), np.asarray(reuse, dtype=float)
    idx = _draws(len(f))
    lo, hi = _interval(np.median(f[idx], axis=1) / np.median(r[idx], axis=1))
    return float(np.median(f) / np.median(r)), lo, hi


def pct_ci(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.0%} [{t[1]:.0%}, {t[2]:.0%}]"


def pts_ci(t: tuple[float, float, float]) -> str:
    return f"{t[0] * 100:+.0f} pts [{t[1] * 100:+.0f}, {t[2] * 100:+.0f}]"


def x_ci(t: tuple[float, float, float]) -> str:
    """A speedup with its interval in the same direction as its words ("1.02x slower [1.00, 1.04]")."""
    text = _fmt_speedup(t[0])
    lo, hi = (t[1], t[2]) if text.endswith("faster") else (1 / t[2], 1 / t[1])
    return f"{text} [{lo:.2f}, {hi:.2f}]"


def md(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- RAG tables
LABELS = {
    "full": "plain HF full prefill",
    "engine-full": "engine `repair=\"full\"`",
    "none": "`none` (re-rotated, no repair)",
    "cacheblend-0.15": "CacheBlend r=0.15 (engine-wide default)",
    "cacheblend-0.3": "CacheBlend r=0.3",
    "cacheblend-0.5": "CacheBlend r=0.5",
    "cacheblend-0.7": "**CacheBlend r=0.7 (SmolLM2's default when measured)**",
    "default": "the model's default",
    "c3r30": "check layer 3, r=0.3",
    "c3r50": "check layer 3, r=0.5",
    "q30": "query-aware (`query_tokens=8`), r=0.3",
    "m50": "adaptive `recompute_mass=0.5` (floor 0.1)",
    "m80": "adaptive `recompute_mass=0.8` (floor 0.15)",
    "p70-30@8": "second check layer: 70%, then 30% from layer 8",
    "p50-15@8": "second check layer: 50%, then 15% from layer 8",
    "c3p70-30@10": "check layer 3: 70%, then 30% from layer 10",
}


def _rows_by_question(result: dict[str, Any], setting: str) -> dict[str, dict[str, Any]]:
    return {r["question"]: r for r in result["rows"][setting]}


def _paired(result: dict[str, Any], setting: str, ref: str = "full") -> tuple[list[dict], list[dict]]:
    """The rows of ``setting`` and ``ref`` for the questions both answered, in the reference's order."""
    a, b = _rows_by_question(result, setting), _rows_by_question(result, ref)
    qs = [q for q in b if q in a]
    return [a[q] for q in qs], [b[q] for q in qs]


def rag_eval_table(result: dict[str, Any]) -> str:
    """Every setting of a ``kvboost-rag bench rag`` run, with bootstrap intervals where rows exist."""
    head = ["setting", "accuracy [95% CI]", "vs full prefill (paired)", "same answer [95% CI]", "first-token KL",
            "recomputed", "TTFT [95% CI]"]
    rows = []
    for name, s in result["summary"].items():
        mine, full = _paired(result, name)
        acc = rate_ci([r["correct"] for r in mine])
        same = rate_ci([r["same_answer"] for r in mine])
        if name == "full":
            rows.append([LABELS.get(name, name), pct_ci(acc), "", "100%", "0", "100%", "1.00x (reference)"])
            continue
        diff = paired_diff_ci([r["correct"] for r in mine], [r["correct"] for r in full])
        speed = paired_speedup_ci([r["ttft_s"] for r in full], [r["ttft_s"] for r in mine])
        rows.append([LABELS.get(name, f"`{name}`"), pct_ci(acc), pts_ci(diff), pct_ci(same), f"{s['kl_mean']:.4f}",
                     f"{s['recompute']:.0%}", x_ci(speed)])
    return (f"{SMOLLM2}, {result['questions']} held-out questions ({result['split']} split), k={result['k']} "
            f"retrieved documents (median {result['prompt_tokens_median']:,.0f} prompt tokens), "
            f"{result['max_new_tokens']} new tokens, greedy; {CPU}.\n\n" + md(head, rows))


def block_table(result: dict[str, Any], long: dict[str, Any]) -> str:
    """The block adapter against the base model's full prefill and CacheBlend on the heldout split (issue #24)."""
    head = ["setting", "accuracy [95% CI]", "vs full prefill (paired) [95% CI]", "McNemar p",
            "full's right answers kept", "same answer as full [95% CI]", "TTFT at 1.7K tokens", "TTFT at 4K tokens"]
    at4k = {"cacheblend-0.7": "cacheblend-0.7", "cacheblend-0.15": "cacheblend-0.15", "block": "block"}
    rows = []
    for name, s in result["summary"].items():
        mine, full = _paired(result, name)
        acc = rate_ci([r["correct"] for r in mine])
        if name == "full":
            rows.append(["plain HF full prefill (base model)", pct_ci(acc), "", "", "", "100%", "1.00x (reference)",
                         "1.00x (reference)"])
            continue
        pa = s["extra"]["paired"]
        diff = paired_diff_ci([r["correct"] for r in mine], [r["correct"] for r in full])
        same = rate_ci([r["same_answer"] for r in mine])
        speed = paired_speedup_ci([r["ttft_s"] for r in full], [r["ttft_s"] for r in mine])
        x4k = long["speedup"].get(at4k.get(name, ""))
        label = "**block adapter** (the first shipped, recipe a, `repair=\"none\"`)" if name == "block" else LABELS.get(name, name)
        rows.append([label, pct_ci(acc), pts_ci(diff), f"{pa['mcnemar_p']:.3f}",
                     f"{pa['kept_right']:.0%} ({pa['lost']} lost, {pa['gained']} gained)", pct_ci(same), x_ci(speed),
                     _fmt_speedup(x4k) if x4k else "not measured"])
    exact = result["summary"]["block"]["extra"]["exact_vs_hf_block"]
    n_exact = round(exact["rate"] * exact["n"])
    return (f"{SMOLLM2}, the first {result['questions']} questions of the heldout split (written for this "
            f"evaluation, never trained or tuned on; k={result['k']}, median {result['prompt_tokens_median']:,.0f} "
            f"prompt tokens, {result['max_new_tokens']} new tokens, greedy), {CPU}; 1.7K-token TTFT ratios side by "
            f"side per question, 4K-token ratios from {long['prompts']} chats x {long['rounds']} rounds at 2 "
            f"threads. The block adapter's answers were identical to an independent HF construction of its own "
            f"block prefill on {n_exact} of {exact['n']} questions.\n\n" + md(head, rows))


def block_final_table(test: dict[str, Any], heldout: dict[str, Any], long: dict[str, Any],
                      dev: dict[str, Any], goals_list: bool = True) -> str:
    """Issue #32's final measurement: the chosen block adapter on the test split (read once) and on heldout,
    each against the base model's full prefill and against the adapted model's own full prefill of the same
    ids, with the 4K-token TTFT and the no-document questions; every goal beside its figure (``goals_list``
    False: the table alone, the README's copy)."""

    def right(rows: list[dict[str, Any]]) -> str:
        n = sum(x["correct"] for x in rows)
        return f"{n / len(rows):.1%} ({n}/{len(rows)})"

    def pts(t: tuple[float, float, float]) -> str:
        return f"{t[0] * 100:+.1f} [{t[1] * 100:+.1f}, {t[2] * 100:+.1f}]"

    def ok(flag: bool) -> str:
        return "met" if flag else "**missed**"

    head = ["split", "base model, full prefill", "adapted model, full prefill", "adapted model, block reuse",
            "block vs base full, points [95% CI]", "block vs adapted full (block reading's own cost)",
            "identical to the independent construction", "TTFT, block vs base full (paired)"]
    rows, goals = [], []
    for name, r in (("test", test), ("heldout", heldout)):
        block, base = _paired(r, "block")
        own, _ = _paired(r, "adapted-full")
        ex = r["summary"]["block"]["extra"]  # the benchmark's own paired bootstrap, as it printed it
        vs_base = (ex["paired"]["diff"], ex["paired"]["diff_lo"], ex["paired"]["diff_hi"])
        cost = (ex["block_cost"]["diff"], ex["block_cost"]["diff_lo"], ex["block_cost"]["diff_hi"])
        exact = sum(bool(x["exact"]) for x in block)
        speed = paired_speedup_ci([x["ttft_s"] for x in base], [x["ttft_s"] for x in block])
        label = f"{name} ({len(block)} questions, median {r['prompt_tokens_median']:,.0f} tokens)"
        rows.append([label, right(base), right(own), right(block), pts(vs_base), pts(cost),
                     f"{exact}/{len(block)}", x_ci(speed)])
        goals.append(f"- {name}: block vs base full prefill >= -1 point: {ok(vs_base[0] >= -0.01)}; its interval's "
                     f"lower bound >= -5: {ok(vs_base[1] >= -0.05)}; block reading's own cost >= -2 points: "
                     f"{ok(cost[0] >= -0.02)}; identical answers on 100%: {ok(exact == len(block))}")
    nodoc = dev["nodoc"]["paired"]
    x4k = long["speedup"]["block"]
    goals.append(f"- TTFT at {long['prompt_tokens_median']:,.0f} tokens ({long['prompts']} chats x {long['rounds']} "
                 f"rounds, 2 threads): {_fmt_speedup(x4k)} than HF full prefill; >= 20x: {ok(x4k >= 20)}")
    goals.append(f"- {nodoc['n']} questions without documents (`kvboost_rag/app/assets/nodoc`): adapted "
                 f"{nodoc['accuracy']:.0%} against the base model's {nodoc['reference_accuracy']:.0%}, "
                 f"{nodoc['diff'] * 100:+.1f} points [{nodoc['diff_lo'] * 100:+.1f}, {nodoc['diff_hi'] * 100:+.1f}];"
                 f" within 2 points: {ok(nodoc['diff'] >= -0.02)}")
    meta = test["engine"]["block_adapter"]
    return (f"{SMOLLM2}, block adapter `{Path(meta['path']).name}` (rank {meta['rank']}, chosen on the dev split "
            f"before the test split was read), k={test['k']}, {test['max_new_tokens']} new tokens, greedy, {CPU}. "
            f"Paired bootstrap 95% intervals over questions (the accuracy differences as the benchmark computed "
            f"them).\n\n" + md(head, rows)
            + ("\n\nThe issue's goals:\n\n" + "\n".join(goals) if goals_list else ""))


def rag_summary_table(*results: dict[str, Any]) -> str:
    """Summary rows of one or more bench-rag runs (the tune-split experiments), each run's own full prefill."""
    head = ["setting", "questions", "accuracy (full prefill)", "same answer", "first-token KL", "recomputed",
            "TTFT", "run"]
    rows = []
    for i, result in enumerate(results, 1):
        full = result["summary"]["full"]
        for name, s in result["summary"].items():
            if name == "full":
                continue
            rows.append([LABELS.get(name, f"`{name}`"), str(s["questions"]),
                         f"{s['accuracy']:.0%} ({full['accuracy']:.0%})", f"{s['same_answer']:.0%}",
                         f"{s['kl_mean']:.4f}", f"{s['recompute']:.0%}", _fmt_speedup(s["speedup"]), str(i)])
    runs = "; ".join(f"run {i}: k={r['k']}, median {r['prompt_tokens_median']:,.0f} tokens"
                     for i, r in enumerate(results, 1))
    return f"{SMOLLM2}, tune split ({runs}); {CPU}.\n\n" + md(head, rows)


def rag_long_table(result: dict[str, Any]) -> str:
    head = ["setting", "TTFT", "speedup"]
    rows = [[LABELS.get("full"), f"{result['ttft_s']['full']:.1f} s", "1.00x (reference)"]]
    rows += [[LABELS.get(n, f"`{n}`") if n != "default" else "SmolLM2's default when measured (CacheBlend r=0.7)",
              f"{result['ttft_s'][n]:.1f} s", _fmt_speedup(x)] for n, x in result["speedup"].items()]
    return (f"{SMOLLM2}, {result['prompts']} held-out chats of k={result['k']} documents (median "
            f"{result['prompt_tokens_median']:,} prompt tokens), median of {result['rounds']} rounds each, 2 threads; "
            f"too few prompts for an interval.\n\n" + md(head, rows))


def headline_table(result: dict[str, Any], long: dict[str, Any], ttft: dict[str, Any]) -> str:
    """The README's table: what reuse costs in answers and buys in time, on the real model."""
    head = ["setting", "accuracy [95% CI]", "vs full prefill", "same answer as full", "TTFT at 1.7K tokens",
            "TTFT at 4K tokens"]
    pick = {"full": "full", "cacheblend-0.7": "default", "cacheblend-0.15": "cacheblend-0.15", "none": "none"}
    rows = []
    for name, long_name in pick.items():
        if name not in result["summary"]:
            continue
        mine, full = _paired(result, name)
        acc = rate_ci([r["correct"] for r in mine])
        if name == "full":
            rows.append(["plain HF full prefill", pct_ci(acc), "", "100%", "1.00x (reference)", "1.00x (reference)"])
            continue
        diff = paired_diff_ci([r["correct"] for r in mine], [r["correct"] for r in full])
        same = rate_ci([r["same_answer"] for r in mine])
        speed = paired_speedup_ci([r["ttft_s"] for r in full], [r["ttft_s"] for r in mine])
        at4k = long["speedup"].get(long_name)
        rows.append([LABELS[name], pct_ci(acc), pts_ci(diff), pct_ci(same), x_ci(speed),
                     _fmt_speedup(at4k) if at4k else "not measured"])
    turns = ttft["workload_b"]["turns"]
    last = turns[-1]
    exact = (f"Exact reuse (no approximation, answers unchanged): a follow-up chat turn reusing the earlier "
             f"conversation as a prefix, turn {len(turns)} of {last['prompt_tokens']:,} tokens, "
             f"{_fmt_speedup(last['full_ttft_s'] / last['ours_ttft_s'])} than recomputing it "
             f"({last['ours_ttft_s']:.2f} s vs {last['full_ttft_s']:.2f} s; {ttft['model']}, 2 threads).")
    return (f"{SMOLLM2} answering {result['questions']} held-out RAG questions (k={result['k']}, median "
            f"{result['prompt_tokens_median']:,.0f} prompt tokens) on a {CPU}. TTFT ratios are full prefill / reuse, "
            f"side by side in one process; at 4K tokens {long['prompts']} chats x {long['rounds']} rounds, 2 threads. "
            "[95% CI] = bootstrap over questions (paired for differences and speedups).\n\n"
            + md(head, rows) + "\n\n" + exact)


def when_to_use(result: dict[str, Any], long: dict[str, Any], ttft: dict[str, Any],
                multiturn: dict[str, Any] | None = None) -> str:
    """The README's "when to use it" bullets, their numbers taken from the same files as the headline table."""
    def row(name: str) -> tuple[Any, ...]:
        mine, full = _paired(result, name)
        return (paired_diff_ci([r["correct"] for r in mine], [r["correct"] for r in full]),
                sum(r["same_answer"] for r in mine) / len(mine),
                paired_speedup_ci([r["ttft_s"] for r in full], [r["ttft_s"] for r in mine]))

    last = ttft["workload_b"]["turns"][-1]
    sizes = ttft["workload_a"]["sizes"]
    big = sizes[max(sizes, key=int)]
    cb = big["methods"]["cacheblend"]
    lines = [
        f"- **Use it for exact reuse**: multi-turn chat, a long shared system prompt, a document at the position "
        f"it was warmed at. Answers are those of a full prefill; turn {len(ttft['workload_b']['turns'])} of a chat "
        f"({last['prompt_tokens']:,} tokens) starts {_fmt_speedup(last['full_ttft_s'] / last['ours_ttft_s'])} "
        f"than recomputing it ({ttft['model']} on CPU; prefix caching in other servers does this too).",
    ]
    variants = (multiturn or {}).get("variants", {})
    name = "defaults" if variants.get("defaults", {}).get("backfill") == "auto" else "backfill"
    if multiturn is not None and name in multiturn["per_turn"][0]["kvboost"]:
        pt = multiturn["per_turn"]
        follow = [p for p in pt if p["turn"] >= 3 and p["turn"] not in multiturn["retrieve_turns"]]
        new = [p for p in pt if p["turn"] in multiturn["retrieve_turns"] and p["turn"] > 1]
        bf = [p["kvboost"][name] for p in follow]
        ex = sum(b["exact_only_turns"] for b in bf)
        how = ("exact history by default.** Chat calls (`ChatKVBoost`, the server's chat completions) read their "
               "history exactly and backfill every answered turn, from the first, between turns (one-shot "
               "completions only when a prompt continues an earlier one, `backfill=\"auto\"`)" if name == "defaults"
               else "turn on `backfill=True`.** Each answered turn is recomputed exactly between turns")
        lines.append(
            f"- **Multi-turn RAG chat: {how}, so follow-ups reuse their whole history exactly: on {SMOLLM2}, "
            f"follow-up turns from turn 3 on start from {_fmt_speedup(min(b['speedup'] for b in bf))} to "
            f"{_fmt_speedup(max(b['speedup'] for b in bf))} than full prefill with "
            f"{sum(b['exact_only_same_answer'] for b in bf)} of {ex} exact-reuse answers equal to it; turns that "
            "retrieve new documents "
            + ", ".join(_fmt_speedup(p['kvboost'][name]['speedup']) for p in new)
            + " ([multi-turn figures](docs/figures.md#multi-turn)).")
    if "cacheblend-0.15" in result["summary"]:
        diff, same, speed = row("cacheblend-0.15")
        lines.append(
            f"- **Use re-placed documents when changed answers are acceptable, or measure your model first.** On "
            f"long retrieved contexts CacheBlend at r=0.15 starts {_fmt_speedup(cb['speedup_vs_full'])} at "
            f"{big['context_tokens']:,} tokens ({ttft['model']}), and on {SMOLLM2} {_fmt_speedup(speed[0])} at "
            f"1.7K tokens, but there it costs {abs(diff[0]) * 100:.0f} points of accuracy "
            f"({pts_ci(diff)}) and keeps only {same:.0%} of first sentences.")
    if "cacheblend-0.7" in result["summary"]:
        diff, same, speed = row("cacheblend-0.7")
        at4k = long["speedup"].get("default")
        lines.append(
            f"- **Do not expect speed and unchanged answers together on a small model.** SmolLM2's default "
            f"(r=0.7 when measured) keeps accuracy ({pts_ci(diff)}) but only {same:.0%} of first sentences, at "
            f"{_fmt_speedup(speed[0])} (1.7K tokens)" + (f" and {_fmt_speedup(at4k)} (4K tokens)." if at4k else "."))
    lines.append("- **Not measured**: trained models larger than 135M parameters, and speed on a GPU (the CUDA "
                 "kernels and the engine on CUDA pass their parity tests on an H200; see [Limits](docs/limits.md)).")
    return "\n".join(lines)


def reader_table(with_reader: dict[str, Any], without: dict[str, Any]) -> str:
    """A reader adapter's held-out rows against the same questions without it."""
    head = ["setting", "accuracy without -> with", "same answer without -> with", "first-token KL without -> with"]
    rows = []
    for name in with_reader["summary"]:
        if name == "full":
            continue
        base = "cacheblend-0.7" if name == "default" else name
        if base not in without["rows"]:
            continue
        w = _rows_by_question(with_reader, name)
        b = {q: r for q, r in _rows_by_question(without, base).items() if q in w}
        ws = [w[q] for q in b]
        bs = list(b.values())

        def rate(rs: list[dict], key: str) -> str:
            return f"{sum(r[key] for r in rs) / len(rs):.1%}"

        def kl(rs: list[dict]) -> str:
            return f"{statistics.fmean(r['kl'] for r in rs):.3f}"

        rows.append([LABELS.get(base, base), f"{rate(bs, 'correct')} -> {rate(ws, 'correct')}",
                     f"{rate(bs, 'same_answer')} -> {rate(ws, 'same_answer')}", f"{kl(bs)} -> {kl(ws)}"])
    full = with_reader["summary"]["full"]
    return (f"{SMOLLM2}, the first {with_reader['questions']} held-out questions, k={with_reader['k']}; full prefill "
            f"{full['accuracy']:.1%} accurate. With {with_reader['questions']} questions a rate moves about +-7 "
            "points by chance.\n\n" + md(head, rows))


# ------------------------------------------------------------------------------------------- other tables
def serve_table(result: dict[str, Any], nodet: dict[str, Any] | None = None) -> str:
    head = ["concurrency", "output tok/s", "decode tok/s", "TTFT p50 / p99", "end-to-end p50 / p99", "errors"]
    rows = [[str(lv["concurrency"]), f"{lv['output_tok_s']:.1f}", f"{lv['decode_tok_s']:.1f}",
             f"{lv['ttft_p50']:.2f} / {lv['ttft_p99']:.1f} s", f"{lv['e2e_p50']:.1f} / {lv['e2e_p99']:.1f} s",
             str(lv["errors"])] for lv in result["batched"]["levels"]]
    s, hf = result["summary"], result["hf_sequential"]
    text = (f"{SMOLLM2}, RAG chats of about {result['batched']['levels'][0]['prompt_tokens_mean']:,.0f} tokens, "
            f"{result['max_tokens']} output tokens, the `openai` async client against the running server, "
            f"{'deterministic' if result['deterministic'] else 'non-deterministic'} decode, {result['cpus']} CPUs.\n\n"
            + md(head, rows)
            + f"\n\nPlain HF greedy run sequentially: {hf['output_tok_s']:.1f} output tok/s, TTFT p50 "
              f"{hf['ttft_p50']:.1f} s. Decode throughput at the highest concurrency is "
              f"{s['decode_speedup_top_vs_single']:.2f}x a single stream's; TTFT p50 at concurrency 4 is "
              f"{s['ttft_p50_c4_over_c1']:.2f}x the single request's; {s['outputs_identical_to_sequential']} outputs "
              f"equal to sequential greedy; {s['errors']} errors in {s['requests']} requests.")
    if nodet:
        lv = {x["concurrency"]: x for x in nodet["batched"]["levels"]}
        lo, hi = min(lv), max(lv)
        text += (f" Without determinism (`--no-deterministic`, its own run) a single stream decodes "
                 f"{lv[lo]['decode_tok_s']:.1f} tok/s and concurrency {hi} {lv[hi]['decode_tok_s']:.1f} tok/s.")
    return text


def quant_real_table(result: dict[str, Any]) -> str:
    ex, rag = result["exact_prefix"], result["rag"]
    head = ["KV storage", "bytes vs bf16", "exact-prefix top-1", "mean KL", "RAG accuracy", "same answer as full"]
    rows = [["model dtype", "-", f"{ex['unquantized']['top1']:.1%}", "0",
             f"{rag['unquantized']['accuracy']:.0%} (full prefill {rag['full']['accuracy']:.0%})",
             f"{rag['unquantized']['same_answer']:.0%}"]]
    for name in ("int8 group 32", "int8 group 128", "int4 group 32", "int4 group 128"):
        e, bits = ex[name], name.split()[0]
        r = rag.get(bits) if name.endswith(" 32") else None
        rows.append([name, f"{result['bytes_vs_bf16'][name]:.4g}x", f"{e['top1']:.1%}", f"{e['mean_kl']:.2g}",
                     f"{r['accuracy']:.0%}" if r else "not run", f"{r['same_answer']:.0%}" if r else ""])
    return (f"{SMOLLM2} (head_dim {result['head_dim']}): {ex['prompts']} exact-prefix prompts ({ex['near_ties']} "
            f"near-ties, top-2 margin < {ex['near_tie_margin']}); {rag['questions']} held-out RAG questions at the "
            "shipped default.\n\n" + md(head, rows))


def quant_fidelity_table(result: dict[str, Any]) -> str:
    rows = [[name, f"{r['top1']:.1%}", f"{r['mean_kl']:.3g}", str(r["flips"])] for name, r in result["results"].items()]
    return (f"{result['model']} (head_dim {result['head_dim']}), {result['prompts']} exact-prefix prompts "
            f"({next(iter(result['results'].values()))['near_ties']} near-ties). Needs `../shared/models/stories260K`, "
            "which a clone lacks.\n\n" + md(["configuration", "top-1", "mean KL", "flips"], rows))


def kernels_table(result: dict[str, Any]) -> str:
    head = ["source", "into fp32", "% of bandwidth limit", "into bf16", "% of limit"]
    f32, b16 = result["dst"]["float32"], result["dst"]["bfloat16"]

    def cell(r: dict[str, Any]) -> str:
        return f"{r['fused_ms']:.1f} ms vs {r['torch_ms']:.0f} ms ({r['speedup']:.0f}x)"

    rows = [[src, cell(f32[src]), f"{f32[src]['fraction_of_bandwidth']:.0%}", cell(b16[src]),
             f"{b16[src]['fraction_of_bandwidth']:.0%}"] for src in f32]
    same = all(r["identical_to_torch"] for d in (f32, b16) for r in d.values())
    sh = result["shape"]
    return (f"Fused dequantize + re-rotate + write of a {sh['tokens']:,}-token cache ({sh['layers']} layers, "
            f"{sh['kv_heads']} KV heads, head_dim {sh['head_dim']}), C++ kernel vs the unfused torch path, "
            f"{result['threads']} threads, memcpy bandwidth {result['memcpy_GBps']:.1f} GB/s; results "
            f"{'bit-identical to' if same else 'NOT identical to'} the torch reference.\n\n" + md(head, rows))


def storage_table(result: dict[str, Any]) -> str:
    sh = result["shape"]
    rows = [[k, f"{v['bytes_per_token']:,.0f}", f"{v['ratio_vs_bf16']:.4g}x"]
            for k, v in result["bytes_per_token"].items()]
    c = result["cold_start_vs_recompute"]
    cold = [[k, f"{c[k]['ttft_s']:.2f} s", f"{c[k]['speedup_vs_recompute']:.0f}x",
             "yes" if c[k]["top1_same_as_recompute"] else "no"] for k in ("bf16", "int8", "int4") if k in c]
    r = result["redis_cross_process"]
    return (f"Bytes per token ({sh['layers']} layers, {sh['kv_heads']} KV heads, head_dim {sh['head_dim']}, "
            f"group {sh['group_size']}):\n\n" + md(["storage", "bytes per token", "vs bf16"], rows)
            + f"\n\nA fresh engine answering a {c['tokens']:,}-token prompt from a `disk:` store against "
              f"recomputing it ({c['recompute_s']:.1f} s):\n\n"
            + md(["files", "TTFT", "speedup", "same top-1"], cold)
            + f"\n\nRedis across processes: {r['hits']} of {r['blocks_requested_by_process_b']} blocks hit, "
              f"{r['get_ms_per_block']} ms per block.")


def ttft_tables(result: dict[str, Any]) -> str:
    import readme_table as rt  # benchmarks/readme_table.py

    return (f"{result['model']}, {result['machine']['cpu_threads']} threads, {result['date'][:10]}.\n\n"
            "Workload A (a system prompt, n warmed documents in a new order, a question):\n\n"
            + rt.workload_a_table(result) + "\n\nWorkload B (a multi-turn chat; TTFT in seconds per turn):\n\n"
            + rt.workload_b_table(result))


def quality_tables(result: dict[str, Any]) -> str:
    import readme_table as rt

    return rt.quality_tables(result) + ("\n\nThe stories260K rows need `../shared/models/stories260K`, which a "
                                        "clone lacks.")


def grammar_table(result: dict[str, Any]) -> str:
    head = ["library", "version", "per token (mask + advance)", "schema compile"]
    rows = []
    for lib in result["results"]:
        if not lib.get("installed") or not lib.get("schemas"):
            continue
        per = [s["per_token_us"] for s in lib["schemas"].values()]
        comp = [s["compile_s"] * 1e3 for s in lib["schemas"].values()]
        rows.append([lib["library"], lib["version"], f"{min(per):.0f}-{max(per):.0f} us",
                     f"{min(comp):.1f}-{max(comp):.1f} ms"])
    return (f"Constrained-decoding libraries on the {result['tokenizer']} vocabulary ({result['vocab']:,} tokens), "
            f"against a {result['decode_step_ms']:.0f} ms decode step; `{result['command'].strip()}`.\n\n"
            + md(head, rows))


def recheck_table(result: dict[str, Any]) -> str:
    rows = []
    for part in ("tune", "heldout"):
        for name, r in result.get(part, {}).items():
            rows.append([part, name, f"{r['mean_kl']:.4f}", f"{r['top1']:.0%}", f"{r['greedy_match']:.0%}",
                         f"{r['work_share']:.0%}"])
    return (f"{result['model']}, {result['prompts']} prompts per set (needs `../shared/models/stories260K`); work = "
            "token-layers run / (prompt tokens x layers).\n\n"
            + md(["prompts", "setting", "mean KL", "top-1", "greedy match", "work"], rows))


def determinism_cost_table(result: dict[str, Any]) -> str:
    rows = [[str(r["context"]), str(r["batch"]), "on" if r["deterministic"] else "off", f"{r['step_ms']:.0f} ms",
             f"{r['tok_s']:.1f}"] for r in result["rows"]]
    return (f"{result['model']}, {result['threads']} thread, one decode step:\n\n"
            + md(["context", "batch", "deterministic", "step", "tok/s"], rows))


def warm_stall_table(result: dict[str, Any]) -> str:
    """#26's warm stall: a running stream's largest gap between tokens while POST /v1/documents is warmed."""
    warm = [r for r in result["rows"] if "warm_budget" in r]  # the file may also hold --chunks rows
    rows = []
    for r in warm:
        budget = "whole request (before)" if r["warm_budget"] == "whole" else f"{r['warm_budget']} tokens"
        if r.get("warm_step_share"):
            budget += f", and {r['warm_step_share']:g} of a decode step"
        med = r["median_gap_s"]
        rows.append([budget, f"{r['warm_s']:.1f} s", str(r["tokens_during_warm"]),
                     f"{r['max_gap_during_warm_s'] * 1e3:.0f} ms ({r['max_gap_during_warm_s'] / med:.2f}x)",
                     f"{r['p90_gap_during_warm_s'] * 1e3:.0f} ms ({r['p90_gap_during_warm_s'] / med:.2f}x)"])
    first = warm[0]
    noise = [r["max_gap_without_warm_s"] / r["median_gap_s"] for r in warm]
    head = (f"{result['model'].rsplit('/', 1)[-1]}, {result['threads']} thread, one stream decoding while "
            f"{first['warm_documents']} new documents of about {first['warm_tokens'] // first['warm_documents']} "
            "tokens are warmed through the scheduler. Gaps between the stream's tokens, against its usual gap (the "
            f"median without a warm, {min(r['median_gap_s'] for r in warm) * 1e3:.0f}-"
            f"{max(r['median_gap_s'] for r in warm) * 1e3:.0f} ms); without a warm its largest gap was "
            f"{min(noise):.2f}-{max(noise):.2f}x the usual one (machine noise). The goal is a largest gap of at most "
            "2x.\n\n")
    return head + md(["warm budget per iteration", "warm time", "tokens streamed meanwhile",
                      "largest gap while warming", "90th percentile gap while warming"], rows)


# ------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True, slots=True)
class Table:
    """A generated block: the results files it reads (under benchmarks/results) and how it renders them.

    ``optional`` files are passed as None when absent; a missing required file leaves the block empty."""

    name: str
    sources: tuple[str, ...]
    render: Callable[..., str]
    optional: tuple[str, ...] = ()


def flops_table(result: dict[str, Any]) -> str:
    """#25's FLOP model: ideal and as-implemented FLOP fractions of a full prefill against the measured wall."""
    size = max(result["workload_a"]["sizes"], key=int)
    w = result["workload_a"]["sizes"][size]
    rows = []
    for name, m in w["methods"].items():
        if name == "full" or "flops_ideal_fraction" not in m:
            continue
        full_all, all_s = w["methods"]["full"].get("ttft_all_s", []), m.get("ttft_all_s", [])
        per_round = [f / x for f, x in zip(full_all, all_s)] if len(full_all) == len(all_s) > 1 else []
        spread = f" ({min(per_round):.2f}-{max(per_round):.2f}x per round)" if per_round else ""
        rows.append([f"`{name}`", f"{m['flops_ideal_fraction']:.3f}", f"{m['flops_implemented_fraction']:.3f}",
                     f"{m['wall_fraction']:.3f}", f"{m['efficiency']:.2f}", _fmt_speedup(m["speedup_vs_full"]) + spread,
                     f"{m['ttft_median_s']:.2f} s"])
    full = w["methods"]["full"]["ttft_median_s"]
    head = (f"{result['model']}, {w['context_tokens']:,} tokens ({w['documents']} re-placed documents), "
            f"{result['machine']['cpu_threads']} thread, attention query blocks of "
            f"{result['attention_block_rows']} rows; HF full prefill {full:.2f} s (median of "
            f"{len(w['methods']['full'].get('ttft_all_s', [])) or 1} rounds, each with its own documents and "
            "question). Fractions are of a full prefill; wall and TTFT ratios are of the medians; efficiency = "
            "ideal FLOP fraction / measured wall fraction (above 1: a FLOP costs less here than in HF's "
            "prefill).\n\n")
    return head + md(["setting", "ideal FLOPs", "as implemented", "wall", "efficiency", "TTFT vs full",
                      "TTFT"], rows)


def multiturn_table(result: dict[str, Any]) -> str:
    """#25's multi-turn chat: TTFT and reuse per turn, HF, exact prefix reuse and each kvboost variant."""
    pt = result["per_turn"]
    names = list(pt[0]["kvboost"]) if pt else []
    rows = []
    for p in pt:
        cells = [str(p["turn"]) + (" (new documents)" if p["turn"] in result["retrieve_turns"] else ""),
                 f"{p['prompt_tokens']:,.0f}", f"{p['hf_ttft_s']:.2f} s",
                 f"{_fmt_speedup(p['apc_speedup'])} ({p['apc_hit']:.0%})"]
        cells += [f"{_fmt_speedup(p['kvboost'][n]['speedup'])} ({p['kvboost'][n]['hit']:.0%})" for n in names]
        rows.append(cells)
    n_rows = len(result["rows"])
    same = []
    for n in names:
        total = sum(p["kvboost"][n]["same_answer"] for p in pt)
        ex = sum(p["kvboost"][n]["exact_only_turns"] for p in pt)
        ex_same = sum(p["kvboost"][n]["exact_only_same_answer"] for p in pt)
        bf = sum(r["kvboost"][n]["backfill_s"] for r in result["rows"])
        block = bool(result.get("variants", {}).get(n, {}).get("block_adapter"))
        exact = ("on turns with exact reuse only (exact for the adapted model, which is not the base model), "
                 if block else "on turns with exact reuse only, ")
        same.append(f"**{n}**: {total}/{n_rows} answers equal HF's; {exact}{ex_same}/{ex}"
                    + (f"; backfill {bf:.1f} s in all, between turns" if bf else ""))
    head = (f"{result['model']}, {result['conversations']} conversations x {result['turns']} turns, "
            f"k={result['k']} documents per retrieval, {result['max_new_tokens']} new tokens, greedy, "
            f"{result['threads']} thread. Cells: TTFT against HF full prefill (share of the prompt reused, not "
            "recomputed), medians over conversations.\n\n")
    return head + md(["turn", "prompt tokens", "HF full prefill", "exact prefix reuse (APC)",
                      *[f"kvboost {n}" for n in names]], rows) + "\n\n" + "\n".join(f"- {x}" for x in same)


def _cpu(result: dict[str, Any]) -> str:
    """The machine line of a result: its thread count, and what else ran where the run recorded it."""
    cpu = CPU.replace("1 thread", f"{result.get('threads', 1)} thread")
    return cpu.replace("other jobs running", result["machine"]) if result.get("machine") else cpu


def chat_turns_table(result: dict[str, Any]) -> str:
    """#33 item 5: a RAG chat's turns, HF full prefill, llama.cpp's prefix reuse, kvboost in process and served."""
    from kvboost_rag.app.bench.chat_turns import markdown_table

    skipped = "".join(f" {m} skipped: {why}." for m, why in result.get("skipped", {}).items())
    added = ", ".join(map(str, result["add_doc_turns"]))
    head = (f"{result['model']}, {result['conversations']} conversations x {result['turns']} turns (k={result['k']} "
            f"documents in turn 1, one more in turn {added}), HF's greedy answers of up to {result['max_new_tokens']} "
            f"tokens in the history, {_cpu(result)}. Cells: TTFT "
            "from the call's start, median over conversations (exact share of the prompt, i.e. cached tokens; the "
            "CPU time of the backfill after that turn), and ratios of those medians." + skipped + "\n\n")
    return head + markdown_table(result)


def chat_turns_line(result: dict[str, Any]) -> str:
    """README's one line from #33 item 5: follow-up turns in process against HF and llama.cpp, by think time."""
    pt = [p for p in result["per_turn"] if p["turn"] > 1]

    def span(key: str, field: str) -> str:
        vals = sorted(p[key][field] for p in pt if p.get(key, {}).get(field))
        return f"{_fmt_speedup(vals[0])} to {_fmt_speedup(vals[-1])}" if vals else "n/a"  # ratios of medians

    two = next((p for p in pt if p["turn"] == 2), {})
    one = next((p for p in result["per_turn"] if p["turn"] == 1), {})
    t0 = two.get("kvboost_think_0", {}).get("vs_hf")
    exact2, exact1 = two.get("exact_think_0", {}), one.get("exact_think_0", {})
    return (f"**Against llama.cpp's prefix reuse** (same GGUF, same token ids, {result['threads']} thread): when the "
            f"user's think time covers the backfill, {SMOLLM2}'s follow-up turns 2-{result['turns']} start in process "
            f"from {span('kvboost_think_backfill', 'vs_llamacpp')} than llama.cpp, through the server from "
            f"{span('server_think_backfill', 'vs_llamacpp')}"
            + (f"; with no think time turn 2 waits for turn 1's backfill and is {_fmt_speedup(t0)} than full "
               "prefill" if t0 else "")
            + (f"; with `exact_turns=True` it starts in {exact2['ttft_s']:.2f} s ({_fmt_speedup(exact2['vs_llamacpp'])} "
               f"than llama.cpp), and turn 1 costs a full prefill ({_fmt_speedup(exact1['vs_hf'])} than HF's)"
               if exact2.get("vs_llamacpp") and exact1.get("vs_hf") else "")
            + " ([chat turns vs llama.cpp](docs/experiments.md#chat-turns-vs-llamacpp)).")


def backfill_stall_table(result: dict[str, Any]) -> str:
    """#33's goal: a request's TTFT while a chat's backfill runs, against an idle engine, paired per round."""
    from kvboost_rag.app.bench.backfill_stall import markdown_table

    head = (f"{result['model']}, a chat turn of k={result['chat_k']} heldout documents, then a one-shot question of "
            f"k={result['probe_k']} others (the probe, one token, nothing stored) after each delay; backfill steps "
            f"of about {result['step_tokens']} tokens; {_cpu(result)}. TTFT from the call's start.\n\n")
    return head + markdown_table(result)


def decode_table(result: dict[str, Any]) -> str:
    """#35: decode tokens/s and a whole answer against llama.cpp, per thread count; the kernel table behind it."""
    labels = {"hf": "HF fp32", "kvboost_fp32": "kvboost, weights fp32", "kvboost_fp16": "kvboost, weights fp16",
              "llamacpp": "llama.cpp (Q4_1 GGUF)"}
    n = result["new_tokens"]
    lines = [f"{result['model']}, RAG prompts of k={result['k']} eval documents "
             f"({', '.join(str(t) for t in result['runs'][0]['prompt_tokens'])} tokens), {n} greedy tokens with EOS "
             f"masked, medians of {result['rounds']} rounds, 2-core x86 CPU, {result.get('machine') or 'other jobs running'}"
             ". kvboost answers over warmed documents at "
             "SmolLM2's defaults; TTFT and the answer's time from the call's start.", "",
             f"| threads | method | decode tokens/s | vs llama.cpp | {n}-token answer | TTFT |", "|---|---|---|---|---|---|"]
    for run in result["runs"]:
        m = run["methods"]
        for name, s in m.items():
            vs = _fmt_speedup(s["tokens_per_s"] / m["llamacpp"]["tokens_per_s"]) if "llamacpp" in m and \
                name != "llamacpp" else ""
            lines.append(f"| {run['threads']} | {labels.get(name, name)} | {s['tokens_per_s']:.1f} | {vs} | "
                         f"{s['total_s']:.2f} s | {s['ttft_s']:.2f} s |")
    bd = [(run["threads"], w, x) for run in result["runs"] for w, rows in run.get("batched_decode", {}).items()
          for x in rows]
    if bd:
        lines += ["", "The server's batched decoder in process (deterministic, as served), one step over "
                  f"{bd[0][2]['context']}-token rows: "
                  + "; ".join(f"{t} thread(s), weights {w}, batch {x['batch']}: {x['tokens_per_s']:.1f} tokens/s"
                              for t, w, x in bd) + "."]
    mem = result.get("resident_mb")
    if mem:
        lines += ["", "Resident memory over torch's own, one process each after loading and one short generation: "
                  + ", ".join(f"{labels.get(k, k)} {v:.0f} MiB" for k, v in mem.items() if v is not None) + "."]
    ops = result.get("ops")
    if ops:
        ms = {(x["kernel"], x["out"], x["in"], x["rows"]): x["ms"] for x in ops["rows"]}
        kernels = list(dict.fromkeys(k for k, *_ in ms))
        cols = list(dict.fromkeys(tuple(c) for _, *c in ms))  # (out, in, rows) in the order measured
        lines += ["", f"One linear layer, {ops['threads']} thread, ms per call (out x in, rows); batch-invariant: a "
                  "row's output alone equals it inside a batch of 8:", "",
                  "| kernel | " + " | ".join(f"{o}x{i}, {r} row{'s' if r > 1 else ''}" for o, i, r in cols)
                  + " | batch-invariant |", "|---|" + "---|" * len(cols) + "---|"]
        for k in kernels:
            cells = [f"{ms[(k, *c)]:.3f}" if (k, *c) in ms else "" for c in cols]
            lines.append(f"| {k} | " + " | ".join(cells) + f" | {'yes' if ops['batch_invariant'].get(k) else 'no'} |")
    return "\n".join(lines) + "\n"


def precision_table(result: dict[str, Any]) -> str:
    """#35 item 5: a weight precision's answers against fp32's on the same RAG prompts."""
    a, w = result["accuracy"], result["weights"]
    return (f"{result['model']}, {result['questions']} {result['split']} questions at k={result['k']} (median "
            f"{result['prompt_tokens_median']:.0f} prompt tokens), greedy answers of up to "
            f"{result['max_new_tokens']} tokens, plain HF full prefill on each; reference: {result['reference']}."
            "\n\n| | fp32 | " + w + " |\n|---|---|---|\n"
            f"| RAG accuracy | {a['fp32']:.1%} | {a[w]:.1%}: {a['diff'] * 100:+.1f} points "
            f"[{a['ci'][0] * 100:+.1f}, {a['ci'][1] * 100:+.1f}], McNemar p={a['mcnemar_p']:.2f} |\n"
            f"| answer equal to fp32's, token for token | | {result['same_answer']:.1%} |\n"
            f"| first sentence equal | | {result['same_first_sentence']:.1%} |\n"
            f"| first token equal | | {result['same_first_token']:.1%} |\n"
            f"| first-token KL(fp32 \\|\\| {w}), mean / max | | {result['first_token_kl_mean']:.1e} / "
            f"{result['first_token_kl_max']:.1e} |\n")


def decode_step_table(result: dict[str, Any]) -> str:
    """#35: one decode step through the planned forward, the lean step with SDPA and with the native attention."""
    lines = [f"{result['model']}, one decode step after {result['context']} tokens, medians of {result['steps']} "
             "steps, each path from its own copy of one prefilled cache, side by side in one process:", "",
             "| threads | weights | planned forward | lean step, SDPA | lean step, native attention | "
             "attention alone: SDPA / native / read floor | lean SDPA bitwise | native max logit diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        s, a = r["step_ms"], r["attention_ms"]
        lines.append(f"| {r['threads']} | {r['weights']} | {s['planned']:.1f} ms | {s['lean_sdpa']:.1f} ms | "
                     f"{s['lean_native']:.1f} ms ({_fmt_speedup(s['planned'] / s['lean_native'])}) | "
                     f"{a['sdpa']:.1f} / {a['native']:.1f} / {a['read_floor']:.1f} ms | "
                     f"{'yes' if r['lean_sdpa_bitwise'] else 'no'} | {r['lean_native_max_diff']:.1e} |")
    compiled = [r for r in result["runs"] if "lean_native_compiled" in r["step_ms"]]
    if compiled:
        lines += ["", "The lean step with the native attention through `torch.compile` (inductor, dynamic shapes): "
                  + "; ".join(f"{r['threads']} thread(s), {r['weights']}: {r['step_ms']['lean_native_compiled']:.1f} ms "
                              f"({_fmt_speedup(r['step_ms']['lean_native'] / r['step_ms']['lean_native_compiled'])} "
                              f"than eager), {r['compile_s']:.1f} s of warm-up" for r in compiled)
                  + ". Not used: it is no faster here."]
    return "\n".join(lines) + "\n"


def paged_attention_table(result: dict[str, Any]) -> str:
    """#36: decode attention through a page table against a dense cache, per page size and page placement."""
    g = result["geometry"]
    lines = [f"Decode attention alone, one query row per head over {result['context']} tokens of fp32 K/V, every "
             f"layer of a {g['layers']}-layer model ({g['heads']} query heads over {g['kv_heads']} KV heads of "
             f"{g['head_dim']}), medians of {result['rounds']} passes, side by side in one process. Paged arms read "
             "through a table of a `PagePool` (`kvboost_core.serving.pages`) with the native paged kernel and are "
             "bitwise the dense native kernel on the same rows:", "",
             "| threads | page tokens | dense, SDPA | dense, native | paged, pages in a run | paged, pages scattered | "
             "page-major storage, a run | keys before RoPE, rotated in torch |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        ms, base = r["ms"], r["ms"]["dense_native"]
        paged = [f"{ms[a]:.2f} ms ({_fmt_speedup(base / ms[a])})" if a in ms else "-"
                 for a in ("paged_run", "paged_scattered", "page_major_run", "prerope_torch")]
        lines.append(f"| {r['threads']} | {r['page_tokens']} | {ms['dense_sdpa']:.2f} ms | {base:.2f} ms | "
                     + " | ".join(paged) + " |")
    lines += ["", "Ratios against the dense native kernel. The pool stores each KV head's pages back to back "
              "(head-major), so a run of pages reads like a dense sequence; scattered pages do not. The last column "
              "is what sharing a document's pages across positions would cost per step in torch: its keys stored "
              "before RoPE, gathered and rotated to the request's positions on every read."]
    return "\n".join(lines) + "\n"


def kv_pool_table(result: dict[str, Any]) -> str:
    """#36: the decode batch over a shared page pool against dense rows, one process."""
    d, p, b, one = result["dense"], result["paged"], result["budget"], result["one_request_kv_bytes"]
    mib = 2 ** 20
    toks = result["prompt_tokens"]
    lines = [f"{result['model']}, {result['threads']} thread(s): {result['concurrency']} requests over the same "
             f"{result['documents']} heldout documents in one order, each with its own question (prompts "
             f"{min(toks):,}-{max(toks):,} tokens, prefilled as the server does), held by each decoder in turn; "
             f"greedy decode over {result['steps']} steps at batch {result['concurrency']}; pages of "
             f"{result['page_tokens']} tokens:", "",
             "| decoder | KV held | against one request's | resident memory growth | joining, per request | "
             "decode tokens/s |", "|---|---|---|---|---|---|",
             f"| dense rows (default) | {d['kv_bytes'] / mib:,.0f} MiB | {d['kv_bytes'] / one:.2f}x | "
             f"{d['rss_growth'] / mib:,.0f} MiB | {d['add_s'] * 1e3:.0f} ms | {d['tokens_per_s']:.1f} |",
             f"| page pool (`--kv-pool`) | {p['kv_bytes'] / mib:,.0f} MiB ({p['pages_shared']} of {p['pages_used']} "
             f"pages shared) | {p['kv_bytes'] / one:.2f}x | {p['rss_growth'] / mib:,.0f} MiB | "
             f"{p['add_s'] * 1e3:.0f} ms | {p['tokens_per_s']:.1f} "
             f"({_fmt_speedup(p['tokens_per_s'] / d['tokens_per_s'])}) |", "",
             f"Both decoders gave the same tokens: {'yes' if result['same_tokens'] else 'no'}. A fixed budget of "
             f"{b['bytes'] / mib:,.0f} MiB ({b['bytes'] / one:.0f} requests' unshared KV) holds {b['dense_requests']} "
             f"requests as dense rows and {b['paged_requests']}{' (every request tried)' if b['paged_capped'] else ''}"
             " in the pool."]
    moved = result.get("paged_shuffled")
    if moved:
        lines += ["", f"The same documents in another order per request (seeded shuffles): the pool holds "
                  f"{moved['kv_bytes'] / mib:,.0f} MiB, {moved['kv_bytes'] / one:.2f}x one request's "
                  f"({moved['pages_shared']} of {moved['pages_used']} pages shared). Pages are shared only where "
                  "equal tokens sit at equal positions, so a document that moves is held again."]
    return "\n".join(lines) + "\n"


def int4_ort_table(result: dict[str, Any]) -> str:
    """#35: int4 weights (the GGUF's blocks) through onnxruntime's MatMulNBits against FBGEMM fp16 and fp32."""
    names = {"fp32": "fp32 (MKL)", "fp16": "fp16 weights (FBGEMM, `weights=\"fp16\"`)",
             "ort_int4_fp32": "int4 weights, fp32 compute (ORT, accuracy 0)",
             "ort_int4_int8act": "int4 weights, int8 activations (ORT, accuracy 4)"}
    threads = list(result["step_linears_ms"])
    head = ["weights"] + [f"a step's linear layers + head, {n} thread(s)" for n in threads] + [
        f"prefill of {result['context']} tokens, {n} thread(s)" for n in threads] + [
        "first-token KL, mean / max", "max logit diff", "same answer / first sentence"]
    lines = [f"{result['model']}, every linear layer from the GGUF's own blocks ({result['gguf']}: Q4_1 layers, "
             "the Q8_0 tied head) through onnxruntime's `MatMulNBits`, against the same model's fp32 and fp16-packed "
             f"weights, side by side in one process. Fidelity against plain HF on the fp32 weights over "
             f"{next(iter(result['fidelity'].values()))['prompts']} heldout RAG prompts (k={result['k']}), greedy "
             f"answers of up to {result['max_new_tokens']} tokens:", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for name, label in names.items():
        row = [label]
        row += [f"{result['step_linears_ms'][n][name]['layers']:.1f} + {result['step_linears_ms'][n][name]['head']:.1f}"
                " ms" for n in threads]
        row += [f"{result['prefill_s'][n][name]:.2f} s" for n in threads]
        f = result["fidelity"].get(name)
        row += (["(reference)", "", ""] if f is None else
                [f"{max(f['first_token_kl_mean'], 0):.1e} / {max(f['first_token_kl_max'], 0):.1e}",
                 f"{f['max_logit_diff']:.1e}", f"{f['same_answer']:.0%} / {f['same_first_sentence']:.0%}"])
        lines.append("| " + " | ".join(row) + " |")
    w = result["weight_bytes"]
    lines += ["", f"The int4 form holds {w['int4 (codes, scales, mins)'] / 2 ** 20:.0f} MiB of codes, scales and mins "
              f"against the fp32 layers' {w['fp32'] / 2 ** 20:.0f} MiB ({w['int4 (codes, scales, mins)'] / w['fp32']:.2f}x)."]
    return "\n".join(lines) + "\n"


def decode_line(result: dict[str, Any]) -> str:
    """README's line from #35: decode tokens/s at fp16 against fp32 and llama.cpp, per thread count."""
    parts = []
    for run in result["runs"]:
        m = run["methods"]
        f16, f32 = m["kvboost_fp16"]["tokens_per_s"], m["kvboost_fp32"]["tokens_per_s"]
        part = (f"{run['threads']} thread{'s' if run['threads'] > 1 else ''}: {f16:.1f} tokens/s against "
                f"{f32:.1f} at fp32 ({_fmt_speedup(f16 / f32)})")
        if "llamacpp" in m:
            part += (f", {_fmt_speedup(f16 / m['llamacpp']['tokens_per_s'])} than llama.cpp on the Q4_1 GGUF; the "
                     f"whole answer over warmed documents {m['kvboost_fp16']['total_s']:.1f} s against llama.cpp's "
                     f"{m['llamacpp']['total_s']:.1f} s")
        parts.append(part)
    return (f"**Decode** (`weights=\"fp16\"`, opt-in; {result['model']}, {result['new_tokens']} tokens after a "
            f"~{result['runs'][0]['prompt_tokens'][0]:,}-token RAG prompt): " + "; ".join(parts)
            + " ([decode figures](docs/figures.md#decode)).")


TABLES = (
    Table("headline", ("rag_eval.json", "rag_ttft_4k.json", "ttft.json"), headline_table),
    Table("when", ("rag_eval.json", "rag_ttft_4k.json", "ttft.json"), when_to_use, optional=("multiturn.json",)),
    Table("rag_eval", ("rag_eval.json",), rag_eval_table),
    Table("block", ("rag_heldout_block.json", "block_ttft_4k.json"), block_table),
    Table("block_final", ("rag_test_block.json", "rag_heldout_block_final.json", "block_final_ttft_4k.json",
                          "block_scale_b_gpu/dev128_eval.json"), block_final_table),
    Table("block_final_short", ("rag_test_block.json", "rag_heldout_block_final.json", "block_final_ttft_4k.json",
                                "block_scale_b_gpu/dev128_eval.json"), functools.partial(block_final_table, goals_list=False)),
    Table("rag_long", ("rag_ttft_4k.json",), rag_long_table),
    Table("rag_tune", ("rag_tune_a.json", "rag_tune_b.json"), rag_summary_table),
    Table("rag_tune_chatwarm", ("rag_tune_chatwarm.json",), rag_summary_table),
    Table("rag_tune_mass", ("rag_tune_mass.json",), rag_summary_table),
    Table("rag_tune_recheck", ("rag_tune_recheck.json",), rag_summary_table),
    Table("reader", ("rag_eval_reader.json", "rag_eval.json"), reader_table),
    Table("reader_r15mix", ("rag_eval_reader_r15mix.json", "rag_eval.json"), reader_table),
    Table("serve", ("serve.json",), serve_table, optional=("serve_nodet.json",)),
    Table("serve_determinism_cost", ("serve_determinism_cost.json",), determinism_cost_table),
    Table("warm_stall", ("serve_warm_stall.json",), warm_stall_table),
    Table("quant_real", ("quant_real.json",), quant_real_table),
    Table("quant_fidelity", ("quant_fidelity.json",), quant_fidelity_table),
    Table("kernels", ("kernels.json",), kernels_table),
    Table("storage", ("storage.json",), storage_table),
    Table("ttft", ("ttft.json",), ttft_tables),
    Table("quality", ("quality.json",), quality_tables),
    Table("grammar", ("grammar.json",), grammar_table),
    Table("recheck_stories", ("recheck_stories.json",), recheck_table),
    Table("flops", ("ttft_flops_4k.json",), flops_table),
    Table("multiturn", ("multiturn.json",), multiturn_table),
    Table("chat_turns", ("chat_turns.json",), chat_turns_table),
    Table("chat_turns_line", ("chat_turns.json",), chat_turns_line),
    Table("backfill_stall", ("backfill_stall.json",), backfill_stall_table),
    Table("decode", ("decode.json",), decode_table),
    Table("decode_step", ("decode_step.json",), decode_step_table),
    Table("decode_line", ("decode.json",), decode_line),
    Table("paged_attention", ("paged_attention.json",), paged_attention_table),
    Table("kv_pool", ("kv_pool.json",), kv_pool_table),
    Table("precision_fp16", ("precision_fp16.json",), precision_table),
    Table("int4_ort", ("int4_ort.json",), int4_ort_table),
)
PLOTS = ("rag_eval.png", "ttft.png", "serve.png", "serve_demo.png", "grammar.png", "multiturn.png", "chat_turns.png",
         "ttft_flops_4k_flops.png", "decode.png", "backfill_stall.png")


def render_block(table: Table, root: Path = ROOT) -> str:
    """The Markdown between the markers ('' when a required results file is absent)."""
    paths = [root / RESULTS / s for s in table.sources]
    if not all(p.is_file() for p in paths):
        return ""
    args = [json.loads(p.read_text()) for p in paths]
    for s in table.optional:
        p = root / RESULTS / s
        args.append(json.loads(p.read_text()) if p.is_file() else None)
    files = ", ".join(f"`{RESULTS / s}`" for s in table.sources + tuple(
        s for s in table.optional if (root / RESULTS / s).is_file()))
    return table.render(*args).rstrip() + f"\n\n<small>Rendered from {files} by `scripts/render_figures.py`.</small>\n"


def pages(root: Path = ROOT) -> list[Path]:
    out = [root / "README.md"]
    out += sorted((root / "docs").rglob("*.md"))
    return [p for p in out if p.is_file()]


def render_page(text: str, root: Path = ROOT, where: str = "") -> str:
    by_name = {t.name: t for t in TABLES}
    cache: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in by_name:
            raise SystemExit(f"{where}: marker names no table: figures:{name} (known: {', '.join(by_name)})")
        if name not in cache:
            cache[name] = render_block(by_name[name], root)
        return m.group(1) + cache[name] + m.group(4)

    return BLOCK.sub(sub, text)


def render_all(root: Path = ROOT) -> dict[Path, str]:
    """Every page's text as it should be committed (only pages with markers)."""
    out = {}
    for page in pages(root):
        text = page.read_text()
        if BLOCK.search(text):
            out[page] = render_page(text, root, str(page.relative_to(root)))
    return out


def plot_copies(root: Path = ROOT) -> dict[Path, Path]:
    """docs/figures/<name> -> benchmarks/results/<name> for every plot that exists."""
    return {root / PLOTS_DIR / p: root / RESULTS / p for p in PLOTS if (root / RESULTS / p).is_file()}


def stale(root: Path = ROOT) -> list[str]:
    """Pages and plot copies that differ from what this script renders (empty when up to date)."""
    out = [str(p.relative_to(root)) for p, text in render_all(root).items() if p.read_text() != text]
    out += [str(dst.relative_to(root)) for dst, src in plot_copies(root).items()
            if not dst.is_file() or dst.read_bytes() != src.read_bytes()]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a committed page or plot copy is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        if bad:
            print("stale (run python scripts/render_figures.py): " + ", ".join(bad), file=sys.stderr)
            return 1
        print("figures up to date")
        return 0
    for page, text in render_all().items():
        if page.read_text() != text:
            page.write_text(text)
            print(f"rendered {page.relative_to(ROOT)}")
    for dst, src in plot_copies().items():
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            print(f"copied {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

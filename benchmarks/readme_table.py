"""Markdown tables for the README from a ``kvboost-rag bench --json`` result (figures are never typed in).

    python benchmarks/readme_table.py benchmarks/results/ttft.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LABELS = {
    "full": "full prefill (HF `model(ids, logits_to_keep=1)`)",
    "prefix_cache": "exact-prefix cache (vLLM APC / SGLang style)",
    "cold": "kvboost cold (no hits)",
    "none": "kvboost `none` (re-rotated, no repair)",
    "selective": "kvboost `selective`",
    "cacheblend": "kvboost `cacheblend` r=0.15 (default)",
    "exact_repeat": "kvboost exact repeat",
}


def _cell(m: dict[str, Any], method: str) -> str:
    if method == "full":
        return f"{m['ttft_median_s']:.2f} s (1x)"
    return f"{m['speedup_vs_full']:.2f}x ({m['ttft_median_s']:.2f} s)"


def _md(head: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def workload_a_table(result: dict[str, Any]) -> str:
    sizes = result["workload_a"]["sizes"]
    cols = list(sizes.values())
    methods: list[str] = []
    for c in cols:
        methods += [m for m in c["methods"] if m not in methods]
    head = ["method", *(f"{c['context_tokens']:,} tokens" for c in cols), "reuse (largest)"]
    rows = []
    for m in methods:
        label = LABELS.get(m, f"`{m}` (PyPI peer, timed by us from the call's start)")
        cells = [_cell(c["methods"][m], m) if m in c["methods"] else "n/a" for c in cols]
        reuse = cols[-1]["methods"].get(m, {}).get("reuse_ratio")
        rows.append([label, *cells, "" if reuse is None else f"{reuse:.0%}"])
    lines = _md(head, rows)
    ratio = result["workload_a"].get("ours_cacheblend_vs_peer_cacheblend")
    if ratio:
        lines.append("")
        lines.append("Peer cacheblend TTFT / ours: " + ", ".join(
            f"{sizes[n]['context_tokens']:,} tokens {r:.2f}x" for n, r in ratio.items()))
    return "\n".join(lines)


def workload_b_table(result: dict[str, Any]) -> str:
    b = result.get("workload_b")
    if not b:
        return ""
    turns = b.get("turns") or []
    if not turns:
        return json.dumps(b)[:400]
    keys = [k for k in turns[0] if k.endswith("_s")]
    rows = [[str(i), str(t.get("prompt_tokens", "")), *(f"{t[k]:.2f}" for k in keys)] for i, t in enumerate(turns, 1)]
    return "\n".join(_md(["turn", "prompt tokens", *keys], rows))


def _quality_block(part: dict[str, Any], name: str, title: str, head: list[str], methods: dict[str, Any],
                   cells: Any, labels: dict[str, str] = LABELS) -> list[str]:
    """A quality section: its title and one table row per method, or the reason it was skipped."""
    if "skipped" in part:
        return [f"{name}: skipped ({part['skipped']})."]
    return [title, "", *_md(head, [[labels.get(m, m), *cells(s)] for m, s in methods.items()])]


def quality_tables(result: dict[str, Any]) -> str:
    q = result.get("quality")
    if not q:
        return ""
    acc, fid = q["demo_accuracy"], q["stories_fidelity"]
    setting = acc.get("cacheblend_setting")  # the model's own (calibrated) setting, when it ships one
    labels = LABELS if not setting else {**LABELS, "cacheblend": (
        f"kvboost `cacheblend`, r={setting['recompute_ratio']}, check layer {setting['check_layer']} (the setting "
        "the engine loaded for this model)")}
    out = _quality_block(
        acc, "Demo-model accuracy",
        f"Demo model, {acc.get('questions')} held-out questions (closed book: {acc.get('closed_book_accuracy', 0):.1%}):",
        ["method", "accuracy", "single-hop", "two-hop", "same answer as full", "reuse"], acc.get("methods", {}),
        lambda s: [f"{s['accuracy']:.1%}", f"{s['single_hop']:.1%}", f"{s['two_hop']:.1%}",
                   f"{s['agreement_with_full']:.1%}", f"{s['reuse_ratio']:.0%}"], labels)
    out += [""] + _quality_block(
        fid, "stories260K fidelity",
        f"stories260K, {fid.get('prompts')} prompts of reordered warmed documents vs full prefill:",
        ["method", "mean KL", "top-1", "greedy match", "reuse"], fid.get("summary", {}),
        lambda s: [f"{s['mean_kl']:.4f}", f"{s['top1_agree']:.0%}", f"{s['greedy_match']:.0%}",
                   f"{s['reuse_ratio']:.0%}"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or ["benchmarks/results/ttft.json"])[0])
    result = json.loads(path.read_text())
    print(f"Model: {result.get('model')}; date {result.get('date')}; machine {result.get('machine')}\n")
    print(workload_a_table(result))
    print()
    print(workload_b_table(result))
    print()
    print(quality_tables(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

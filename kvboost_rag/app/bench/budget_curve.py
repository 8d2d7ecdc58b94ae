"""The block adapter's budget curve (issue #32): dev accuracy and answer KL against training CPU-minutes.

Each point is one adapter directory that ``kvboost-rag adapt --block --eval`` wrote (its ``block.json`` holds the
recipe, the CPU-minutes spent and the dev scores) or a ``dev_eval.json`` of ``--eval-only`` next to a shipped
adapter's ``block.json``. The base model's full prefill is the reference of every accuracy, with its paired
bootstrap 95% CI.

    python -m kvboost_rag.app.bench.budget_curve DIR [DIR ...] --json OUT.json --plot OUT.png
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from kvboost_rag.app.bench import write_json


def _cpu_minutes(trained: dict[str, Any]) -> float:
    """Training CPU-minutes (teacher targets not counted: they are computed once and shared). The shipped adapter
    predates the CPU-time log: its training wall seconds times its threads, an upper bound."""
    if trained.get("cpu_min") is not None:
        return float(trained["cpu_min"])
    return round(trained.get("train_s", 0) * trained.get("threads", 1) / 60, 1)


def point(directory: str) -> dict[str, Any]:
    """One adapter's point: recipe, CPU-minutes, steps, chats and its dev scores."""
    with open(os.path.join(directory, "block.json")) as f:
        trained = json.load(f).get("trained", {})
    dev = trained.get("dev") or {}
    extra = os.path.join(directory, "dev_eval.json")
    if not dev and os.path.isfile(extra):
        with open(extra) as f:
            dev = json.load(f)
    if not dev:
        raise ValueError(f"{directory}: no dev scores (train with --eval, or run --eval-only --init {directory})")
    cpu = _cpu_minutes(trained)
    init = trained.get("init")
    if init and os.path.isfile(os.path.join(init, "block.json")):  # a warm start: its own budget comes first
        with open(os.path.join(init, "block.json")) as f:
            cpu = round(cpu + _cpu_minutes(json.load(f).get("trained", {})), 1)
    return {"adapter": os.path.basename(os.path.normpath(directory)), "recipe": trained.get("recipe", "a (shipped)"),
            "cpu_min": cpu, "steps": trained.get("steps"), "chats": trained.get("chats", trained.get("samples")),
            "init": os.path.basename(os.path.normpath(init)) if init else None, "dev": dev}


def table(points: Sequence[dict[str, Any]]) -> str:
    rows = ["| adapter | recipe | CPU-min | steps | dev acc (block) | vs full prefill [95% CI] | answer KL |",
            "|---|---|---|---|---|---|---|"]
    for p in points:
        d, a = p["dev"], p["dev"].get("adapted") or p["dev"]["base"]
        rows.append(f"| {p['adapter']} | {p['recipe']} | {p['cpu_min']} | {p['steps']} | {a['acc']:.1%} | "
                    f"{100 * a['diff']:+.1f} [{100 * a['ci'][0]:+.1f}, {100 * a['ci'][1]:+.1f}] "
                    f"(full {d['full_acc']:.1%}, n={d['questions']}) | {a['answer_kl']:.3f} |")
    return "\n".join(rows)


def plot(points: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for p in points:
        a = p["dev"].get("adapted") or p["dev"]["base"]
        x = p["cpu_min"]
        ax1.errorbar([x], [100 * a["diff"]], yerr=[[100 * (a["diff"] - a["ci"][0])], [100 * (a["ci"][1] - a["diff"])]],
                     fmt="o", capsize=3, label=f"{p['adapter']} ({p['recipe']})")
        ax2.plot([x], [a["answer_kl"]], "o", label=p["adapter"])
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.set(xlabel="training CPU-minutes", ylabel="dev accuracy - full prefill (points)",
            title="block reuse vs base full prefill (95% CI)")
    ax2.set(xlabel="training CPU-minutes", ylabel="answer KL vs teacher", title="answer-row KL (dev)")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvboost_rag.app.bench.budget_curve", description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", help="adapter directories (block.json with dev scores)")
    ap.add_argument("--json", default=None, help="write the points here")
    ap.add_argument("--plot", default=None, help="write the plot here (PNG)")
    args = ap.parse_args(argv)
    try:
        points = [point(d) for d in args.dirs]
        for p in list(points):  # an --eval-only run that also scored the base weights: the curve's origin
            if "base" in p["dev"] and "adapted" in p["dev"]:
                base = {k: v for k, v in p["dev"].items() if k != "adapted"}
                points.append({"adapter": "base weights", "recipe": "-", "cpu_min": 0.0, "steps": 0, "chats": 0,
                               "init": None, "dev": base})
        points.sort(key=lambda p: p["cpu_min"])
    except (OSError, ValueError) as e:
        ap.exit(2, f"budget_curve: error: {e}\n")
    print(table(points))
    write_json(args.json, {"points": points})
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

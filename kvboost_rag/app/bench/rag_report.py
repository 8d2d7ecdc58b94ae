"""How a :mod:`kvboost_rag.app.bench.rag` result is shown: the terminal table (paired accuracy differences with
their intervals, agreement with full prefill, speed) and the recompute-share plot."""

from __future__ import annotations

import math
from typing import Any


def plot_curve(result: dict[str, Any], path: str) -> None:
    """Recompute share against same-answer rate, accuracy and speedup, one point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(((m["recompute"], m["same_answer"], m["accuracy"], m["speedup"], s)
                  for s, m in result["summary"].items() if s != "full"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [p[0] * 100 for p in pts]
    a1.plot(xs, [p[1] * 100 for p in pts], "o-", label="same answer as full prefill")
    a1.plot(xs, [p[2] * 100 for p in pts], "s-", label="accuracy")
    a1.axhline(result["summary"]["full"]["accuracy"] * 100, color="gray", ls="--", label="accuracy, full prefill")
    for x, p in zip(xs, pts):
        a1.annotate(p[4], (x, p[1] * 100), fontsize=7, xytext=(3, 3), textcoords="offset points")
    a1.set_xlabel("prompt tokens recomputed (%)")
    a1.set_ylabel("% of questions")
    a1.legend(fontsize=8)
    a2.plot(xs, [p[3] for p in pts], "o-")
    a2.set_xlabel("prompt tokens recomputed (%)")
    a2.set_ylabel("TTFT speedup (full / reuse)")
    fig.suptitle(f"{result['questions']} {result['split']} questions, k={result['k']} "
                 f"(~{int(result['prompt_tokens_median'])} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict[str, Any]) -> None:
    """Accuracy with its paired difference from full prefill (bootstrap 95% CI, McNemar p), the share of full
    prefill's right answers kept, agreement with full prefill (Wilson 95% CI) and speed."""
    from kvboost_rag.app.bench.stats import pct_ci
    from kvboost_rag.app.fmt import ratio_speedup

    print(f"split={result['split']} k={result['k']} questions={result['questions']} "
          f"prompt tokens (median)={result['prompt_tokens_median']}")
    print(f"{'setting':<18}{'acc':>7}  {'Δacc vs full [95% CI]':<24}{'McNemar p':>10}{'kept':>7}  "
          f"{'same answer [95% CI]':<22}{'KL':>8}{'reuse':>7}{'recomp':>8}{'TTFT s':>8}  speed")
    for s, m in result["summary"].items():
        ex = m.get("extra") or {}
        pa, same = ex.get("paired"), ex.get("same_answer_ci")
        delta = pct_ci(pa["diff"], pa["diff_lo"], pa["diff_hi"]) if pa else "reference"
        p = f"{pa['mcnemar_p']:.3f}" if pa else ""
        kept = f"{pa['kept_right']:.0%}" if pa and not math.isnan(pa['kept_right']) else ""
        same_s = (f"{same['rate']:.1%} [{same['lo']:.0%}, {same['hi']:.0%}]" if same else "")
        print(f"{s:<18}{m['accuracy']:>7.1%}  {delta:<24}{p:>10}{kept:>7}  {same_s:<22}{m['kl_mean']:>8.4f}"
              f"{m['reuse']:>7.1%}{m['recompute']:>8.1%}{m['ttft_s']:>8.3f}  {ratio_speedup(m['speedup'])}")
        if "block_cost" in ex:
            bc = ex["block_cost"]
            print(f"{'':<18}block reading's own cost, against the adapted model's full prefill "
                  f"({bc['reference_accuracy']:.1%}): {pct_ci(bc['diff'], bc['diff_lo'], bc['diff_hi'])}, "
                  f"McNemar p={bc['mcnemar_p']:.3f}")
        if "exact_vs_hf_block" in ex:
            e = ex["exact_vs_hf_block"]
            print(f"{'':<18}answers identical to the independent HF block construction: "
                  f"{round(e['rate'] * e['n'])}/{e['n']} [{e['lo']:.1%}, {e['hi']:.1%}]")

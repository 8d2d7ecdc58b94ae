"""What a chat's background backfill costs a request that arrives while it runs (issue 33's goal: a waiting
request's TTFT is at most one backfill step longer than on an idle engine).

Each round (heldout documents; speed only, nothing is scored): a one-shot RAG question (the probe, k documents
other than the chat's, one token) on an idle engine;
then a chat's first turn, which queues the backfill of its whole prompt (about ``--chat-k`` documents, several
steps of ``STEP_TOKENS`` tokens); after a delay that moves through the rounds, so the probe lands at different
points of a step, the same probe again. The probe never stores (``store_prefix=False``), so every probe does the
same work. TTFT counts from the call's start; the probe's extra time is paired with its own idle time in the same
round. The steps' times are the backfill job's own (``BackfillResult.steps``/``max_step_s``).

    OMP_NUM_THREADS=1 python benchmarks/bench_backfill_stall.py --threads 1 \\
        --json benchmarks/results/backfill_stall.json --plot benchmarks/results/backfill_stall.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvboost_core.serving.backfill import STEP_TOKENS
from kvboost_rag.app.bench.rag_chat import DEFAULT_MODEL, SYSTEM

DELAYS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4)  # seconds between the chat turn's end and the probe


def _messages(docs: list[str], question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"}]


def run(rag: Any, chats: list[tuple[list[str], str]], probe: str, delays: tuple[float, ...]) -> list[dict[str, Any]]:
    """One row per round (``chats[i]`` with ``delays[i]``): the probe's idle and mid-backfill TTFT, whether the
    backfill was still queued or running when the probe arrived, and the backfill job's steps."""
    eng = rag.engine
    special = rag.chat_add_special_tokens(probe)

    def ask() -> float:
        return float(rag.generate(probe, max_new_tokens=1, store_prefix=False, add_special_tokens=special)
                     .stats["ttft_s"])

    rows = []
    for (docs, question), delay in zip(chats, delays):
        if not eng.wait_backfill(timeout=600):
            raise RuntimeError("a backfill did not finish within 10 minutes")
        idle = ask()
        prompt = rag.chat_prompt(_messages(docs, question))
        rag.generate(prompt, chat_history="", max_new_tokens=8, add_special_tokens=rag.chat_add_special_tokens(prompt))
        time.sleep(delay)
        running = eng.stats()["backfill_pending"] > 0
        during = ask()
        if not eng.wait_backfill(timeout=600):
            raise RuntimeError("a backfill did not finish within 10 minutes")
        job = eng.backfill_results[-1]
        rows.append({"delay_s": delay, "idle_ttft_s": idle, "during_ttft_s": during, "extra_s": during - idle,
                     "backfill_pending": running, "steps": job.steps, "max_step_s": job.max_step_s,
                     "step_s_mean": job.seconds / max(job.steps, 1), "backfill_tokens": job.tokens,
                     "backfill_computed": job.computed, "backfill_cpu_s": job.cpu_s})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hit = [r for r in rows if r["backfill_pending"]]
    return {"rounds": len(rows), "rounds_mid_backfill": len(hit),
            "idle_ttft_s": statistics.median(r["idle_ttft_s"] for r in rows),
            "during_ttft_s": statistics.median(r["during_ttft_s"] for r in hit) if hit else None,
            "extra_s_median": statistics.median(r["extra_s"] for r in hit) if hit else None,
            "extra_s_max": max(r["extra_s"] for r in hit) if hit else None,
            "step_s_median": statistics.median(r["step_s_mean"] for r in rows),
            "step_s_max": max(r["max_step_s"] for r in rows),
            "within_one_step": all(r["extra_s"] <= r["max_step_s"] for r in hit)}


def markdown_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["| delay | probe TTFT idle | probe TTFT during the backfill | extra | backfill steps: mean, longest |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        during = f"{r['during_ttft_s']:.2f} s" + ("" if r["backfill_pending"] else " (backfill done)")
        lines.append(f"| {r['delay_s']:.1f} s | {r['idle_ttft_s']:.2f} s | {during} | {r['extra_s']:+.2f} s | "
                     f"{r['steps']} steps: {r['step_s_mean']:.2f} s, {r['max_step_s']:.2f} s |")
    verdict = "at most one step" if s["within_one_step"] else "MORE than one step"
    extra = (f"The probe arrived mid-backfill in {s['rounds_mid_backfill']} of {s['rounds']} rounds; there its TTFT "
             f"grew by {s['extra_s_median']:+.2f} s (median; at most {s['extra_s_max']:+.2f} s) against a mean step "
             f"of {s['step_s_median']:.2f} s (the longest {s['step_s_max']:.2f} s): {verdict}."
             if s["rounds_mid_backfill"] else "The probe never arrived mid-backfill.")
    return "\n".join(lines + ["", extra])


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = [r["delay_s"] for r in rows]
    ax.plot(x, [r["idle_ttft_s"] for r in rows], marker="o", label="probe TTFT, idle engine")
    ax.plot(x, [r["during_ttft_s"] for r in rows], marker="o", label="probe TTFT, backfill queued or running")
    ax.axhline(result["summary"]["idle_ttft_s"] + (result["summary"]["step_s_median"] or 0), ls="--", color="grey",
               label="idle + one backfill step (mean)")
    ax.set_xlabel("probe sent this long after the chat turn ended (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"A request during a chat's backfill: {result['model']}, {result['threads']} thread(s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_backfill_stall", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--chat-k", type=int, default=8, help="documents in the chat turn whose backfill runs")
    ap.add_argument("--probe-k", type=int, default=4, help="documents in the probe question")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args(argv)
    if min(args.chat_k, args.probe_k, args.threads) < 1:
        ap.error("--chat-k, --probe-k and --threads must be >= 1")
    import torch

    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app import rag_corpus as rc
    from kvboost_rag.app.loading import load_engine

    rag = KVBoostRAG(load_engine(args.model).engine)  # "demo" included (a quick check of this script)
    torch.set_num_threads(args.threads)
    corpus = rc.load_corpus("heldout")  # speed only: no answer is scored
    docs = [rc.doc_text(d) for d in corpus.documents]
    need = args.chat_k * len(DELAYS) + args.probe_k
    if len(docs) < need:
        ap.error(f"heldout has {len(docs)} documents; --chat-k x {len(DELAYS)} rounds + --probe-k needs {need}")
    rag.warm_documents(docs, progress=False)
    probe_docs = docs[-args.probe_k:]
    probe = rag.chat_prompt(_messages(probe_docs, corpus.questions[-1].question))
    chats = [(docs[i * args.chat_k:(i + 1) * args.chat_k], corpus.questions[i].question) for i in range(len(DELAYS))]
    rows = run(rag, chats, probe, DELAYS)
    result = {"model": args.model, "threads": args.threads, "chat_k": args.chat_k, "probe_k": args.probe_k,
              "step_tokens": STEP_TOKENS, "rows": rows, "summary": summarize(rows)}
    print(markdown_table(result))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    if args.plot_path:
        plot(result, args.plot_path)
    return 0

"""Decode stall under chunked prefill, in process through the server's scheduler (no HTTP): one request is
decoding when a long cold prompt (about ``--long-tokens`` tokens, nothing of it cached) arrives; the figure is
the largest gap between the running request's tokens while the long prompt is prefilled, against its median
gap, for each ``--prefill-chunk`` (0: the whole prompt in one iteration, as before chunked prefill).

    python benchmarks/serve_stall.py --chunks 0,512,128 --json benchmarks/results/serve_stall.json

``--warm-budgets`` measures the same for a document warm (``POST /v1/documents``: Scheduler.warm) of
``--warm-docs`` documents of about ``--warm-doc-tokens`` tokens arriving while the request decodes: the
largest gap while it is warmed, against the median gap outside the warm. Each entry is ``whole`` (the request
in one iteration, as before warms were shared), ``N`` (N tokens per iteration, paused between layers) or
``N@S`` (the same, and a slice also ends after S of the last decode step's time: the server's default is
``256@0.3``). The goal: max gap <= 2x the median.

    python benchmarks/serve_stall.py --chunks '' --warm-budgets whole,256,16,256@0.3 \
        --json benchmarks/results/serve_warm_stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUIET_TOKENS = 60  # tokens streamed without a warm (half before it, half after): the usual gap, and its noise
sys.path[:0] = [str(ROOT), str(ROOT / "integrations"), str(ROOT / "benchmarks")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct when present, else the demo model")
    p.add_argument("--chunks", default="0,512,128", help="--prefill-chunk values to compare (0: off)")
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--warm-budgets", default="",
                   help="warm settings to compare: whole, N (tokens per iteration) or N@S (and S of a decode step)")
    p.add_argument("--warm-docs", type=int, default=6, help="documents in the warm request (default 6)")
    p.add_argument("--warm-doc-tokens", type=int, default=160,
                   help="about this many tokens per warmed document (default 160: 6 x 160, the issue's 967 tokens)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch
    from bench_serve import SMOLLM

    from kvboost_core import KVEngine, SamplingParams
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app import demo_data as dd
    from kvboost_rag.app.loading import load_engine
    from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

    torch.set_num_threads(args.threads)
    model = args.model or (str(SMOLLM) if (SMOLLM / "config.json").exists() else "demo")
    base = load_engine(model).engine
    records = [d["text"] for d in dd.load_corpus()]
    text, i = records[0].upper() + "\n", 1
    while len(base.tokenize_ids(text)) < args.long_tokens:
        text += records[i % len(records)].upper() + "\n"  # upper case: never a warmed or cached text
        i += 1
    results = []
    for n, chunk in enumerate(int(c) for c in args.chunks.split(",") if c.strip()):
        rag = KVBoostRAG(KVEngine(base.model, base.tokenizer, base.config))
        sched = Scheduler(base.driver, max_batch=4, prefill_chunk=chunk or None)
        sched.start()
        times: list[float] = []
        long_start: list[float] = []

        def running(kind: str, payload: Any, times: list[float] = times) -> None:
            if kind == "text":
                times.append(time.perf_counter())

        def long_emit(kind: str, payload: Any, long_start: list[float] = long_start) -> None:
            if kind in ("start", "error"):
                long_start.append(time.perf_counter())

        sched.submit(GenRequest(rag=rag, params=SamplingParams.create(400), emit=running, ignore_eos=True,
                                prompt=f"Story {n}: once upon a time"))
        while len(times) < 8:
            time.sleep(0.005)
        t_arrive = time.perf_counter()
        long_prompt = text + f"\nQuestion {n}: which country?\nAnswer:"  # a new prompt each run: cold
        sched.submit(GenRequest(rag=rag, params=SamplingParams.create(1), emit=long_emit, prompt=long_prompt))
        while not long_start:
            time.sleep(0.005)
        t_first = long_start[0]
        n_after = len(times)
        while len(times) < n_after + 8:
            time.sleep(0.005)
        sched.shutdown()
        gaps = [b - a for a, b in zip(times, times[1:])]
        during = [b - a for a, b in zip(times, times[1:]) if b > t_arrive and a < t_first]
        row = {"prefill_chunk": chunk, "long_prompt_tokens": len(base.tokenize_ids(long_prompt)),
               "long_ttft_s": t_first - t_arrive, "median_gap_s": statistics.median(gaps),
               "max_gap_during_long_prefill_s": max(during) if during else None,
               "tokens_during_long_prefill": sum(1 for t in times if t_arrive < t < t_first)}
        print(json.dumps(row), flush=True)
        results.append(row)
    for n, setting in enumerate(b.strip() for b in args.warm_budgets.split(",") if b.strip()):
        row = warm_row(base, records, n, setting, args.warm_docs, args.warm_doc_tokens)
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"model": model, "threads": args.threads, "load_average": os.getloadavg(), "rows": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def warm_row(base: Any, records: list[str], n: int, setting: str, n_docs: int, doc_tokens: int) -> dict[str, Any]:
    """One running request; a warm of ``n_docs`` new documents arrives; gaps while it is warmed."""
    from kvboost_core import KVEngine, SamplingParams
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.server.scheduler import GenRequest, Scheduler

    rag = KVBoostRAG(KVEngine(base.model, base.tokenizer, base.config))
    tokens, _, share = setting.partition("@")
    budget = 10**9 if tokens == "whole" else int(tokens)
    sched = Scheduler(base.driver, max_batch=4, warm_budget=budget, warm_step_share=float(share) if share else None)
    sched.start()
    times: list[float] = []

    def running(kind: str, payload: Any) -> None:
        if kind == "text":
            times.append(time.perf_counter())

    sched.submit(GenRequest(rag=rag, params=SamplingParams.create(1000), emit=running, ignore_eos=True,
                            prompt=f"Tale {n}: once upon a time"))
    while len(times) < 4 + QUIET_TOKENS // 2:  # the first tokens after the prefill are not the usual ones
        time.sleep(0.005)
    docs, r = [], n * n_docs * 8
    for i in range(n_docs):  # new texts each run (the run and document numbers): never warm already
        doc = f"Warm run {n}, document {i}."
        while len(base.tokenize_ids(doc)) < doc_tokens:
            doc += " " + records[r % len(records)]
            r += 1
        docs.append(doc)
    t_arrive = time.perf_counter()
    totals = sched.warm(rag, docs).future.result(timeout=3600)
    t_done = time.perf_counter()
    n_after = len(times)
    while len(times) < n_after + QUIET_TOKENS // 2:
        time.sleep(0.005)
    sched.shutdown()
    times = times[4:]
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b > t_arrive and a < t_done]
    # the usual per-token time: gaps wholly before the warm arrived or after it ended (not the ones it slowed)
    quiet = [b - a for a, b in zip(times, times[1:]) if b <= t_arrive or a >= t_done] or gaps
    median = statistics.median(quiet)
    worst = max(during) if during else None
    return {"warm_budget": tokens, "warm_step_share": float(share) if share else None, "warm_documents": n_docs,
            "warm_tokens": totals.tokens,
            "warm_s": t_done - t_arrive, "median_gap_s": median, "max_gap_during_warm_s": worst,
            "max_over_median": worst / median if worst else None,
            "largest_gaps_during_warm_s": sorted(during, reverse=True)[:5],
            "p90_gap_during_warm_s": statistics.quantiles(during, n=10, method="inclusive")[-1] if len(during) > 1 else worst,
            "max_gap_without_warm_s": max(quiet), "gaps_without_warm": len(quiet),
            "tokens_during_warm": sum(1 for t in times if t_arrive < t < t_done)}


if __name__ == "__main__":
    raise SystemExit(main())

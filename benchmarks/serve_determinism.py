"""Served determinism, in process through the server's own scheduler (no HTTP): the bench_serve workload
(RAG chats over warmed documents) served one request at a time on a ``--max-batch 1`` scheduler (each after the
ones before it, so prefix entries accumulate) and all at once on a ``--max-batch 8`` scheduler over a fresh
store. Reports how many requests got the same greedy tokens, and how many bitwise the same logits at every
step (the stronger check: last-bit differences flip only near-ties, so equal tokens can hide them).

    python benchmarks/serve_determinism.py --requests 16                      # the bench_serve chats
    python benchmarks/serve_determinism.py --requests 16 --system-repeat 40   # a two-chunk shared head
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations"), str(ROOT / "benchmarks")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct when present, else the demo model")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-repeat", type=int, default=0,
                   help="prepend 'You are a careful assistant. ' this many times to the system message")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch
    from bench_serve import SMOLLM, workload

    from kvboost_core import KVEngine, SamplingParams
    from kvboost_rag import KVBoostRAG
    from kvboost_rag.app.loading import load_engine
    from kvboost_rag.app.server import scheduler as sm

    torch.set_num_threads(args.threads)
    model = args.model or (str(SMOLLM) if (SMOLLM / "config.json").exists() else "demo")
    smol = model != "demo"
    docs, reqs = workload(None, args.requests, 10 if smol else 3, 8 if smol else 6)
    if args.system_repeat:
        for msgs in reqs:
            msgs[0]["content"] = "You are a careful assistant. " * args.system_repeat + msgs[0]["content"]
    base = load_engine(model).engine
    logits: dict[int, list[Any]] = {}
    alive: list[Any] = []
    real_sample = sm.sample

    def recording(lg: Any, params: Any, gen: Any) -> int:
        if id(params) not in logits:
            alive.append(params)
        logits.setdefault(id(params), []).append(lg.detach().float().cpu().clone())
        return real_sample(lg, params, gen)

    sm.sample = recording

    def run(max_batch: int, one_by_one: bool) -> list[tuple[list[int], list[Any]]]:
        rag = KVBoostRAG(KVEngine(base.model, base.tokenizer, base.config))
        rag.warm_documents(docs, progress=False)
        sched = sm.Scheduler(rag.engine.driver, max_batch=max_batch, max_queue=len(reqs))
        sched.start()
        out = []
        try:
            pending = []
            for msgs in reqs:
                ev = threading.Event()
                r = sm.GenRequest(rag=rag, params=SamplingParams.create(args.max_tokens), ignore_eos=True,
                                  emit=lambda k, _p, ev=ev: ev.set() if k in ("done", "error") else None,
                                  messages=msgs)
                sched.submit(r)
                pending.append((r, ev))
                if one_by_one:
                    ev.wait()
            for r, ev in pending:
                ev.wait()
                out.append((list(r.generated), logits[id(r.params)]))
        finally:
            sched.shutdown()
        return out

    t0 = time.perf_counter()
    seq = run(1, True)
    t1 = time.perf_counter()
    bat = run(8, False)
    t2 = time.perf_counter()
    tok = sum(a[0] == b[0] for a, b in zip(seq, bat))
    bit = sum(len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) for a, b in zip(seq, bat))
    worst = max(float((x - y).abs().max()) for a, b in zip(seq, bat) for x, y in zip(a[1], b[1]))
    res = {"model": model, "requests": len(reqs), "max_tokens": args.max_tokens, "system_repeat": args.system_repeat,
           "tokens_equal": f"{tok}/{len(reqs)}", "logits_bitwise_equal": f"{bit}/{len(reqs)}",
           "max_logit_diff": worst, "sequential_s": t1 - t0, "batched_s": t2 - t1}
    print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

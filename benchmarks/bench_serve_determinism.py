"""What batch-invariant decode costs: ``kvboost-rag serve --deterministic`` (default) vs ``--no-deterministic``.

Times kvboost_core.serving.batch.BatchedDecoder steps in process, on and off interleaved (rounds alternate, median
per configuration), for a lone request and a batch of 8, at two context lengths. Also records how far a
request's logits move between decoding alone and in a batch of 8 with each setting (on: 0 by design).

    python benchmarks/bench_serve_determinism.py --json benchmarks/results/serve_determinism_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations")]


def _decoder(engine: Any, pres: list[Any], deterministic: bool, steps: int) -> tuple[Any, list[Any]]:
    """A decoder holding the prefilled prompts ``pres`` (one row each) with room for ``steps`` tokens."""
    from kvboost_core.serving.batch import BatchedDecoder

    dec = BatchedDecoder(engine.driver, 8, deterministic=deterministic)
    slots = [dec.add(p.result.cache.keys, p.result.cache.values, len(p.result.token_ids),
                     len(p.result.token_ids) + steps + 1) for p in pres]
    return dec, slots


def step_seconds(engine: Any, pre: Any, batch: int, deterministic: bool, steps: int) -> float:
    """Mean seconds per decode step over ``steps`` steps, after one warm-up step."""
    dec, slots = _decoder(engine, [pre] * batch, deterministic, steps)
    dec.step({s: 5 for s in slots})
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        dec.step({s: 5 for s in slots})
    return (time.perf_counter() - t0) / (steps - 1)


def alone_vs_batch(engine: Any, pres: list[Any], deterministic: bool) -> float:
    """Largest logit difference of request 0's first decode step, alone vs beside the other prompts."""
    def first_step(group: list[Any]) -> Any:
        dec, slots = _decoder(engine, group, deterministic, 1)
        return dec.step({s: 5 for s in slots})[slots[0]]

    return float((first_step(pres[:1]) - first_step(pres)).abs().max())


def relative_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per context and batch: deterministic step time / plain step time - 1 (0.1: 10% slower)."""
    off = {(r["context"], r["batch"]): r["step_ms"] for r in rows if not r["deterministic"]}
    return {f"context {r['context']} batch {r['batch']}": r["step_ms"] / off[(r["context"], r["batch"])] - 1
            for r in rows if r["deterministic"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="512,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="decode steps timed per round (after one warm-up)")
    p.add_argument("--rounds", type=int, default=5, help="on/off rounds; the median round is reported")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from kvboost_core import Segment
    from kvboost_core.serving.batch import prefill
    from kvboost_rag.app.loading import load_engine

    torch.set_num_threads(args.threads)
    engine = load_engine(args.model).engine
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for ctx in contexts:
        pre = prefill(engine, [Segment(token_ids=[5 + i % 50 for i in range(ctx)])], store_prefix=False)
        times: dict[tuple[int, bool], list[float]] = {(b, d): [] for b in (1, 8) for d in (True, False)}
        for _ in range(args.rounds):
            for key in times:
                times[key].append(step_seconds(engine, pre, key[0], key[1], args.steps))
        for (batch, det), ts in times.items():
            s = statistics.median(ts)
            rows.append({"context": ctx, "batch": batch, "deterministic": det, "step_ms": s * 1e3,
                         "tok_s": batch / s})
            print(f"context {ctx} batch {batch} deterministic={det}: {s * 1e3:.1f} ms/step", flush=True)
    cost = relative_cost(rows)
    pres = [prefill(engine, [Segment(token_ids=[7 + (i * (k + 1)) % 60 for i in range(200 + 40 * k)])],
                    store_prefix=False) for k in range(8)]
    drift = {"on": alone_vs_batch(engine, pres, True), "off": alone_vs_batch(engine, pres, False)}
    print(f"deterministic step cost vs off: {cost}; alone vs batch logit drift: {drift}", flush=True)
    result = {"model": args.model, "threads": args.threads, "torch": torch.__version__,
              "machine": platform.machine(), "steps": args.steps, "rounds": args.rounds, "rows": rows,
              "deterministic_step_cost": cost, "alone_vs_batch_max_logit_diff": drift}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

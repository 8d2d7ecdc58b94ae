"""Progressive CacheBlend (a second check layer) on the trained stories260K Llama, beside one check layer.

Two prompt sets, reported apart: ``tune`` (the test suite's own documents, where settings may be chosen) and
``heldout`` (``kvboost_rag/app/assets/stories_eval/heldout.json``, never tuned on). For each setting: mean KL,
top-1 and 8-token greedy match against a full prefill of the same ids (``engine.verify``), the final recompute
share, and the *work* share: token-layers run through whole decoder layers over (prompt tokens x layers), which
counts what a second check layer spends below it.

    python benchmarks/bench_recheck_stories.py --json benchmarks/results/recheck_stories.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K"

# name -> engine kwargs (all cacheblend)
SETTINGS: dict[str, dict[str, Any]] = {
    "r0.15": {"recompute_ratio": 0.15},
    "r0.3": {"recompute_ratio": 0.3},
    "r0.5": {"recompute_ratio": 0.5},
    "r0.3>0.15@2": {"recompute_ratio": 0.3, "recheck_layer": 2, "recheck_ratio": 0.15},
    "r0.5>0.15@2": {"recompute_ratio": 0.5, "recheck_layer": 2, "recheck_ratio": 0.15},
    "r0.5>0.15@3": {"recompute_ratio": 0.5, "recheck_layer": 3, "recheck_ratio": 0.15},
    "r0.5>0.3@3": {"recompute_ratio": 0.5, "recheck_layer": 3, "recheck_ratio": 0.3},
}


def work_share(engine: Any, prompts: list[Any], kw: dict[str, Any]) -> float:
    shares = []
    for p in prompts:
        pre = engine.prefill(p, repair="cacheblend", store_prefix=False, reuse_repaired=False, **kw)
        per_layer = pre.stats["tokens_per_layer"]
        shares.append(sum(per_layer) / (len(per_layer) * len(pre.token_ids)))
    return statistics.fmean(shares)


def measure(engine: Any, prompts: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kw in SETTINGS.items():
        s = engine.verify(prompts, repairs=("cacheblend",), max_new_tokens=8, **kw).summary()["cacheblend"]
        out[name] = {"settings": kw, "mean_kl": s["mean_kl"], "top1": s["top1_agree"],
                     "greedy_match": s["greedy_match"], "recomputed_share": s["recomputed_share"],
                     "work_share": work_share(engine, prompts, kw)}
        print(f"  {name:<14} KL {s['mean_kl']:.4f}  top-1 {s['top1_agree']:.0%}  greedy {s['greedy_match']:.0%}"
              f"  recomputed {s['recomputed_share']:.0%}  work {out[name]['work_share']:.0%}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (STORIES / "config.json").exists():
        print(f"no stories260K model at {STORIES}", file=sys.stderr)
        return 2
    from kvboost_rag.app.bench.quality import STORIES_HELDOUT, story_prompts
    from kvboost_rag.app.loading import fidelity_prompts, load_engine

    result: dict[str, Any] = {"model": "stories260K", "prompts": args.prompts}
    loaded = load_engine(str(STORIES))
    docs, prompts = fidelity_prompts(loaded, args.prompts)
    loaded.engine.warm(docs)
    print("tune (the test suite's documents)")
    result["tune"] = measure(loaded.engine, prompts)
    data = json.loads(STORIES_HELDOUT.read_text())
    engine = load_engine(str(STORIES)).engine
    engine.warm(data["documents"])
    print("heldout")
    result["heldout"] = measure(engine, story_prompts(data["documents"], data["cues"], args.prompts))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

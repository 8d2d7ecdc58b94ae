"""Attention of sparse recomputed rows at SmolLM2's shape (9 heads on 3 KV heads, head_dim 64), one layer, CPU.

Compares, on the same random rows (a share ``--ratio`` of the reused positions plus a 64-token question):
the former path (bool (n, T) mask, K/V repeated to 9 heads, as HF's sdpa does when given a mask), a dense float
mask with native GQA, kvboost's causal query blocks (kvboost_core.model.attention) at several block sizes, and HF's
own causal prefill of all T rows (the reference a full prefill pays). ``--flex`` adds torch's compiled
flex_attention (its compile time is reported apart). Best of ``--repeat`` runs, side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/bench_block_attention.py --threads 1 \
        --json benchmarks/results/block_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_core.model import attention


def _best(fn: Any, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=0.7)
    ap.add_argument("--blocks", default="128,256,512,768")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t, h, h_kv, d, question = args.tokens, 9, 3, 64, 64
    body = t - question
    sel = torch.sort(torch.randperm(body)[: int(args.ratio * body)]).values
    pos = torch.cat((sel, torch.arange(body, t)))  # (n,) sorted
    n = pos.numel()
    q = torch.randn(1, h, n, d)
    k, v = torch.randn(1, h_kv, t, d), torch.randn(1, h_kv, t, d)
    allowed = (torch.arange(t).view(1, -1) <= pos.view(-1, 1)).view(1, 1, n, t)

    def old() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                              attn_mask=allowed)

    fmask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    ref = old().transpose(1, 2)
    out: dict[str, Any] = {"tokens": t, "rows": n, "ratio": args.ratio, "threads": args.threads, "seconds": {},
                           "max_abs_diff_vs_old": {}}
    out["seconds"]["old_bool_mask_repeat_kv"] = _best(old, args.repeat)
    out["seconds"]["dense_float_mask_gqa"] = _best(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, enable_gqa=True), args.repeat)
    module = torch.nn.Module()
    for rows in (int(b) for b in args.blocks.split(",") if b):
        plan = attention.row_blocks(pos, t, None, impl="sdpa", dtype=torch.float32, block_rows=rows)
        name = f"blocks_{rows}"
        out["seconds"][name] = _best(lambda plan=plan: attention.block_attention("sdpa", module, q, k, v, plan,
                                                                                 scaling=d ** -0.5), args.repeat)
        got = attention.block_attention("sdpa", module, q, k, v, plan, scaling=d ** -0.5)
        out["max_abs_diff_vs_old"][name] = float((got - ref).abs().max())
    qf = torch.randn(1, h, t, d)
    out["seconds"]["hf_full_prefill_causal_all_rows"] = _best(
        lambda: F.scaled_dot_product_attention(qf, k, v, is_causal=True, enable_gqa=True), args.repeat)
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(lambda b, hh, qi, ki: ki <= pos[qi], None, None, n, t, device="cpu")
        fa = torch.compile(flex_attention)
        t0 = time.perf_counter()
        got = fa(q, k, v, block_mask=bm, enable_gqa=True)
        out["flex_compile_s"] = time.perf_counter() - t0
        out["seconds"]["flex_attention_compiled"] = _best(lambda: fa(q, k, v, block_mask=bm, enable_gqa=True),
                                                          args.repeat)
        out["max_abs_diff_vs_old"]["flex"] = float((got.transpose(1, 2) - ref).abs().max())
    full = out["seconds"]["hf_full_prefill_causal_all_rows"]
    for name, s in out["seconds"].items():
        print(f"{name:<34} {s * 1e3:8.1f} ms  {s / full:5.2f} of HF's causal attention over all {t} rows")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

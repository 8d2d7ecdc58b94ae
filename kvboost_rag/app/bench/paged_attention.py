"""Decode attention over a page pool against a dense cache, side by side in one process (issue #36): what reading
a request's KV through its page table costs, per page size and per how its pages lie in the pool.

Arms, every layer of a model's geometry (SmolLM2-135M by default: 30 layers, 9 query heads over 3 KV heads of 64),
one query row per head over ``context`` tokens of random fp32 K/V:

- ``dense_sdpa`` / ``dense_native``: torch's SDPA and the native kernel over a dense (H_kv, T, D) cache per
  layer, what decode reads today (``kvboost_core.kernels.ops.decode_attention``);
- ``paged_run``: the native paged kernel (``ops.paged_decode_attention``) over a ``PagePool`` whose pages a fresh
  table took in one run (consecutive ids: a KV head's pages lie back to back in the head-major pool);
- ``paged_scattered``: the same table's size over pages scattered through the pool, as a pool in use for a while
  hands them out;
- ``page_major_run``: a run of pages in page-major storage (N, H_kv, P, D), the layout the pool does not use;
- ``prerope_torch``: what sharing a document's pages across positions would cost if done in torch: pages holding
  keys before RoPE, gathered, rotated to their positions (:func:`kvboost_core.rope.rerotate`), then the native
  dense kernel (not bitwise the others: different keys).

Medians of ``rounds`` passes over every layer after 3 warm-up passes; the paged arms are checked bitwise against
the dense native kernel on the same rows.

    OMP_NUM_THREADS=1 python benchmarks/bench_paged_attention.py --threads 1,2 --json benchmarks/results/paged_attention.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvboost_rag.app.bench import median_ms, write_json


def measure(layers: int, heads: int, kv_heads: int, head_dim: int, context: int, page_tokens: int,
            rounds: int, seed: int = 0) -> dict[str, Any]:
    """One configuration's arms (see the module docstring): ``{"ms": {arm: ms}, "bitwise": {arm: bool}}``."""
    import torch

    from kvboost_core.kernels import ops, reference
    from kvboost_core.rope import rerotate
    from kvboost_core.serving.pages import PagePool, PageTable

    g = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    n_pages = -(-context // page_tokens)
    q = torch.randn(heads, head_dim, generator=g)
    # the pool holds 4 tables' worth: the scattered arm's pages spread over all of it
    page_bytes = 2 * layers * kv_heads * page_tokens * head_dim * 4
    pool = PagePool(layers, kv_heads, head_dim, page_tokens, byte_budget=4 * n_pages * page_bytes)
    run = PageTable(pool)
    run.slots_for(context)
    for i in range(layers):
        pool.write(run, i, torch.randn(kv_heads, context, head_dim, generator=g),
                   torch.randn(kv_heads, context, head_dim, generator=g), 0)
    keys, values = [pool.keys(i) for i in range(layers)], [pool.values(i) for i in range(layers)]
    run_ids = torch.tensor(run.pages)
    free = [p for p in range(pool.num_pages) if p not in set(run.pages)]
    scattered = torch.tensor(free)[torch.randperm(len(free), generator=g)[:n_pages]]
    for i in range(layers):  # the scattered table's rows: the run's, copied into its pages
        keys[i][scattered] = keys[i][run_ids]
        values[i][scattered] = values[i][run_ids]
    dense_k = [reference.gather_pages(keys[i], run_ids, context).contiguous() for i in range(layers)]
    dense_v = [reference.gather_pages(values[i], run_ids, context).contiguous() for i in range(layers)]
    page_major_k = [k.contiguous() for k in keys]  # (N, H_kv, P, D) storage
    page_major_v = [v.contiguous() for v in values]

    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(context, dtype=torch.float32)[:, None] * inv  # (T, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (T, D)

    def rotated(i: int) -> Any:  # the engine's own rotation of cached keys
        return rerotate(reference.gather_pages(keys[i], run_ids, context), cos, sin).contiguous()  # (H_kv, T, D)

    def paged(ks: list[Any], vs: list[Any], ids: Any) -> Callable[[], list[Any]]:
        return lambda: [ops.paged_decode_attention(q, ks[i], vs[i], ids, context, scale) for i in range(layers)]

    arms: dict[str, Callable[[], list[Any]]] = {
        "dense_sdpa": lambda: [reference.decode_attention(q, dense_k[i], dense_v[i], context, scale)
                               for i in range(layers)],
        "dense_native": lambda: [ops.decode_attention(q, dense_k[i], dense_v[i], context, scale)
                                 for i in range(layers)],
        "paged_run": paged(keys, values, run_ids),
        "paged_scattered": paged(keys, values, scattered),
        "page_major_run": paged(page_major_k, page_major_v, run_ids),
        "prerope_torch": lambda: [ops.decode_attention(q, rotated(i), reference.gather_pages(values[i], run_ids,
                                                                                             context).contiguous(),
                                                      context, scale) for i in range(layers)],
    }
    dense = arms["dense_native"]()
    bitwise = {a: all(torch.equal(x, y) for x, y in zip(arms[a](), dense, strict=True))
               for a in ("paged_run", "paged_scattered", "page_major_run")}
    return {"ms": {a: median_ms(f, rounds, warmup=3) for a, f in arms.items()}, "bitwise": bitwise,
            "kv_mb": 2 * layers * kv_heads * context * head_dim * 4 / 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--page-tokens", default="16,64", help="comma-separated page sizes (tokens)")
    ap.add_argument("--context", type=int, default=1800, help="tokens each query row attends to")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from kvboost_core import kernels

    if not kernels.has_ext():
        print(f"kvboost-rag: error: the native kernels are not built ({kernels.load_error()})", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "geometry": {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                     "head_dim": args.head_dim}, "context": args.context, "rounds": args.rounds, "runs": [],
        "command": "python benchmarks/bench_paged_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        for p in (int(x) for x in args.page_tokens.split(",")):
            r = {"threads": t, "page_tokens": p, **measure(args.layers, args.heads, args.kv_heads, args.head_dim,
                                                           args.context, p, args.rounds)}
            result["runs"].append(r)
            print(f"{t} thread(s), pages of {p}: " + ", ".join(f"{a} {v:.2f} ms" for a, v in r["ms"].items())
                  + f"; bitwise {r['bitwise']}", flush=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

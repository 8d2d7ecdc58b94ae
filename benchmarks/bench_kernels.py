"""Cache-hit placement benchmark: fused native kernel vs the unfused torch path vs a bandwidth limit.

    python benchmarks/bench_kernels.py --json benchmarks/results/kernels.json

A 4K-token cache of Qwen2.5-0.5B shape (24 layers, 2 KV heads, head_dim 64) stored as int8, int4 (group 32)
or bf16 is loaded, re-rotated by a position delta and written into preallocated per-layer buffers
(1, H, T, D), as assembly.place does on a cache hit. Destination dtypes: fp32 (the engine's CPU cache dtype,
the fast one on CPU) and bf16 (the usual GPU cache dtype):
  * torch : to_dense + slice + rerotate + per-layer copy (the path before the kernels)
  * fused : kvboost_core.kernels.ops.place_block (the extension when built, else it equals torch)
  * limit : bytes moved (payload read + buffers written) / memcpy bandwidth of a large torch copy
Times are medians of --repeats runs (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvboost_core import kernels  # noqa: E402
from kvboost_core.kernels import ops  # noqa: E402
from kvboost_core.quant import quantize_payload  # noqa: E402
from kvboost_core.rope import rerotate  # noqa: E402
from kvboost_core.store.base import DensePayload  # noqa: E402

LAYERS, HEADS, HEAD_DIM, TOKENS = 24, 2, 64, 4096
DST_DTYPES = (torch.float32, torch.bfloat16)
DST_START, DELTA = 256, 1000  # the cached document moves 1000 positions: keys are re-rotated


def _median_s(fn, repeats: int) -> float:
    fn()  # warm up (page faults, thread pool)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_bandwidth(repeats: int) -> float:
    """Bytes per second moved (read + write) by a large tensor copy: the practical memory roofline."""
    n = 256 * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    t = _median_s(lambda: dst.copy_(src), repeats)
    return 2 * n * 4 / t


def rope_cos_sin(delta: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Qwen2.5's default RoPE (theta 1e6), HF layout: cat(freqs, freqs); every token moves by the same delta.
    inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = torch.cat([delta * inv, delta * inv]).expand(n, HEAD_DIM)
    return ang.cos().contiguous(), ang.sin().contiguous()


def torch_place(payload, keys, values, cos, sin) -> None:
    """assembly.place()'s loop before the kernels, for one placement."""
    k, v = payload.to_dense(keys[0].dtype, "cpu")
    k, v = k[:, :, :TOKENS], v[:, :, :TOKENS]
    k = rerotate(k, cos, sin)
    for layer in range(len(keys)):
        keys[layer][0, :, DST_START:DST_START + TOKENS] = k[layer]
        values[layer][0, :, DST_START:DST_START + TOKENS] = v[layer]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch/ATen threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    shape = (LAYERS, HEADS, TOKENS, HEAD_DIM)
    dense = DensePayload(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    payloads = {"int8": quantize_payload(dense, 8, 32), "int4": quantize_payload(dense, 4, 32),
                "bf16": DensePayload(dense.keys.bfloat16(), dense.values.bfloat16())}
    cap = DST_START + TOKENS
    cos, sin = rope_cos_sin(DELTA, TOKENS)
    bw = memcpy_bandwidth(args.repeats)
    results = {"backend": kernels.backend(), "threads": torch.get_num_threads(), "repeats": args.repeats,
               "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "tokens": TOKENS},
               "memcpy_GBps": bw / 1e9, "dst": {}}
    print(f"backend={results['backend']} threads={results['threads']} memcpy={bw / 1e9:.2f} GB/s")
    for dst_dtype in DST_DTYPES:
        keys = [torch.zeros(1, HEADS, cap, HEAD_DIM, dtype=dst_dtype) for _ in range(LAYERS)]
        values = [torch.zeros(1, HEADS, cap, HEAD_DIM, dtype=dst_dtype) for _ in range(LAYERS)]
        written = 2 * LAYERS * HEADS * TOKENS * HEAD_DIM * dst_dtype.itemsize
        modes: dict[str, dict] = {}
        results["dst"][str(dst_dtype).removeprefix("torch.")] = modes
        print(f"destination {dst_dtype}")
        print(f"{'mode':6} {'torch ms':>9} {'fused ms':>9} {'limit ms':>9} {'speedup':>8} {'% of bw':>8}")
        for name, payload in payloads.items():
            t_torch = _median_s(lambda p=payload, k=keys, v=values: torch_place(p, k, v, cos, sin), args.repeats)
            ref_k = torch.stack([k.clone() for k in keys])
            t_fused = _median_s(lambda p=payload, k=keys, v=values: ops.place_block(p, 0, TOKENS, k, v, DST_START,
                                                                                    cos, sin), args.repeats)
            same = torch.equal(ref_k, torch.stack(keys))
            moved = payload.nbytes + written
            limit = moved / bw
            row = {"torch_ms": t_torch * 1e3, "fused_ms": t_fused * 1e3, "limit_ms": limit * 1e3,
                   "speedup": t_torch / t_fused, "fraction_of_bandwidth": limit / t_fused, "bytes_moved": moved,
                   "identical_to_torch": same}
            modes[name] = row
            print(f"{name:6} {row['torch_ms']:9.2f} {row['fused_ms']:9.2f} {row['limit_ms']:9.2f} "
                  f"{row['speedup']:7.2f}x {100 * row['fraction_of_bandwidth']:7.1f}%  identical={same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

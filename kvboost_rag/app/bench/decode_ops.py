"""The decode benchmark's kernel table and figure (:mod:`.decode`): one linear layer at SmolLM2's shapes, timed
with each CPU kernel torch ships for holding weights below fp32, at one row (a decode step) and at a prefill's
2,048 rows, plus whether a row's output is the same alone and inside a batch of 8 (batched decoding's
determinism needs it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))  # (out, in): q/o, gate/up, down, LM head
ROWS = (1, 2048)


def _time(f: Callable[[], Any], budget_s: float = 0.3) -> float:
    f()
    n, t0 = 0, time.perf_counter()
    while True:
        f()
        n += 1
        if time.perf_counter() - t0 > budget_s and n >= 3:
            return (time.perf_counter() - t0) / n


def _bound(f: Callable[[Any], Any], x: Any) -> Callable[[], Any]:
    return lambda: f(x)


def kernels(w: Any) -> dict[str, Callable[[Any], Any]]:
    """``name -> f(x)`` computing ``x @ w.T`` (w: (N, K) fp32) with each kernel, its weights prepared once."""
    import torch
    import torch.nn.functional as F

    n, k = w.shape
    out: dict[str, Callable[[Any], Any]] = {"fp32 (MKL)": lambda x: F.linear(x, w)}
    p16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    out["fp16 weights (FBGEMM)"] = lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p16)
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    out["int8 weight-only (_weight_int8pack_mm)"] = lambda x: torch._weight_int8pack_mm(x, w8, scale)
    group = 32
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.rand(k // group, n, 2)
    out["int4 weight-only (_weight_int4pack_mm_for_cpu)"] = (
        lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, group, sz))
    wq = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    p8 = torch.ops.quantized.linear_prepack(wq, None)
    out["int8 dynamic (FBGEMM)"] = lambda x: torch.ops.quantized.linear_dynamic(x, p8, True)
    return out


def op_table(threads: int) -> dict[str, Any]:
    """Milliseconds per call of each kernel, per shape and row count; batch invariance per kernel."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    invariant: dict[str, bool] = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        for name, f in kernels(w).items():
            for m in ROWS:
                if m > 1 and n > 10_000:
                    continue  # the LM head runs on the last row only in a prefill
                x = torch.randn(m, k, generator=gen)
                rows.append({"kernel": name, "out": n, "in": k, "rows": m, "ms": _time(_bound(f, x)) * 1e3})
            if (n, k) == SHAPES[1]:
                x = torch.randn(8, k, generator=gen)
                alone = torch.cat([f(x[i:i + 1]) for i in range(8)])
                invariant[name] = bool(torch.equal(alone, f(x)))
    return {"threads": threads, "rows": rows, "batch_invariant": invariant}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    methods = [m for m in ("hf", "kvboost_fp32", "kvboost_fp16", "llamacpp") if m in runs[0]["methods"]]
    labels = {"hf": "HF fp32", "kvboost_fp32": "kvboost fp32", "kvboost_fp16": "kvboost fp16",
              "llamacpp": "llama.cpp (GGUF)"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(runs))]
        axes[0].bar(xs, [r["methods"][m]["tokens_per_s"] for r in runs], width, label=labels[m])
        axes[1].bar(xs, [r["methods"][m]["total_s"] for r in runs], width, label=labels[m])
    for ax, title in zip(axes, ("decode tokens/s (higher is better)",
                                f"{result['new_tokens']}-token answer end to end, s (lower is better)")):
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(runs))])
        ax.set_xticklabels([f"{r['threads']} thread(s)" for r in runs])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['model']}: decode after a ~{runs[0]['prompt_tokens'][0]}-token RAG prompt", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""A FLOP model of a prefill, from the model's config and the work the planned forward scheduled.

Counted: every matrix product (2 FLOPs per multiply-add): the Q/K/V/O projections, the gated MLP, attention's
Q K^T and P V, and the LM head on the last position. Norms, RoPE, softmax and the embedding lookup are left out
(elementwise, a few percent at most). Three numbers per prefill:

- ``full``: HF's full prefill of T tokens, attention at its causal cost (the fused kernel skips masked blocks).
- ``ideal``: the same model for the rows a schedule really needs: each layer's computed rows, attention at its
  causal cost for them, and at CacheBlend's check layer only the K and V projections of the candidates that
  are scored and then dropped.
- ``implemented``: what the kernels were asked to do: the check layer projects Q/K/V for every candidate and
  again for the kept ones, and attention computes every (query, key) pair of its blocks' spans (or every key
  under a dense mask).

``implemented`` equals what ``torch.utils.flop_counter.FlopCounterMode`` counts for a reuse prefill (tested in
tests/test_flops.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        heads = config.num_attention_heads
        return cls(hidden=config.hidden_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=config.intermediate_size, layers=config.num_hidden_layers, vocab=config.vocab_size)

    @property
    def q_flops(self) -> int:  # per row
        return 2 * self.hidden * self.heads * self.head_dim

    @property
    def kv_flops(self) -> int:  # K and V projections, per row
        return 2 * 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def row_flops(self) -> int:
        """One row through one layer, attention scores aside: Q/K/V/O projections and the gated MLP."""
        o = 2 * self.heads * self.head_dim * self.hidden
        mlp = 3 * 2 * self.hidden * self.intermediate
        return self.q_flops + self.kv_flops + o + mlp

    def attention_flops(self, pairs: int) -> int:
        return 2 * 2 * self.heads * self.head_dim * pairs  # Q K^T and P V

    @property
    def head_flops(self) -> int:
        return 2 * self.hidden * self.vocab  # the LM head, last position only


def full_prefill_flops(shape: Shape, tokens: int) -> int:
    causal = tokens * (tokens + 1) // 2
    return shape.layers * (tokens * shape.row_flops + shape.attention_flops(causal)) + shape.head_flops


@dataclass(frozen=True, slots=True)
class PrefillFlops:
    ideal: int
    implemented: int


def trace_flops(shape: Shape, traces: Sequence[Any]) -> PrefillFlops:
    """FLOPs of the planned forwards in ``traces`` (kvboost_core.model.forward.ForwardTrace, recorded with
    ``record_traces``); the LM head is counted once (the prefill's last position)."""
    ideal = implemented = shape.head_flops
    for tr in traces:
        for n, causal, computed in zip(tr.tokens_per_layer, tr.causal_pairs, tr.computed_pairs):
            ideal += n * shape.row_flops + shape.attention_flops(causal)
            implemented += n * shape.row_flops + shape.attention_flops(computed)
        if tr.kv_only_tokens:
            # K/V-only pass: Q, K and V projections of every scored row (HF's layer computes all three first),
            # then the whole layer again for the rows kept
            implemented += tr.kv_only_tokens * (shape.q_flops + shape.kv_flops)
            # ... except the projections of kept rows the whole-layer pass read from the scoring pass
            implemented -= getattr(tr, "replayed_tokens", 0) * (shape.q_flops + shape.kv_flops)
            # ideal: fresh K/V only for the rows scored and dropped; the kept ones' come with their layer
            kept = sum(tr.tokens_per_layer[c] for c in tr.check_layers)
            ideal += max(tr.kv_only_tokens - kept, 0) * shape.kv_flops
    return PrefillFlops(ideal, implemented)


def speedup(ratio: float) -> str:
    """full / reuse as "N.NNx faster", or "N.NNx slower" below 1."""
    if ratio <= 0:
        return "n/a"
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def flop_summary(shape: Shape, tokens: int, rows: Sequence[dict[str, Any]], wall_fraction: float
                 ) -> dict[str, float]:
    """One setting's fractions of a full prefill of ``tokens``: ideal and implemented FLOPs (medians over its
    prompts), the measured wall time, and the efficiency ideal / measured (1.0: as fast as its FLOPs allow)."""
    full = full_prefill_flops(shape, tokens)
    if "flops_ideal" not in rows[0]:  # full prefill itself
        return {"flops_ideal_fraction": 1.0, "flops_implemented_fraction": 1.0, "wall_fraction": 1.0,
                "efficiency": 1.0}
    ideal = sorted(r["flops_ideal"] for r in rows)[len(rows) // 2] / full
    impl = sorted(r["flops_implemented"] for r in rows)[len(rows) // 2] / full
    return {"flops_ideal_fraction": ideal, "flops_implemented_fraction": impl, "wall_fraction": wall_fraction,
            "efficiency": ideal / wall_fraction if wall_fraction > 0 else 0.0}


def print_flops(methods: dict[str, dict[str, Any]]) -> None:
    print(f"  {'':<15} {'ideal FLOPs':>12} {'implemented':>12} {'measured wall':>14} {'efficiency':>11}")
    for m, s in methods.items():
        if "efficiency" in s:
            print(f"  {m:<15} {s['flops_ideal_fraction']:>12.3f} {s['flops_implemented_fraction']:>12.3f}"
                  f" {s['wall_fraction']:>14.3f} {s['efficiency']:>11.2f}")


def plot_flops(result: dict[str, Any], path: str) -> None:
    """Per setting at the longest context: ideal and implemented FLOP fractions beside the wall fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["workload_a"]["sizes"]
    entry = max(sizes.values(), key=lambda v: v["context_tokens"])
    names = [m for m, s in entry["methods"].items() if "efficiency" in s and m != "full"]
    if not names:
        return
    keys = (("flops_ideal_fraction", "ideal FLOPs"), ("flops_implemented_fraction", "implemented FLOPs"),
            ("wall_fraction", "measured wall time"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for i, (key, label) in enumerate(keys):
        xs = [j + (i - 1) * width for j in range(len(names))]
        ax.bar(xs, [entry["methods"][m][key] for m in names], width, label=label)
    for j, m in enumerate(names):
        top = max(entry["methods"][m][k] for k in ("flops_ideal_fraction", "flops_implemented_fraction",
                                                     "wall_fraction"))
        ax.annotate(f"eff {entry['methods'][m]['efficiency']:.2f}", (j, top),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("fraction of HF full prefill")
    ax.set_title(f"FLOP model vs wall time — {result['model']}, {entry['context_tokens']} tokens, "
                 f"{result['machine']['cpu_threads']} thread{'' if result['machine']['cpu_threads'] == 1 else 's'}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)

"""Quantized-KV fidelity ablation on the trained stories260K model: where the int4/int8 error comes from.

    python benchmarks/bench_quant_fidelity.py --json benchmarks/results/quant_fidelity.json

Needs ../shared/models/stories260K (or --model DIR); exits with a message when it is absent. Runs the same
exact-prefix workload as ``tests/test_quant_fidelity.py`` (a prefix of the stories is warmed and quantized,
then one new token is prefilled on top of it) and compares the next-token logits with a full prefill of the
same ids: top-1 agreement and mean KL.

Besides the shipped configurations it runs ablations that are not product features, by swapping the
engine's quantization step for a quantize-then-dequantize of only part of the cache:
  * K only / V only: the other half stays exact, which bounds what any key (value) scheme can reach;
  * post-RoPE keys (the layout before pre-RoPE storage);
  * finer groups (8 tokens for K; V groups are capped at head_dim, 8 on this model);
  * outlier retention (KVQuant dense-and-sparse): the 1% most extreme values per tensor kept exact.
It also counts the prompts whose reference top-2 logit margin is under 0.05, the near-ties that any
perturbation can flip, to put the top-1 figures in scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kvboost_core.engine.prefill as engine_mod  # noqa: E402  # where the engine calls maybe_quantize
from kvboost_core import KVEngine  # noqa: E402
from kvboost_core.kv_encode import maybe_quantize  # noqa: E402
from kvboost_core.quant import (  # noqa: E402
    dequantize_k,
    dequantize_v,
    quantize_k,
    quantize_v,
    unrotate_keys,
)
from kvboost_core.rope import delta_cos_sin, rerotate  # noqa: E402
from kvboost_core.store.base import DensePayload  # noqa: E402
from kvboost_core.tuning.fidelity import exact_prefix_rows, prefix_probe_prompts  # noqa: E402

DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
NEAR_TIE = 0.05


def prompts(tok: Any, n: int) -> list[list[int]]:
    """The test's workload: prefixes of many lengths of the stories, each with a different last token."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import STORY_DOCS

    return prefix_probe_prompts(tok(" ".join(STORY_DOCS), add_special_tokens=False)["input_ids"], n)


def outlier_mask(x: torch.Tensor, frac: float, dim: int) -> torch.Tensor:
    """The ``frac`` share of ``x`` farthest from its median along ``dim`` (in MADs): kept exact."""
    med = x.median(dim=dim, keepdim=True).values
    z = (x - med).abs() / ((x - med).abs().median(dim=dim, keepdim=True).values + 1e-6)
    k = max(1, int(frac * x.numel()))
    return z >= z.flatten().topk(k).values[-1]


def fake_quantizer(quant_k: bool, quant_v: bool, pre_rope: bool, outliers: float = 0.0) -> Callable[..., Any]:
    """A stand-in for ``engine.maybe_quantize`` that returns the dequantized (dense) cache of the chosen parts."""

    def fake(dense: DensePayload, kv_bits: int | None, group_size: int = 32, *, start: int = 0,
             rotary_emb: Any = None) -> DensePayload:
        if kv_bits is None:  # chunks the engine keeps dense (the start chunk holding the attention sink)
            return dense
        k, v = dense.keys.float(), dense.values.float()  # (L, H, n, D)
        rot = pre_rope and rotary_emb is not None
        kp = unrotate_keys(k, start, rotary_emb) if rot else k
        d = k.shape[3]
        km = outlier_mask(kp, outliers, 2) if outliers else torch.zeros_like(kp, dtype=torch.bool)
        vm = outlier_mask(v, outliers, 3) if outliers else torch.zeros_like(v, dtype=torch.bool)
        # outliers are replaced by the median before quantizing, so they do not stretch their group's range
        k_in = torch.where(km, kp.median(dim=2, keepdim=True).values.expand_as(kp), kp)
        v_in = torch.where(vm, v.median(dim=3, keepdim=True).values.expand_as(v), v)
        kq = dequantize_k(*quantize_k(k_in, kv_bits, group_size), kv_bits, group_size, d) if quant_k else k_in
        vq = dequantize_v(*quantize_v(v_in, kv_bits, group_size), kv_bits, group_size, d) if quant_v else v_in
        kq, vq = torch.where(km, kp, kq), torch.where(vm, v, vq)
        if rot:
            cos, sin = delta_cos_sin(rotary_emb, torch.arange(start, start + k.shape[2]))
            kq = rerotate(kq, cos, sin)
        return DensePayload(kq.to(dense.keys.dtype), vq.to(dense.values.dtype))

    return fake


def run(model: Any, tok: Any, ps: list[list[int]], bits: int, group: int, chunk: int,
        quantizer: Callable[..., Any] | None = None) -> dict[str, float]:
    engine_mod.maybe_quantize = quantizer or maybe_quantize  # type: ignore[assignment]
    try:
        eng = KVEngine(model, tok, chunk_size=chunk, boundary_window=0, kv_bits=bits, kv_group_size=group,
                       sink_tokens=0)
        rows = exact_prefix_rows(eng, ps)
        if not sum(r.reused_exact for r in rows):
            raise RuntimeError("no exact-prefix reuse happened: the ablation measured nothing")
        agree = [r.top1_agree for r in rows]
        return {"top1": round(statistics.fmean(agree), 4),
                "mean_kl": float(f"{statistics.fmean(r.kl for r in rows):.3e}"),
                "flips": int(len(agree) - sum(agree)), "near_ties": sum(r.ref_margin < NEAR_TIE for r in rows)}
    finally:
        engine_mod.maybe_quantize = maybe_quantize  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=240)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        sys.exit(f"{args.model} not found: this benchmark needs the trained stories260K model (--model DIR)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    ps = prompts(tok, args.prompts)
    t0 = time.time()
    # (name, bits, group, chunk, quantizer); None = the shipped path (native kernel when built)
    cases: list[tuple[str, int, int, int, Callable[..., Any] | None]] = [
        ("int8 group 32 (shipped default)", 8, 32, 16, None),
        ("int8 group 128, chunk 128", 8, 128, 128, None),
        ("int4 group 32 (shipped default)", 4, 32, 16, None),
        ("int4 group 128, chunk 128", 4, 128, 128, None),
        ("int4 post-RoPE keys", 4, 32, 16, fake_quantizer(True, True, pre_rope=False)),
        ("int4 K only (V exact)", 4, 32, 16, fake_quantizer(True, False, pre_rope=True)),
        ("int4 V only (K exact)", 4, 32, 16, fake_quantizer(False, True, pre_rope=True)),
        ("int4 group 8", 4, 8, 16, fake_quantizer(True, True, pre_rope=True)),
        ("int4 1% outliers kept exact", 4, 32, 16, fake_quantizer(True, True, pre_rope=True, outliers=0.01)),
    ]
    results: dict[str, Any] = {}
    for name, bits, group, chunk, q in cases:
        results[name] = run(model, tok, ps, bits, group, chunk, q)
        print(f"{name:34s} {results[name]}", flush=True)
    out = {"model": args.model.name, "prompts": len(ps), "near_tie_margin": NEAR_TIE,
           "head_dim": int(getattr(model.config, "head_dim", 0) or
                           model.config.hidden_size // model.config.num_attention_heads),
           "results": results, "runtime_s": round(time.time() - t0, 1)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

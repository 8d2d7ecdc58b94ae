"""Quantized KV on the real instruct model (SmolLM2-135M-Instruct, head_dim 64): exact-prefix fidelity.

A small slice of ``benchmarks/bench_quant_real.py`` (same prompt construction, first prompts only): prefixes of
the held-out RAG corpus are stored int8 / int4 and one token is prefilled on top; next-token logits against a
plain full prefill. Floors sit below the benchmark's 300-prompt figures (int8 100%, int4 94.7% top-1), int4's
at its own honest level: it misses issue 17's 97% goal, see the README.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvboost_core import zoo

MODEL = "smollm2-135m-instruct"
N_PROMPTS = 12

pytestmark = pytest.mark.skipif(not zoo.available(MODEL),
                                reason=f"{MODEL} is not installed ({zoo.SMOLLM2.install_hint})")


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quant_real.py"
    spec = importlib.util.spec_from_file_location("bench_quant_real", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.resolve(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    bench = _bench()
    ps = bench.probe_prompts(tok, N_PROMPTS)
    with torch.inference_mode():
        refs = [model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float().clone() for ids in ps]
    return bench, model, tok, ps, refs


@pytest.mark.parametrize("bits,min_top1,max_kl", [(8, 1.0, 1e-3), (4, 0.8, 0.05)])
def test_quantized_exact_prefix_on_the_real_model(setup, report, bits, min_top1, max_kl):
    bench, model, tok, ps, refs = setup
    r = bench.exact_prefix(model, tok, ps, refs, bits, 32)
    report.append(f"SmolLM2 int{bits} exact prefix ({len(ps)} prompts): top-1 {r['top1']:.1%}, mean KL "
                  f"{r['mean_kl']:.2e} (reused outside the sink chunk: {r['reused_outside_sink_chunk']:.0%})")
    assert r["reused_outside_sink_chunk"] > 0.5  # the quantized chunks carry most of the reuse
    assert r["top1"] >= min_top1 and r["mean_kl"] <= max_kl

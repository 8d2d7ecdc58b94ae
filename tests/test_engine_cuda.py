"""The engine on a CUDA device: every reuse path against a full prefill on the GPU, and against the same engine on
the CPU (same math, so the same logits up to float rounding). Skips without a GPU; CI has none, so these run on a
lent GPU machine (see benchmarks/gpu_session.sh)."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import compare_logits, docs_prompt, engine_for, full_logits

from kvboost_core import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [([CORPUS[4], CORPUS[2], CORPUS[1]], " Where was Alice born?"),
           ([CORPUS[1], CORPUS[6], CORPUS[0], CORPUS[2]], " What is the capital of Norland?")]


@pytest.fixture(scope="module")
def pair():
    """The same random-weight llama on the CPU and on the GPU (fp32 on both, so they are comparable)."""
    cpu = make_tiny_model("llama")
    gpu = make_tiny_model("llama").to("cuda")
    return cpu, gpu


def _logits(model, tokenizer, repair: str, **kw) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """Per prompt: (reference full-prefill logits, engine logits, stats), all on the CPU."""
    eng = engine_for(model, tokenizer, **kw)
    eng.warm(CORPUS[:7])
    rows = []
    for docs, question in PROMPTS:
        prompt = docs_prompt(docs, question)
        res = eng.prefill(prompt, repair=repair, store_prefix=False)
        assert res.last_logits.device.type == model.device.type
        ref = full_logits(model, res.token_ids)
        rows.append((ref.cpu(), res.last_logits.float().cpu(), res.stats))
    return rows


@pytest.mark.parametrize("repair", ["full", "none", "selective", "cacheblend"])
def test_cuda_engine_equals_cpu_engine(pair, tokenizer, repair):
    cpu, gpu = pair
    for (ref_c, got_c, st_c), (ref_g, got_g, st_g) in zip(_logits(cpu, tokenizer, repair),
                                                          _logits(gpu, tokenizer, repair)):
        assert st_c["reused_exact"] + st_c["reused_approx"] == st_g["reused_exact"] + st_g["reused_approx"]
        if repair != "full":
            assert st_g["reused_approx"] > 0  # documents were re-placed (re-rotated), not recomputed
        # same token selection and same math on both devices: the logits agree to float rounding
        assert (got_c - got_g).abs().max().item() < 2e-3, repair
        # and each device's engine stands in the same relation to its own full prefill
        gpu_cmp, cpu_cmp = compare_logits(ref_g, got_g), compare_logits(ref_c, got_c)
        assert gpu_cmp["top1_agree"] == cpu_cmp["top1_agree"]
        assert abs(gpu_cmp["kl"] - cpu_cmp["kl"]) < 1e-3 + 0.05 * cpu_cmp["kl"]
        if repair == "full":
            assert gpu_cmp["max_abs_diff"] < 1e-3


@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_engine_quantized_store_equals_cpu(pair, tokenizer, bits):
    cpu, gpu = pair
    for (_, got_c, _), (ref_g, got_g, st_g) in zip(_logits(cpu, tokenizer, "cacheblend", kv_bits=bits),
                                                   _logits(gpu, tokenizer, "cacheblend", kv_bits=bits)):
        assert st_g["reused_approx"] > 0
        assert (got_c - got_g).abs().max().item() < 5e-3, bits
        assert compare_logits(ref_g, got_g)["kl"] < 0.05


@pytest.mark.parametrize("repair", ["full", "cacheblend", "none"])
def test_cuda_engine_bf16_tracks_the_fp32_engine(pair, tokenizer, repair):
    """In bf16 (the GPU default) each path stands as far from its own full prefill as in fp32 on the CPU: bf16
    adds rounding, not a reuse error."""
    cpu, _ = pair
    bf16 = make_tiny_model("llama").to("cuda", torch.bfloat16)
    for (ref_c, got_c, _), (ref_g, got_g, st_g) in zip(_logits(cpu, tokenizer, repair),
                                                       _logits(bf16, tokenizer, repair)):
        if repair != "full":
            assert st_g["reused_approx"] > 0
        kl_c, kl_g = compare_logits(ref_c, got_c)["kl"], compare_logits(ref_g, got_g)["kl"]
        assert abs(kl_g - kl_c) < 2e-3 + 0.1 * kl_c, (repair, kl_g, kl_c)
        assert compare_logits(ref_c, got_g)["top1_agree"] == 1.0


def test_cuda_generate_streams_the_full_prefill_greedy_answer(pair, tokenizer):
    _, gpu = pair
    eng = engine_for(gpu, tokenizer)
    eng.warm(CORPUS[:7])
    docs, question = PROMPTS[0]
    got = eng.generate(docs_prompt(docs, question), max_new_tokens=12, repair="full")
    ids = torch.tensor([got.prompt_token_ids], device="cuda")
    with torch.inference_mode():
        want = gpu.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=2)[0, ids.shape[1]:].tolist()
    assert got.token_ids == want[: len(got.token_ids)] and len(got.token_ids) > 0
    assert got.ttft_s > 0


def test_backend_reports_cuda_kernels_when_built():
    if kernels.has_cuda_ext():
        assert kernels.backend() == "cuda-ext+cpu-ext"
    else:
        pytest.skip(f"CUDA kernels not built ({kernels.load_error()})")

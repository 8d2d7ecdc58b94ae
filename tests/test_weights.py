"""Weight precision (kvboost_core.model.weights, issue #35): the packed fp16 linear equals a dequantize-then-matmul
reference, a row's result does not depend on the rows beside it, the engine keys its KV by precision, batched
decode stays bitwise deterministic at fp16, and bad or impossible requests get a clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, make_tiny_model
from helpers import engine_for, full_logits
from test_invariant import _steps

from kvboost_core import Segment
from kvboost_core.config import EngineConfig
from kvboost_core.engine import KVEngine
from kvboost_core.model.weights import PackedLinear, fingerprint, pack, precision

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                reason="torch without FBGEMM")


def test_packed_linear_equals_the_fp16_weights_in_fp32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=True)
    packed = PackedLinear(lin)
    x = torch.randn(3, 5, 96)
    ref = torch.nn.functional.linear(x, lin.weight.detach().half().float(), lin.bias.detach())
    got = packed(x)
    assert got.shape == (3, 5, 200) and got.dtype == torch.float32
    # fp32 accumulation in another order: a few ulps of the outputs' size
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(packed.weight_fp32(), lin.weight.detach().half().float())
    # rounding the weights is the only change: against the fp32 weights the error is of fp16's size
    assert (got - lin(x)).abs().max() > 0


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(576, 1536, bias=False))
    x = torch.randn(33, 576)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(33)])
    for n in (2, 3, 7, 8, 9, 16, 17, 33):
        assert torch.equal(packed(x[:n]), alone[:n]), n


def test_packing_keeps_the_model_and_keys_the_kv_by_precision(tokenizer):
    model = make_tiny_model("llama")
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    e32 = engine_for(make_tiny_model("llama"), tokenizer)
    e16 = engine_for(model, tokenizer, weights="fp16")
    assert precision(model) == "fp16" and precision(e32.model) == "fp32"
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert (after - before).abs().max() < 1e-2 * before.abs().max()  # fp16-rounded weights, the same model
    assert e16.base_fingerprint == e32.base_fingerprint  # adapters of the fp32 base still load
    assert e16.fingerprint != e32.fingerprint == fingerprint(e32.fingerprint, "fp32")
    assert e16.fingerprint == fingerprint(e32.fingerprint, "fp16")


def test_exact_reuse_at_fp16_is_checked_against_the_fp16_full_prefill(tokenizer):
    """Stats call KV exact only against the same-precision reference: the fp16 model's own full prefill."""
    model = make_tiny_model("llama")
    eng = engine_for(model, tokenizer, weights="fp16", repair="none")
    docs = [CORPUS[1], CORPUS[2]]
    prompt = "\n".join(docs) + " Who was there?"
    eng.generate(prompt, max_new_tokens=2)  # stores the prompt's chunks
    again = eng.generate(prompt, max_new_tokens=2)
    assert again.stats["reused_exact"] > 0 and again.stats["reused_approx"] == 0
    ref = full_logits(model, again.prompt_token_ids)  # plain HF on the packed (fp16) model
    assert (again.first_logits - ref).abs().max() < 1e-4
    ref32 = full_logits(make_tiny_model("llama"), again.prompt_token_ids)
    assert (again.first_logits - ref32).abs().max() > 1e-4  # a different-precision result is not "exact"


def test_batched_decode_is_bitwise_deterministic_at_fp16(tokenizer):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_tiny_model("llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3)
        engine = KVEngine(model, tokenizer, weights="fp16")
        prompts = [[Segment(text=" ".join(CORPUS[i:i + 1 + i % 3]))] for i in range(5)]
        alone = _steps(engine, prompts[:1])[0]
        batch = _steps(engine, prompts)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(alone, batch[0]))


def test_bad_or_impossible_precisions_are_refused(tokenizer):
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int3")
    with pytest.raises(TypeError, match="weights must be one of"):
        EngineConfig(weights=16)
    model = make_tiny_model("llama")
    pack(model, "fp16")
    with pytest.raises(ValueError, match="already packed"):
        engine_for(model, tokenizer)  # weights="fp32" on a packed model: not silently the fp16 one
    half = make_tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 model on the CPU"):
        pack(half, "fp16")
    with pytest.raises(RuntimeError, match="no gradient"):
        PackedLinear(torch.nn.Linear(4, 4))(torch.randn(1, 4, requires_grad=True))


def test_a_block_adapter_merges_before_packing(tokenizer, tmp_path):
    """The adapter's delta is in the packed weights (merged into fp32, then rounded once); the base model inside
    the block is refused rather than silently run on the adapted weights."""
    from kvboost_core.lora.block_adapter import TARGETS, BlockMeta, LoraHeader, save, target_linears

    base = engine_for(make_tiny_model("llama"), tokenizer)
    linears = target_linears(base.model, TARGETS)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, lin in linears.items():
        tensors[f"{name}.lora_a"] = torch.randn(2, lin.in_features, generator=gen) * 0.1
        tensors[f"{name}.lora_b"] = torch.randn(lin.out_features, 2, generator=gen) * 0.1
    save(str(tmp_path), tensors, BlockMeta(LoraHeader(2, 4.0, TARGETS, str(base.fingerprint)),
                                           tuple(base._warm_prefix), base.config.sink_tokens))
    model = make_tiny_model("llama")
    name, lin = next(iter(target_linears(model, TARGETS).items()))
    a, b = tensors[f"{name}.lora_a"].half().float(), tensors[f"{name}.lora_b"].half().float()
    merged = (lin.weight.detach() + (b @ a) * 2.0).half().float()
    eng = engine_for(model, tokenizer, block_adapter=str(tmp_path), weights="fp16")
    packed = dict(model.model.named_modules())[name]
    assert isinstance(packed, PackedLinear) and torch.equal(packed.weight_fp32(), merged)
    with pytest.raises(ValueError, match="weights='fp32'"), eng.block.base_weights():
        pass

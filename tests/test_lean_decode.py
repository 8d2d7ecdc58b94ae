"""The lean decode step (kvboost_core.model.lean) is the planned forward's decode step to the last bit, and is
used only where it is.

Each check decodes the same tokens through both paths from the same prefilled cache and compares logits and
written K/V with ``torch.equal``; ``generate`` is compared with the lean step switched off."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from kvboost_core import KVEngine, kernels
from kvboost_core.engine import generation
from kvboost_core.kernels import ops
from kvboost_core.model import lean as lean_mod
from kvboost_core.model.driver import ModelDriver, ScatterCache
from kvboost_core.model.forward import Schedule, decode_step, run_forward
from kvboost_core.model.lean import lean_decoder
from kvboost_core.model.weights import pack


def _prefilled(driver: ModelDriver, ids: torch.Tensor, n: int) -> ScatterCache:
    cfg = driver.model.config
    kv, hd = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cap = ids.numel()
    cache = ScatterCache([torch.zeros(1, kv, cap, hd) for _ in range(driver.num_layers)],
                         [torch.zeros(1, kv, cap, hd) for _ in range(driver.num_layers)])
    pos = torch.arange(n)
    run_forward(driver, ids, cache, Schedule(base=pos, candidates=pos[:0]), n)
    return cache


def _varied(model):
    """Random RMSNorm weights: at their init of 1.0 a reordered norm would round the same and go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def _both_paths(model, steps: int = 6, prompt: int = 40, seed: int = 0) -> None:
    driver = ModelDriver.for_model(model)
    lean = lean_decoder(driver)
    assert lean is not None, lean_mod._why_not(driver)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (prompt + steps,), generator=torch.Generator().manual_seed(seed))
    planned, fast = _prefilled(driver, ids, prompt), _prefilled(driver, ids, prompt)
    for p in range(prompt, prompt + steps):
        a = decode_step(driver, ids, p, planned)
        b = lean.step(ids[p:p + 1], p, fast)
        assert torch.equal(a, b), f"step {p}: logits differ by {float((a - b).abs().max()):.3g}"
    for layer in range(driver.num_layers):
        assert torch.equal(planned.keys[layer], fast.keys[layer])
        assert torch.equal(planned.values[layer], fast.values[layer])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_lean_step_is_the_planned_forwards_decode_step_bitwise(arch):
    _both_paths(_varied(make_tiny_model(arch)))


def test_without_gqa_and_with_biases():
    _both_paths(_varied(make_tiny_model("llama", num_key_value_heads=4, attention_bias=True, mlp_bias=True)))


def test_at_fp16_packed_weights():
    _both_paths(pack(_varied(make_tiny_model("llama")), "fp16"))


def test_on_the_trained_stories_model(stories):
    model, _ = stories
    _both_paths(model, steps=8, prompt=100)


@pytest.mark.skipif(not kernels.has_ext(), reason="kvboost_core._C not built")
@pytest.mark.parametrize("which", ["tiny", "stories"])
def test_with_the_native_attention_within_float_noise_and_the_same_greedy_tokens(which, request):
    """The engine's default on the CPU: the native decode attention (not SDPA's bits). Logits stay within 2e-5
    of the planned forward's over 12 steps of a greedy continuation, and the greedy tokens are the same."""
    model = _varied(make_tiny_model("llama")) if which == "tiny" else request.getfixturevalue("stories")[0]
    driver = ModelDriver.for_model(model)
    fast = lean_decoder(driver, attend=ops.decode_attention)
    assert fast is not None and ops.decode_kernel(driver.device)
    prompt, steps = 60, 12
    ids = torch.randint(3, model.config.vocab_size, (prompt + steps,), generator=torch.Generator().manual_seed(1))
    a_ids, b_ids = ids.clone(), ids.clone()
    planned, native = _prefilled(driver, ids, prompt), _prefilled(driver, ids, prompt)
    for p in range(prompt, prompt + steps):
        a = decode_step(driver, a_ids, p, planned)
        b = fast.step(b_ids[p:p + 1], p, native)
        assert float((a - b).abs().max()) <= 2e-5 * max(1.0, float(a.abs().max()))
        assert int(a.argmax()) == int(b.argmax())
        if p + 1 < prompt + steps:
            a_ids[p + 1] = b_ids[p + 1] = int(a.argmax())


@pytest.mark.parametrize("arch,overrides,why", [
    ("gemma", {}, "model_type"),
    ("qwen3", {}, "model_type"),
    ("phi3", {}, "model_type"),
    ("mistral", {"sliding_window": 16}, "sliding-window"),
])
def test_models_it_would_not_reproduce_keep_the_planned_forward(arch, overrides, why):
    driver = ModelDriver.for_model(make_tiny_model(arch, **overrides))
    assert lean_decoder(driver) is None
    assert why in lean_mod._why_not(driver)


def test_eager_attention_keeps_the_planned_forward():
    model = make_tiny_model("llama")
    model.config._attn_implementation = "eager"
    assert "attention implementation" in lean_mod._why_not(ModelDriver.for_model(model))


def test_a_reader_adapter_keeps_the_planned_forward():
    driver = ModelDriver.for_model(make_tiny_model("llama"))
    driver.reader = object()  # any attached reader gates rows the lean step would not
    assert "reader" in lean_mod._why_not(driver)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 7)])
def test_generate_gives_the_same_tokens_and_text_with_and_without_it(tokenizer, monkeypatch, temperature, seed):
    engine = KVEngine(make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer)
    assert lean_decoder(engine.driver) is not None
    used = []
    real = lean_mod.LeanDecoder.step

    def counted(self, *args):
        used.append(1)
        return real(self, *args)

    monkeypatch.setattr(lean_mod.LeanDecoder, "step", counted)
    prompt = "Once upon a time a small bird sang in a tall tree, and"
    kw = dict(max_new_tokens=12, temperature=temperature, seed=seed, store_prefix=False)
    with_lean = engine.generate(prompt, **kw)
    assert used, "generate did not decode through the lean step"
    monkeypatch.setattr(generation, "lean_decoder", lambda driver, **kw: None)
    without = engine.generate(prompt, **kw)
    assert with_lean.token_ids == without.token_ids and with_lean.text == without.text


def _rows_logits(model, lengths, keep: int, attend_native: bool):
    """Row ``keep``'s logits over 3 steps, the rows of ``lengths`` prefilled with random K/V."""
    from kvboost_core.serving.batch import BatchedDecoder

    driver = ModelDriver.for_model(model)
    dec = BatchedDecoder(driver, 4)
    assert dec._lean is not None
    if not attend_native:
        dec._lean = lean_decoder(driver)
    cfg = model.config
    slots = []
    for n in lengths:  # every request's own prefix: the same seed per length, whatever the batch
        gr = torch.Generator().manual_seed(n)
        kv = [torch.randn(1, cfg.num_key_value_heads, n, cfg.head_dim, generator=gr)
              for _ in range(2 * driver.num_layers)]
        slots.append(dec.add(kv[::2], kv[1::2], n, n + 8))
    out = []
    for step in range(3):
        logits = dec.step({s: 3 + (s.capacity + step) % 50 for s in slots})
        out.append(logits[slots[keep]])
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_the_batched_lean_step_gives_a_row_the_same_bits_alone_and_beside_others(native, weights):
    if native and not kernels.has_ext():
        pytest.skip("kvboost_core._C not built")
    model = _varied(make_tiny_model("llama"))
    if weights == "fp16":
        pack(model, "fp16")
    alone = _rows_logits(model, [37], 0, native)
    among = _rows_logits(model, [12, 37, 70], 1, native)
    assert all(torch.equal(a, b) for a, b in zip(alone, among))


def test_the_batched_decoder_keeps_hfs_layers_for_models_lean_does_not_serve():
    from kvboost_core.serving.batch import BatchedDecoder

    assert BatchedDecoder(ModelDriver.for_model(make_tiny_model("mistral", sliding_window=16)), 2)._lean is None

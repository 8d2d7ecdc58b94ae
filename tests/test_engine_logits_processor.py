"""KVEngine's logits_processor hook: applied before every sampled token (the prefill's and each decode
step's), StopGeneration ends the generation, bad arguments are refused, and reuse stats stay those of a plain
call."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS
from helpers import docs_prompt, engine_for

from kvboost_core.decode import StopGeneration


@pytest.fixture(scope="module")
def eng(tiny_llama, tokenizer):
    return engine_for(tiny_llama, tokenizer)


def forcing(sequence: list[int], calls: list[list[int]]):
    """A processor that allows only ``sequence[len(generated)]`` and records what it was called with."""
    def processor(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        assert logits.dim() == 1 and logits.dtype == torch.float32
        calls.append(list(generated))
        allowed = logits.new_full(logits.shape, float("-inf"))
        allowed[sequence[len(generated)]] = 0.0
        return allowed
    return processor


def test_applied_before_first_and_every_decode_token(eng):
    plain = eng.generate("The quick brown fox", max_new_tokens=5, store_prefix=False)
    # ids the tiny model is unlikely to pick on its own, and none of them EOS (1)
    sequence = [t for t in (37, 120, 211, 305, 42) if t not in plain.token_ids[:1]]
    calls: list[list[int]] = []
    res = eng.generate("The quick brown fox", max_new_tokens=len(sequence), store_prefix=False,
                       logits_processor=forcing(sequence, calls))
    assert res.token_ids == sequence
    assert calls == [sequence[:i] for i in range(len(sequence))]  # once per token, the first one included
    assert res.finish_reason == "length"
    # masking must not leak into the result's prefill logits (they are the model's own)
    assert torch.equal(res.first_logits, plain.first_logits)


def test_in_place_masking_of_inference_tensors(eng):
    def only_42(generated, logits):
        logits.fill_(float("-inf"))  # in place, on the engine's (inference-mode) logits
        logits[42] = 0.0
        return logits

    res = eng.generate("Bob repairs bicycles", max_new_tokens=4, store_prefix=False, logits_processor=only_42)
    assert res.token_ids == [42] * 4


def test_stop_generation_ends_it(eng):
    def stop_after_three(generated, logits):
        if len(generated) == 3:
            raise StopGeneration
        return logits

    res = eng.generate("Rivers flow to the sea", max_new_tokens=10, store_prefix=False,
                       logits_processor=stop_after_three)
    plain = eng.generate("Rivers flow to the sea", max_new_tokens=3, store_prefix=False)
    assert res.finish_reason == "stop" and res.token_ids == plain.token_ids and res.text == plain.text

    def stop_now(generated, logits):
        raise StopGeneration

    empty = eng.generate("Rivers flow to the sea", max_new_tokens=10, store_prefix=False,
                         logits_processor=stop_now)
    assert empty.token_ids == [] and empty.text == "" and empty.finish_reason == "stop"


def test_stream_takes_it_too(eng):
    calls: list[list[int]] = []
    stream = eng.stream("The capital of Norland", max_new_tokens=3, store_prefix=False,
                        logits_processor=forcing([50, 60, 70], calls))
    text = "".join(stream)
    assert stream.result is not None and stream.result.token_ids == [50, 60, 70]
    assert text == stream.result.text and len(calls) == 3


@pytest.mark.parametrize("bad", [42, "mask", [lambda g, x: x]])
def test_not_callable_is_a_type_error(eng, bad):
    with pytest.raises(TypeError, match="logits_processor"):
        eng.generate("hi", max_new_tokens=2, logits_processor=bad)
    with pytest.raises(TypeError, match="logits_processor"):
        eng.stream("hi", max_new_tokens=2, logits_processor=bad)


def test_returning_no_tensor_is_a_type_error(eng):
    with pytest.raises(TypeError, match="logits_processor must return"):
        eng.generate("hi", max_new_tokens=2, logits_processor=lambda generated, logits: None)


def test_reuse_stats_are_those_of_a_plain_call(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer)
    eng.warm(CORPUS[:3])
    prompt = docs_prompt(CORPUS[:3], " Question: who?")
    plain = eng.generate(prompt, max_new_tokens=3, store_prefix=False)
    hooked = eng.generate(prompt, max_new_tokens=3, store_prefix=False, logits_processor=lambda g, x: x)
    assert plain.reuse_ratio > 0
    assert hooked.reuse_ratio == plain.reuse_ratio and hooked.token_ids == plain.token_ids
    for key in ("reused_exact", "reused_approx", "recomputed", "computed", "hits_content"):
        assert hooked.stats[key] == plain.stats[key], key

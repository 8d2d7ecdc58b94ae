"""Sampling at the edges: tiny temperatures and top_p, NaN and fully masked logits, wrong-shaped processor output."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import engine_for

from kvboost_core.decode import BadLogits, SamplingParams, process_and_sample, sample


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(50, generator=g) * 3  # (V,)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-8])
def test_tiny_temperature_is_greedy(temperature):
    logits = _logits()
    params = SamplingParams.create(temperature=temperature, seed=1)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert sample(logits, params, g) == int(torch.argmax(logits))


def test_huge_temperature_samples_without_error():
    params = SamplingParams.create(temperature=1e300)
    got = {sample(_logits(), params, torch.Generator().manual_seed(s)) for s in range(30)}
    assert len(got) > 5  # close to uniform: many different tokens


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-10])
def test_tiny_top_p_keeps_the_top_token(top_p):
    logits = _logits()
    params = SamplingParams.create(temperature=1.0, top_p=top_p)
    for seed in range(5):
        assert sample(logits, params, torch.Generator().manual_seed(seed)) == int(torch.argmax(logits))


def test_top_p_still_samples_from_the_nucleus():
    logits = torch.tensor([2.0, 2.0, -10.0, -10.0])
    params = SamplingParams.create(temperature=1.0, top_p=0.9)
    got = {sample(logits, params, torch.Generator().manual_seed(s)) for s in range(40)}
    assert got == {0, 1}


def test_forced_tokens_at_plus_inf():
    logits = _logits()
    logits[7] = math.inf
    assert sample(logits, SamplingParams.create(temperature=0.7), torch.Generator().manual_seed(0)) == 7
    assert sample(logits, SamplingParams.create(), None) == 7


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_raise(temperature):
    logits = _logits()
    logits[3] = math.nan
    with pytest.raises(BadLogits, match="the model produced NaN logits"):
        sample(logits, SamplingParams.create(temperature=temperature), None)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_all_masked_logits_raise(temperature):
    logits = torch.full((50,), -math.inf)
    with pytest.raises(BadLogits, match="every token is masked"):
        sample(logits, SamplingParams.create(temperature=temperature), None)


def test_processor_that_masks_everything_is_named():
    def mask_all(ids, logits):
        return logits.fill_(-math.inf)

    with pytest.raises(BadLogits, match="every token is masked.*logits_processor"):
        process_and_sample(mask_all, [], _logits(), SamplingParams.create(temperature=0.5), None)


@pytest.mark.parametrize("width", [55, 45])
def test_processor_of_the_wrong_width_is_a_value_error(width):
    def wrong(ids, logits):
        return torch.zeros(width)

    with pytest.raises(ValueError, match=r"logits_processor must return logits of shape \(50,\)"):
        process_and_sample(wrong, [], _logits(), SamplingParams.create(), None)


def test_processor_wider_than_the_vocabulary_through_the_engine(tiny_llama, tokenizer):
    """The audit's case: before, the extra column was sampled and the engine failed with an IndexError."""
    eng = engine_for(tiny_llama, tokenizer)

    def wider(ids, logits):
        out = torch.full((logits.shape[0] + 8,), -math.inf)
        out[-1] = 0.0  # the only allowed token lies past the vocabulary
        return out

    with pytest.raises(ValueError, match="logits_processor"):
        eng.generate("Alice was born in", max_new_tokens=3, logits_processor=wider)


def test_engine_generation_with_tiny_temperature_matches_greedy(tiny_llama, tokenizer):
    eng = engine_for(tiny_llama, tokenizer)
    greedy = eng.generate("Alice was born in", max_new_tokens=6)
    tiny = eng.generate("Alice was born in", max_new_tokens=6, temperature=1e-40, top_p=1e-300, seed=3)
    assert tiny.token_ids == greedy.token_ids

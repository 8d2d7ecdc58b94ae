"""The model fingerprint covers every weight byte: a change the old 4,096-value sample skipped still changes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import xxhash

from kvboost_core.keys import model_fingerprint
from kvboost_rag.tiny import tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer(layers=2, seed=3)


def _old_sample_digest(t: torch.Tensor) -> str:
    """What the previous fingerprint read of a tensor: a strided sample of at most 4,096 values."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // 4096)
    return xxhash.xxh3_128(flat[::step][:4096].float().numpy().tobytes()).hexdigest()


def test_stable_for_the_same_weights(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    twin, _ = tiny_model_and_tokenizer(layers=2, seed=3)
    assert model_fingerprint(model, tok) == model_fingerprint(twin, tok)
    other, _ = tiny_model_and_tokenizer(layers=2, seed=4)
    assert model_fingerprint(model, tok) != model_fingerprint(other, tok)


def test_unsampled_weight_change_changes_it(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    before = model_fingerprint(model, tok)
    name, p = max(model.named_parameters(), key=lambda np_: np_[1].numel())
    n = p.numel()
    step = max(1, n // 4096)
    assert step > 1, f"{name} is too small for a value outside the old sample"
    idx = n - 1 if (n - 1) % step or (n - 1) // step >= 4096 else 1  # never read by the old sample
    old = _old_sample_digest(p)
    with torch.no_grad():
        p.view(-1)[idx] += 0.5
    try:
        assert _old_sample_digest(p) == old  # the old fingerprint could not have seen this change
        assert model_fingerprint(model, tok) != before
    finally:
        with torch.no_grad():
            p.view(-1)[idx] -= 0.5


def test_buffer_and_dtype_changes_change_it(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    before = model_fingerprint(model, tok)
    name, buf = next((n, b) for n, b in model.named_buffers() if b.numel() > 1 and b.is_floating_point())
    saved = buf.clone()
    with torch.no_grad():
        buf.view(-1)[-1] += 1.0
    try:
        assert model_fingerprint(model, tok) != before, name
    finally:
        with torch.no_grad():
            buf.copy_(saved)
    assert model_fingerprint(model, tok) == before
    half, _ = tiny_model_and_tokenizer(layers=2, seed=3)
    assert model_fingerprint(half.bfloat16(), tok) != before

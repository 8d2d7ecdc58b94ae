"""Constrained JSON closes before the token budget runs out (kvboost_rag.constrained.JsonConstraint(budget=)):
a random-weight model, which left alone writes string content until the budget ends, still returns JSON that
parses into the schema, and the tokens the closing chose are counted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag import KVBoostRAG  # noqa: E402
from kvboost_rag.constrained import JsonConstraint, generate_json  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"setup": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "punchline": {"type": "string"}},
          "required": ["setup", "n", "tags", "punchline"]}


@pytest.fixture(scope="module")
def rag():
    return KVBoostRAG(KVEngine(*tiny_model_and_tokenizer()))


@pytest.mark.parametrize("budget", [64, 96])  # this char-level tokenizer needs 42 tokens for the smallest value
def test_json_is_closed_within_the_budget(rag, budget):
    for seed in range(2):
        res = generate_json(rag, "Write JSON:", SCHEMA, max_new_tokens=budget, temperature=1.0, seed=seed)
        value = json.loads(res.text)  # parses: closed in time
        assert set(value) == set(SCHEMA["properties"]) and isinstance(value["n"], int)
        assert res.finish_reason == "stop" and len(res.token_ids) <= budget
        assert res.stats["closing_forced"] > 0  # the closing did it (the model left alone does not, below)
    free = JsonConstraint(rag.tokenizer, len(rag.tokenizer), SCHEMA)  # no budget: the old behaviour
    res = rag.generate("Write JSON:", max_new_tokens=40, temperature=1.0, seed=0, logits_processor=free)
    assert res.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(res.text)


def test_budget_must_be_positive(rag):
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="budget"):
            JsonConstraint(rag.tokenizer, len(rag.tokenizer), SCHEMA, budget=bad)  # type: ignore[arg-type]

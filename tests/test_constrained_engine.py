"""Constrained JSON decoding runs through KVEngine: a structured call over warmed documents reuses their KV,
and with repair="full" its tokens equal those of a plain HF full prefill decoded with the same grammar masks."""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("llguidance")

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_core.model.driver import output_cache  # noqa: E402
from kvboost_rag import KVBoostRAG  # noqa: E402
from kvboost_rag.constrained import JsonConstraint, generate_json  # noqa: E402
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer  # noqa: E402

DOCS = synthetic_facts(12)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "city": {"enum": ["Portvale", "Essberg", "Lindmoor"]},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
    "required": ["name", "city", "year", "hobbies"]}
# no free text: a random model completes it well within the budget (the StopGeneration path)
CLOSED = {"type": "object", "properties": {
    "name": {"enum": ["Alice", "Dana", "Jun"]}, "pilot": {"type": "boolean"},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "rowing"]}, "maxItems": 3}},
    "required": ["name", "pilot", "hobbies"]}


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model_and_tokenizer(layers=2)


def _rag(**config) -> KVBoostRAG:
    model, tok = _model()
    rag = KVBoostRAG(KVEngine(model, tok, **config))
    rag.warm_documents(DOCS, show_progress=False)
    return rag


def _prompt(i: int) -> str:
    docs = [DOCS[i % 12], DOCS[(i + 5) % 12], DOCS[(i + 9) % 12]]
    return ("Use the documents to answer.\n\n" + "\n\n".join(docs)
            + f"\n\nQuestion: describe person {i} as JSON.\nAnswer:")


@torch.inference_mode()
def _hf_constrained(ids: list[int], schema: dict, max_new_tokens: int) -> list[int]:
    """The reference: a plain HF full prefill of ``ids``, then HF-cache decoding, greedy, each step's logits
    masked by a fresh JsonConstraint called as the engine calls its logits processor (budget-aware)."""
    from kvboost_core.decode import StopGeneration

    model, tok = _model()
    constraint = JsonConstraint(tok, int(model.config.vocab_size), schema, budget=max_new_tokens)
    eos = {tok.eos_token_id}
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache, logits = output_cache(out), out.logits[0, -1].float()
    generated: list[int] = []
    for _ in range(max_new_tokens):
        try:
            token = int(torch.argmax(constraint(generated, logits)))
        except StopGeneration:
            break
        generated.append(token)  # the engine keeps the EOS it stopped on; so does this reference
        if token in eos:
            break
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, logits = output_cache(out), out.logits[0, -1].float()
    return generated


def test_structured_call_reuses_warmed_documents():
    rag = _rag()  # the default repair
    res = generate_json(rag, _prompt(1), SCHEMA, max_new_tokens=96)
    assert res.stats["constrained"] is True and res.stats["mask_s"] > 0
    assert res.stats["documents"] == 3 and res.reuse_ratio > 0 and res.stats["doc_tokens_reused"] > 0
    assert rag.last_stats["reuse_ratio"] == res.reuse_ratio  # recorded like a plain call
    if res.finish_reason == "stop":  # the grammar completed: the JSON parses into the schema
        value = json.loads(res.text)
        assert set(value) == set(SCHEMA["properties"]) and value["city"] in SCHEMA["properties"]["city"]["enum"]


@pytest.mark.parametrize("schema,i", [(SCHEMA, 0), (SCHEMA, 1), (CLOSED, 2), (CLOSED, 3)])
def test_full_repair_equals_hf_full_prefill_with_the_same_masks(schema, i):
    rag = _rag(repair="full")
    res = generate_json(rag, _prompt(i), schema, max_new_tokens=96)
    # the documents were found in the cache and placed, then recomputed in full (so no reuse is reported)
    assert res.stats["documents"] == 3 and res.stats["hits_content"] > 0 and res.reuse_ratio == 0
    ref = _hf_constrained(res.prompt_token_ids, schema, 96)
    assert res.token_ids == ref
    if schema is CLOSED:
        assert res.finish_reason == "stop" and set(json.loads(res.text)) == set(CLOSED["properties"])

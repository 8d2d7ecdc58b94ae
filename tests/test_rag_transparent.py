"""Transparent mode end to end on a tiny random Llama: zero prompt drift, reuse, and clean fallbacks."""

from __future__ import annotations

import functools

import pytest
import torch

from kvboost_core.engine import KVEngine
from kvboost_rag import KVBoostRAG
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer

N_NEW = 8
SYSTEM = ("System: Use the following pieces of retrieved context to answer the question. If you do not know "
          "the answer, say that you do not know.\n\n")
DOCS = synthetic_facts(20)


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model_and_tokenizer(layers=2)


def _rag(**config) -> KVBoostRAG:
    model, tok = _model()
    rag = KVBoostRAG(KVEngine(model, tok, **config))
    rag.warm_documents(DOCS, progress=False)
    return rag


def _prompt(parts: list[str], question: str = "Where does Dana live?") -> str:
    return SYSTEM + "\n\n".join(parts) + f"\n\nQuestion: {question}\nAnswer:"


def _hf_greedy(prompt: str) -> list[int]:
    """The reference: plain HF generate on tokenizer(prompt), greedy."""
    model, tok = _model()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _same_answer(ours: list[int], ref: list[int]) -> bool:
    # HF keeps the EOS it stopped on; so does the engine. Compare the generated ids.
    return ours == ref


def test_zero_drift_and_hf_pipeline_equality() -> None:
    pytest.importorskip("langchain_huggingface")
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    model, tok = _model()
    rag = _rag(repair="full")
    prompt = _prompt([DOCS[3], DOCS[7], DOCS[12]])
    result = rag.generate(prompt, max_new_tokens=N_NEW)
    assert result.prompt_token_ids == tok(prompt).input_ids  # the model saw exactly the plain ids
    stats = rag.last_stats
    assert stats["mode"] == "transparent" and stats["documents"] == 3
    assert stats["doc_tokens_reused"] >= 0.9 * stats["doc_tokens"]  # found and served from the cache
    hf = HuggingFacePipeline(pipeline=pipeline("text-generation", model=model, tokenizer=tok,
                                               max_new_tokens=N_NEW, do_sample=False, return_full_text=False))
    assert result.text == hf.invoke(prompt)
    assert _same_answer(result.token_ids, _hf_greedy(prompt))


def test_second_prompt_reuses_documents_in_another_order() -> None:
    rag = _rag()  # default CacheBlend repair
    rag.generate(_prompt([DOCS[3], DOCS[7], DOCS[12]]), max_new_tokens=2)
    prompt = _prompt([DOCS[12], DOCS[3], DOCS[5]], "Who is a pilot?")
    result = rag.generate(prompt, max_new_tokens=2)
    s = rag.last_stats
    assert result.prompt_token_ids == _model()[1](prompt).input_ids
    assert s["documents"] == 3
    assert s["doc_tokens_reused"] / s["doc_tokens"] >= 0.9
    # CacheBlend recomputes ~recompute_ratio (0.15) of the re-placed tokens; the rest is used as is.
    assert s["doc_tokens_kept"] / s["doc_tokens"] >= 0.8
    assert s["hits_exact"] > 0  # the shared system prompt came from the prefix chain


def _fallback_prompts() -> dict[str, tuple[list[str], str]]:
    multiline = [d.replace(". ", ".\n", 1) for d in DOCS[:4]]  # repr() escapes the newline: text mangled
    return {
        "not_warmed": ([], _prompt(["Fact 99: Zoe lives in Nowhere and works as a clown. She was born in 1999.",
                                    DOCS[2][:-1] + "!"])),
        "list_repr": (multiline, SYSTEM + str(multiline) + "\nQuestion: who?\nAnswer:"),
        "overflow": ([], _prompt([DOCS[4][: len(DOCS[4]) // 2], DOCS[6][len(DOCS[6]) // 2:]])),
    }


@pytest.mark.parametrize("case", ["not_warmed", "list_repr", "overflow"])
def test_fallbacks_prefill_normally(case: str) -> None:
    warm, prompt = _fallback_prompts()[case]
    rag = _rag()
    if warm:
        rag.warm_documents(warm, progress=False)
    result = rag.generate(prompt, max_new_tokens=N_NEW)
    s = rag.last_stats
    assert result.prompt_token_ids == _model()[1](prompt).input_ids
    assert s["documents"] == 0 and s["doc_tokens"] == 0 and s["reused_approx"] == 0
    assert _same_answer(result.token_ids, _hf_greedy(prompt))  # nothing re-placed: identical to full prefill


def test_edge_tokens_merged_with_separators() -> None:
    """A space before a document merges into its first token (byte-level BPE): that token is computed,
    the rest of the document still reuses, and the ids stay the plain ones."""
    rag = _rag(repair="full")
    prompt = SYSTEM + "Context: " + DOCS[9] + " " + DOCS[10] + " Answer:"
    result = rag.generate(prompt, max_new_tokens=N_NEW)
    s = rag.last_stats
    assert result.prompt_token_ids == _model()[1](prompt).input_ids
    assert s["documents"] == 2 and s["doc_tokens_reused"] >= s["doc_tokens"] - 4
    assert _same_answer(result.token_ids, _hf_greedy(prompt))


def test_stream_sets_stats_and_matches_generate() -> None:
    rag = _rag(repair="full")
    prompt = _prompt([DOCS[1], DOCS[2]])
    text = "".join(rag.stream(prompt, max_new_tokens=N_NEW))
    assert rag.last_stats["documents"] == 2
    assert text == rag.generate(prompt, max_new_tokens=N_NEW).text


def test_stories_sentencepiece_tokenizer(stories) -> None:
    """A real Llama sentencepiece tokenizer (prefix-space handling) on the trained stories260K model."""
    from conftest import STORY_DOCS

    model, tok = stories
    rag = KVBoostRAG(KVEngine(model, tok, repair="full"))
    rag.warm_documents(STORY_DOCS, progress=False)
    prompt = "Once upon a time, a mom read stories to her kids.\n\n" + "\n\n".join(STORY_DOCS[:3]) + "\n\nThe end"
    result = rag.generate(prompt, max_new_tokens=N_NEW)
    s = rag.last_stats
    assert result.prompt_token_ids == tok(prompt).input_ids and s["documents"] == 3
    assert s["doc_tokens_reused"] >= 0.9 * s["doc_tokens"]
    ids = torch.tensor([result.prompt_token_ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    assert result.token_ids == ref[0, ids.shape[1]:].tolist()

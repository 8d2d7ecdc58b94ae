"""Small shared helpers for the engine tests (not fixtures)."""

from __future__ import annotations

import torch

from kvboost_core import Segment
from kvboost_core.engine import KVEngine
from kvboost_core.model.driver import output_cache
from kvboost_core.tuning.fidelity import compare_logits


def engine_for(model, tokenizer, **kw) -> KVEngine:
    defaults = dict(chunk_size=16, boundary_window=4, sink_tokens=4)
    return KVEngine(model, tokenizer, **{**defaults, **kw})


@torch.inference_mode()
def full_logits(model, ids) -> torch.Tensor:
    return model(input_ids=torch.tensor([list(ids)], device=model.device)).logits[0, -1].float()


@torch.inference_mode()
def full_prefill_kv(model, ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each (H, n, D), of a plain HF full prefill of ``ids``."""
    cache = output_cache(model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=True))
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def docs_prompt(docs, question: str, head: str | None = None) -> list[Segment]:
    segs = [Segment(text=head)] if head else []
    return segs + [Segment(text=d, cacheable=True) for d in docs] + [Segment(text=question)]


def spy_generate(owner) -> list[dict]:
    """Record each ``owner.rag.generate`` call's prompt and options (an adapter's KVBoostRAG), and run it."""
    calls: list[dict] = []
    real = owner.rag.generate

    def generate(prompt, **kw):
        calls.append({"prompt": prompt, **kw})
        return real(prompt, **kw)

    object.__setattr__(owner.rag, "generate", generate)
    return calls


__all__ = ["compare_logits", "docs_prompt", "engine_for", "full_logits", "full_prefill_kv", "spy_generate"]


def warmed_block_prompt(model, tokenizer, docs, question: str = " Who is Bob?"):
    """An engine on ``model`` with ``docs`` warmed, and a prompt over them as the block construction reads it:
    (engine, prompt ids, block runs)."""
    from kvboost_core.lora.block_prefill import block_runs

    eng = engine_for(model, tokenizer)
    eng.warm(docs)
    segs = eng.tokenize(docs_prompt(docs, question, head="Q:"))
    return eng, [t for s in segs for t in s.token_ids], block_runs(segs, eng.config.sink_tokens)

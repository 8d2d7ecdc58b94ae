"""A prompt as a block-adapter engine serves it, rebuilt by plain HF: what the adapter is trained and checked on.

:mod:`kvboost_core.lora.block_prefill` builds block attention with the model's own HF forward: each warmed document
encoded on its own behind the engine's warm lead-in, its keys re-rotated to where it lands, every other token
computed in one causal pass. Which positions come from which document is the engine's own plan of the prompt
(``KVBoostRAG.plan``, then the engine's tokenization and lookup rule). This module derives that plan once for
the trainer (``kvboost-rag adapt --block``), the RAG benchmark's ``block`` setting and the tests, and runs the
reference greedy decode on it with the engine's lead-in and EOS ids. torch loads on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvboost_core.lora.block_prefill import Run


@dataclass(frozen=True, slots=True)
class BlockPlan:
    ids: list[int]  # the prompt's ids, exactly as the engine tokenizes them
    runs: list[Run]  # which positions come from which isolated document (block_prefill.block_runs)
    documents: int  # warmed documents the planner found in the prompt (0: nothing for a block to read)


def block_plan(rag: Any, prompt: str, add_special_tokens: bool) -> BlockPlan:
    """The engine's plan of ``prompt`` (a ``KVBoostRAG`` whose documents are registered or warmed) as block runs."""
    from kvboost_core.lora.block_prefill import block_runs

    engine = rag.engine
    plan = rag.plan(prompt, add_special_tokens=add_special_tokens)
    segs = engine.tokenize(plan.segments, add_special_tokens=False)
    ids = [t for s in segs for t in s.token_ids]
    return BlockPlan(ids, block_runs(segs, engine.config.sink_tokens), len(plan.doc_ranges))


def block_reference(rag: Any, plan: BlockPlan, max_new_tokens: int, encoded: dict | None = None
                    ) -> tuple[torch.Tensor, list[int]]:
    """(first-token logits (V,) fp32, greedy tokens) of ``rag``'s model under block attention over ``plan``,
    by plain HF (:func:`kvboost_core.lora.block_prefill.block_greedy`). ``encoded`` caches the documents' isolated
    encodings across calls on the same model."""
    from kvboost_core.lora.block_prefill import block_greedy

    engine = rag.engine
    return block_greedy(engine.model, plan.ids, plan.runs, list(engine.warm_prefix_ids), max_new_tokens,
                        set(engine.eos_token_ids), encoded)


def served_as_reference(rag: Any, prompt: str, add_special_tokens: bool, prompt_ids: Sequence[int],
                        tokens: Sequence[int], max_new_tokens: int, encoded: dict | None = None) -> bool:
    """Whether a block-served answer (its prompt ids and greedy ``tokens``) is exactly the HF reference's."""
    plan = block_plan(rag, prompt, add_special_tokens)
    if plan.ids != list(prompt_ids):
        return False
    _, ref = block_reference(rag, plan, max_new_tokens, encoded)
    return ref == list(tokens)

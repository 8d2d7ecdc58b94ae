"""The baselines kvboost's reuse is timed against, side by side in one process: HF full prefill of the whole
prompt, and exact-prefix caching (vLLM APC, SGLang) of earlier prompts' HF caches. TTFT counts from the call's
start; GPU work is synchronised before the clock stops. torch loads on first use."""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

from kvboost_rag.app.bench.prefix import longest_prefix

if TYPE_CHECKING:
    import torch


def sync() -> None:
    """GPU work is asynchronous: a timer must wait for it (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


class ExactPrefixCache:
    """What vLLM APC / SGLang reuse: the longest identical token prefix of any earlier prompt."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entries: list[tuple[list[int], Any]] = []

    def first_token(self, ids: list[int]) -> tuple[float, int]:
        import torch

        from kvboost_core.model.driver import output_cache

        best_n, best = longest_prefix(self.entries, ids)
        best_n = min(best_n, len(ids) - 1)  # the last token is always computed: its logits are the output
        cache = None
        if best is not None and best_n > 0:
            cache = copy.deepcopy(best)  # vLLM shares blocks without copying; keep the copy off the clock
            cache.crop(best_n - cache.get_seq_length())  # transformers 5: a negative count drops tokens
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids[best_n:]], device=self.model.device), cache=cache,
                             use_cache=True, logits_to_keep=1)
            tok = int(torch.argmax(out.logits[0, -1]))
        dt = time.perf_counter() - t0
        self.entries.append((list(ids), output_cache(out)))
        self.entries = self.entries[-8:]
        return dt, tok


def full_prefill(model: Any, ids: list[int]) -> tuple[float, torch.Tensor]:
    """The fair baseline: HF forward of the whole prompt, logits for the last position only."""
    import torch

    with torch.inference_mode():
        return timed(lambda: model(input_ids=torch.tensor([ids], device=model.device),
                                    logits_to_keep=1).logits[0, -1].float())

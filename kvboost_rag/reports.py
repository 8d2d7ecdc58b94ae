"""What each call reports to the framework skins, from its :class:`~kvboost_core.results.GenerationResult`.

Apart from :mod:`kvboost_rag.rag` so the skins can import it without torch: ``import langchain_kvboost``
and ``import llama_index.llms.kvboost`` stay light until an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvboost_core import cache_counts  # torch-free: the results module needs torch for annotations only

if TYPE_CHECKING:
    from kvboost_core.results import GenerationResult

# What the framework skins report of each call: LangChain's response_metadata["kvboost"] / generation_info,
# LlamaIndex's additional_kwargs["kvboost"]. The call's own figures, never KVBoostRAG's last_stats (calls may
# run concurrently).
CALL_INFO_KEYS = ("ttft_s", "reuse_ratio", "reused_exact", "reused_block", "reused_approx", "reused_repaired",
                  "recomputed", "doc_tokens", "doc_tokens_reused", "doc_tokens_kept", "doc_tokens_cached",
                  "doc_tokens_approximate", "doc_tokens_recomputed", "documents", "documents_not_warmed",
                  "prompt_tokens", "output_tokens", "mode")


def call_info(result: GenerationResult | None) -> dict[str, Any]:
    """The call's figures (:data:`CALL_INFO_KEYS` of its stats), with ``cached_tokens`` and
    ``cached_tokens_approximate`` as :func:`usage_counts` counts them; ``engine_finish_reason`` is the engine's
    own reason: "eos", "stop" (a stop string, a stop token, or a constrained value completed) or "length"."""
    if result is None:
        return {}
    stats = result.stats or {}
    info = {k: stats[k] for k in CALL_INFO_KEYS if k in stats}
    counts = cache_counts(stats)
    info.update(cached_tokens=counts.cached, cached_tokens_approximate=counts.approximate,
                engine_finish_reason=result.finish_reason)
    return info


def openai_finish_reason(result: GenerationResult | None, tool_calls: bool = False) -> str | None:
    """The engine's finish reason in OpenAI's words: "tool_calls" when the reply holds parsed tool calls,
    "length" when the token budget ran out, else "stop" (an end-of-sequence token or a stop string)."""
    if result is None:
        return None
    if tool_calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def usage_counts(result: GenerationResult | None) -> dict[str, int]:
    """Token counts of one call: ``input_tokens``, ``output_tokens``, ``total_tokens``, and of the prompt's
    tokens those whose KV was read from the cache and used as is, as :class:`kvboost_core.CacheCounts` defines
    them (the same counts the server reports as ``cached_tokens`` / ``cached_tokens_approximate``):

    - ``cache_read``: exact reuse (a prompt-prefix hit, or a re-placed document that is exactly the block
      adapter's own prefill), the meaning OpenAI and LangChain give cached tokens: a reply with them equals one
      without.
    - ``cache_read_approximate``: re-placed document KV (and KV of an earlier repaired prefill) kept without
      recompute. It saves the same compute but is an approximation of the full prefill, so it is never
      counted in ``cache_read``; tokens repair recomputed are in neither.
    """
    if result is None:
        return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "cache_read": 0,
                "cache_read_approximate": 0}
    counts = cache_counts(result.stats)
    n_in, n_out = len(result.prompt_token_ids), len(result.token_ids)
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
            "cache_read": counts.cached, "cache_read_approximate": counts.approximate}


__all__ = ["CALL_INFO_KEYS", "call_info", "openai_finish_reason", "usage_counts"]

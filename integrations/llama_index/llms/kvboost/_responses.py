"""What KVBoostLLM's responses carry of their own call, as llama-index's OpenAI LLM reports it: in
``additional_kwargs`` the token counts (``prompt_tokens``, ``completion_tokens``, ``total_tokens``, which
llama-index's TokenCountingHandler reads), ``cached_tokens`` (prompt tokens served from exact cached KV: a
prefix hit, or a block adapter's own prefill; ``cached_tokens_approximate``: re-placed or repaired KV used
without recompute, never counted as cached; both :class:`kvboost_core.CacheCounts`, as ``kvboost-rag serve``'s
``usage`` reports them), ``finish_reason`` in OpenAI's words ("stop", "length", "tool_calls")
and ``kvboost`` (the call's reuse figures, ``documents_not_warmed`` and the engine's own
``engine_finish_reason``); ``raw`` keeps the engine's result. A stream reports them on its last response (an
empty delta), once the generation is over."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
)

from kvboost_core.results import GenerationResult
from kvboost_rag.reports import call_info, openai_finish_reason, usage_counts


def stats_kwargs(result: GenerationResult | None, tool_calls: bool = False) -> dict[str, Any]:
    """A response's ``additional_kwargs`` for the call that produced ``result`` (see the module docstring)."""
    if result is None:
        return {}
    u = usage_counts(result)
    return {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"],
            "total_tokens": u["total_tokens"], "cached_tokens": u["cache_read"],
            "cached_tokens_approximate": u["cache_read_approximate"],
            "finish_reason": openai_finish_reason(result, tool_calls), "kvboost": call_info(result)}


def raw(result: GenerationResult | None) -> dict[str, Any] | None:
    """The engine's result, for ``raw``."""
    if result is None:
        return None
    return {"finish_reason": result.finish_reason, "ttft_s": result.ttft_s, "total_s": result.total_s,
            "reuse_ratio": result.reuse_ratio, "token_ids": list(result.token_ids),
            "prompt_tokens": len(result.prompt_token_ids), "stats": dict(result.stats or {})}


def completion(result: GenerationResult) -> CompletionResponse:
    return CompletionResponse(text=result.text, raw=raw(result), additional_kwargs=stats_kwargs(result))


def stream_completions(pieces: Iterator[str], done: dict[str, Any]) -> CompletionResponseGen:
    """Responses of a completion stream: one per text piece, then a last one (empty delta) with the call's
    report, from the result that ``done["result"]`` holds once ``pieces`` is exhausted. It is yielded for an
    empty generation too, as HuggingFaceLLM yields one: llama-index's end-of-stream event needs a response."""
    text = ""
    for piece in pieces:
        text += piece
        yield CompletionResponse(text=text, delta=piece)
    result = done.get("result")
    yield CompletionResponse(text=text, delta="", raw=raw(result), additional_kwargs=stats_kwargs(result))


def keeper(done: dict[str, Any]) -> Callable[[GenerationResult, dict[str, Any]], None]:
    """An ``on_result`` callback keeping a stream's own result in ``done`` (not last_stats: calls may run
    concurrently)."""
    def keep(result: GenerationResult, stats: dict[str, Any]) -> None:
        done["result"] = result

    return keep


def to_chat(response: CompletionResponse) -> ChatResponse:
    """A completion response as the assistant's chat response; the call's report stays on the response
    (``additional_kwargs``), not on the message, which goes back into the chat history."""
    return ChatResponse(message=ChatMessage(role="assistant", content=response.text), delta=response.delta,
                        raw=response.raw, additional_kwargs=dict(response.additional_kwargs))


def to_chat_stream(responses: CompletionResponseGen) -> ChatResponseGen:
    return (to_chat(r) for r in responses)

"""``KVBoostLLM.structured_predict`` and its streaming variants: the output class's JSON schema enforced by
constrained decoding (:mod:`kvboost_rag.constrained`), through the engine like a plain call (warmed documents
reused).

Streaming yields what llama-index's own structured streaming yields (``LLMTextCompletionProgram.stream_call``):
after each text piece, the object parsed from the JSON so far, as ``output_cls`` when that already validates
and otherwise as llama-index's flexible copy of it (every field optional); the JSON prefix is closed to parse
it (:mod:`kvboost_rag.partial_json`). The last object is the whole reply validated as ``output_cls``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvboost_rag.aio import aiter_in_thread, run_blocking


def _request(llm: Any, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None,
             prompt_args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the prompt text, the call's options) of a structured call; TypeError for a non-pydantic class."""
    from pydantic import BaseModel

    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise TypeError(f"output_cls must be a pydantic model class, got {output_cls!r}")
    raw = dict(llm_kwargs or {})
    if llm._template_chat:
        text = llm._chat_prompt(prompt.format_messages(llm=llm, **prompt_args))
        raw = llm._chat_kwargs(text, raw)
    else:
        text = llm._full_prompt(prompt.format(llm=llm, **prompt_args), False)
    call_kw = llm._call_kwargs(raw)
    call_kw.pop("stop", None)  # a stop string would cut the JSON short
    return text, call_kw


def _budget_error(call_kw: dict[str, Any]) -> ValueError:
    return ValueError(f"structured_predict: the reply reached max_new_tokens={call_kw['max_new_tokens']} before "
                      "its JSON was complete; raise max_new_tokens")


def structured_predict(llm: Any, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None,
                       prompt_args: dict[str, Any]) -> Any:
    """``output_cls`` (a pydantic class) from ``llm`` (a KVBoostLLM) for ``prompt`` (a LlamaIndex prompt
    template) formatted with ``prompt_args``; ValueError when ``max_new_tokens`` runs out before the JSON."""
    from kvboost_rag.constrained import generate_json

    text, call_kw = _request(llm, output_cls, prompt, llm_kwargs, prompt_args)
    res = generate_json(llm.rag, text, output_cls.model_json_schema(), **call_kw)
    if res.finish_reason == "length":
        raise _budget_error(call_kw)
    return output_cls.model_validate_json(res.text)


def partial_object(output_cls: Any, flexible_cls: Any, data: Any) -> Any:
    """``data`` (parsed from a JSON prefix) as ``output_cls`` when it validates, else as ``flexible_cls``
    (llama-index's ``create_flexible_model(output_cls)``), None when neither takes it (not an object)."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        return None
    try:
        return output_cls.model_validate(data)
    except ValidationError:
        pass
    try:
        return flexible_cls.model_validate(data)
    except ValidationError:
        return None


def stream_structured_predict(llm: Any, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None,
                              prompt_args: dict[str, Any]) -> Iterator[Any]:
    """Partial objects of :func:`structured_predict`'s reply as it streams (one per piece that changes the
    parsed JSON), then the complete object. The request is checked and the grammar compiled now, not at the
    first ``next``; ValueError at the end when ``max_new_tokens`` runs out before the JSON."""
    from llama_index.core.program.utils import create_flexible_model

    from kvboost_rag.constrained import stream_json
    from kvboost_rag.partial_json import parse_partial

    text, call_kw = _request(llm, output_cls, prompt, llm_kwargs, prompt_args)
    done: dict[str, Any] = {}
    pieces = stream_json(llm.rag, text, output_cls.model_json_schema(),
                         on_result=lambda result, stats: done.update(result=result), **call_kw)
    flexible = create_flexible_model(output_cls)

    def gen() -> Iterator[Any]:
        reply, shown = "", None
        last = None
        for piece in pieces:
            reply += piece
            data = parse_partial(reply)
            if data is None or data == shown:
                continue
            obj = partial_object(output_cls, flexible, data)
            if obj is not None:
                shown, last = data, obj
                yield obj
        result = done.get("result")
        if result is not None and result.finish_reason == "length":
            raise _budget_error(call_kw)
        final = output_cls.model_validate_json(reply)
        if not (isinstance(last, output_cls) and last == final):  # the last partial may be the whole object
            yield final

    return gen()


class StructuredOutput:
    """KVBoostLLM's structured output, constrained: a mixin placed before llama-index's ``LLM`` in the bases,
    so these replace its unconstrained fallbacks. llama-index's own ``stream_structured_predict`` and
    ``astream_structured_predict`` (kept for their instrumentation events) stream what the two
    ``_structured_*stream_call`` hooks return."""

    def structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Any:
        """``output_cls`` from the model, its JSON schema enforced by constrained decoding (llguidance), so the
        reply always parses (ValueError when ``max_new_tokens`` runs out first)."""
        return structured_predict(self, output_cls, prompt, llm_kwargs, prompt_args)

    async def astructured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        return await run_blocking(structured_predict, self, output_cls, prompt, llm_kwargs, prompt_args)

    def _structured_stream_call(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                **prompt_args: Any) -> Any:
        return stream_structured_predict(self, output_cls, prompt, llm_kwargs, prompt_args)

    async def _structured_astream_call(self, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                       **prompt_args: Any) -> Any:
        # built off the loop too: a tokenizer's first grammar prepares its vocabulary (seconds)
        gen = await run_blocking(stream_structured_predict, self, output_cls, prompt, llm_kwargs, prompt_args)
        return aiter_in_thread(lambda: gen)

"""``KVBoostLLM.structured_predict``: the output class's JSON schema enforced by constrained decoding
(:mod:`kvboost_rag.constrained`), through the engine like a plain call (warmed documents reused)."""

from __future__ import annotations

from typing import Any


def structured_predict(llm: Any, output_cls: Any, prompt: Any, llm_kwargs: dict[str, Any] | None,
                       prompt_args: dict[str, Any]) -> Any:
    """``output_cls`` (a pydantic class) from ``llm`` (a KVBoostLLM) for ``prompt`` (a LlamaIndex prompt
    template) formatted with ``prompt_args``; ValueError when ``max_new_tokens`` runs out before the JSON."""
    from pydantic import BaseModel

    from kvboost_rag.constrained import generate_json

    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise TypeError(f"output_cls must be a pydantic model class, got {output_cls!r}")
    call_kw = llm._call_kwargs(dict(llm_kwargs or {}))
    call_kw.pop("stop", None)  # a stop string would cut the JSON short
    if llm._template_chat:
        text = llm._chat_prompt(prompt.format_messages(llm=llm, **prompt_args))
        call_kw = llm._chat_kwargs(text, call_kw)
    else:
        text = llm._full_prompt(prompt.format(llm=llm, **prompt_args), False)
    res = generate_json(llm.rag, text, output_cls.model_json_schema(), **call_kw)
    if res.finish_reason == "length":
        raise ValueError(f"structured_predict: the reply reached max_new_tokens={call_kw['max_new_tokens']} "
                         "before its JSON was complete; raise max_new_tokens")
    return output_cls.model_validate_json(res.text)

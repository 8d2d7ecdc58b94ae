"""Options the framework skins share: per-call keyword arguments and ``from_model_id`` arguments.

One policy for both LangChain and LlamaIndex: a per-call keyword argument that neither the engine nor the
framework itself uses is a ``TypeError`` naming it (a silently ignored ``top_k=5`` looks like it worked).
``from_model_id`` accepts what a user migrating from ``HuggingFacePipeline`` / ``HuggingFaceLLM`` passes:
``task=`` and ``pipeline_kwargs=`` (mapped where kvboost has the same knob, refused with the replacement
otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Generation options every skin accepts per call (both spellings of the token budget).
GENERATION_KEYS = frozenset({"max_tokens", "max_new_tokens", "temperature", "top_p", "seed", "stop"})
# Engine options passed through per call.
ENGINE_KEYS = frozenset({"kv_documents", "repair", "recompute_ratio", "select", "check_layer", "store_prefix",
                         "add_special_tokens"})
CALL_KEYS = GENERATION_KEYS | ENGINE_KEYS

_TASKS = ("text-generation",)
# HF generation kwargs with no kvboost equivalent, and what to use instead.
_UNMAPPABLE = {
    "top_k": "top-k sampling is not supported; use top_p (nucleus) with temperature",
    "repetition_penalty": "not supported by kvboost's sampler",
    "num_beams": "beam search is not supported; kvboost decodes greedily or by sampling",
    "max_length": "use max_new_tokens (a budget of new tokens, not of prompt + output)",
    "return_full_text": "kvboost always returns only the generated text (return_full_text=False)",
    "num_return_sequences": "one sequence per call; call again (or batch) for more",
}


def check_call_kwargs(kwargs: Mapping[str, Any], allowed: Iterable[str], *, owner: str) -> None:
    """Raise ``TypeError`` naming every key of ``kwargs`` not in ``allowed``."""
    allowed = frozenset(allowed)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}; per-call options are "
                        f"{sorted(CALL_KEYS & allowed)}")


def pipeline_options(task: str | None, pipeline_kwargs: Mapping[str, Any] | None,
                     *, budget_name: str) -> dict[str, Any]:
    """``HuggingFacePipeline``-style ``task``/``pipeline_kwargs`` -> this skin's field values.

    ``budget_name`` is the skin's name of the token budget (``max_tokens`` in LangChain, ``max_new_tokens``
    in LlamaIndex). ``do_sample=False`` means greedy (temperature 0); ``do_sample=True`` without a
    temperature samples at 1.0, as transformers does.
    """
    if task is not None and task not in _TASKS:
        raise ValueError(f"task={task!r} is not supported: kvboost runs decoder-only causal LMs "
                         f"(task='text-generation', or leave task out)")
    if pipeline_kwargs is None:
        return {}
    if not isinstance(pipeline_kwargs, Mapping):
        raise TypeError(f"pipeline_kwargs must be a dict, got {type(pipeline_kwargs).__name__}")
    out: dict[str, Any] = {}
    for key, value in pipeline_kwargs.items():
        if key in ("max_new_tokens", "max_tokens"):
            out[budget_name] = value
        elif key in ("temperature", "top_p", "seed"):
            out[key] = value
        elif key in ("stop", "stop_strings", "stop_sequence"):
            out["stop"] = [value] if isinstance(value, str) else list(value)
        elif key == "do_sample":
            continue  # resolved below, once temperature is known
        elif key == "return_full_text" and value is False:
            continue  # what kvboost does anyway
        elif key in _UNMAPPABLE:
            raise ValueError(f"pipeline_kwargs[{key!r}] cannot be mapped: {_UNMAPPABLE[key]}")
        else:
            raise ValueError(f"pipeline_kwargs[{key!r}] is not supported; kvboost maps max_new_tokens, "
                             "temperature, top_p, do_sample, seed and stop (pass them as fields instead)")
    if "do_sample" in pipeline_kwargs:
        if not pipeline_kwargs["do_sample"]:
            out["temperature"] = 0.0
        else:
            out.setdefault("temperature", 1.0)
            if not out["temperature"]:
                raise ValueError("pipeline_kwargs do_sample=True with temperature=0 is contradictory; "
                                 "set temperature > 0 to sample")
    return out


def split_model_kwargs(kwargs: dict[str, Any], field_names: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``from_model_id`` keyword arguments into (fields by canonical name, engine options).

    ``field_names`` maps every accepted spelling (field name and each alias) to the canonical field name.
    Passing two spellings of one field is an error rather than a silent pick.
    """
    fields: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = field_names.get(key)
        if name is None:
            engine[key] = value
            continue
        if name in fields:
            raise TypeError(f"{key}= repeats {name}= (two spellings of one option); pass one of them")
        fields[name] = value
    return fields, engine

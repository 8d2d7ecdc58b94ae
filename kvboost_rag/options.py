"""Options the framework skins share: per-call keyword arguments and ``from_model_id`` arguments.

One policy for both LangChain and LlamaIndex: a per-call keyword argument that neither the engine nor the
framework itself uses is a ``TypeError`` naming it (a silently ignored ``top_k=5`` looks like it worked).
``from_model_id`` accepts what a user migrating from ``HuggingFacePipeline`` / ``HuggingFaceLLM`` passes:
``task=``, ``pipeline_kwargs=`` and ``generate_kwargs=`` (mapped where kvboost has the same knob, refused with
the replacement otherwise), ``device`` as HF pipelines spell it (-1 for the CPU, n for ``cuda:n``), a
``device_map`` that names one device, ``model_kwargs`` that override kvboost's loading defaults (``dtype``,
``attn_implementation``) and ``stopping_ids``. Engine options are checked before the weights load, so a typo
fails at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvboost_core.config import REPAIR_OPTIONS  # no torch: the skins import this module on their own import


@dataclass(frozen=True, slots=True)
class RAGOptions:
    """How :class:`kvboost_rag.KVBoostRAG` finds and warms documents: one value, built once by the caller (or
    a skin, from its fields) and held by the RAG object."""

    transparent: bool = True  # find warmed documents inside flat prompts (by their token ids)
    preserve_order: bool = False  # explicit documents: keep the caller's order (else the store's best order)
    separator: str = "\n\n"  # between explicit documents in the assembled prompt
    auto_warm: bool = False  # after a call, warm the documents it found unwarmed, so the next query reuses them
    miss_warning_interval_s: float = 60.0  # at most one warning about unwarmed documents per interval
    # Chat turns computed exactly: the whole prompt is read as history (never re-placed), so answers are the full
    # prefill's and the next turn waits for no backfill (only the answer is left to store). Turn 1 then costs a
    # full prefill of its documents; the default re-places them (fast) and backfills the exact KV afterwards.
    exact_turns: bool = False

    def __post_init__(self) -> None:
        for name in ("transparent", "preserve_order", "auto_warm", "exact_turns"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.separator, str):
            raise TypeError(f"separator must be a str, got {type(self.separator).__name__}")
        interval = self.miss_warning_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ValueError(f"miss_warning_interval_s must be a number >= 0, got {interval!r}")

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def with_(self, **changes: Any) -> RAGOptions:
        """A copy with ``changes``; an unknown name is a TypeError naming it."""
        unknown = set(changes) - self.names()
        if unknown:
            raise TypeError(f"unknown RAG option(s) {sorted(unknown)}; RAGOptions has {sorted(self.names())}")
        return replace(self, **changes) if changes else self

    def switched_on(self, **flags: bool) -> RAGOptions:
        """A copy with each flag given True set True; a flag given False keeps this value (a skin's default never
        turns off what the KVBoostRAG it wraps was built with)."""
        return self.with_(**{name: True for name, on in flags.items() if on})


# Generation options every skin accepts per call (both spellings of the token budget).
GENERATION_KEYS = frozenset({"max_tokens", "max_new_tokens", "temperature", "top_p", "seed", "stop"})
# Engine options passed through per call: the engine's repair overrides (one list: kvboost_core.config) and more.
ENGINE_KEYS = frozenset({"kv_documents", "store_prefix", "add_special_tokens", *REPAIR_OPTIONS})
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


def merge_call_options(defaults: Mapping[str, Any], kwargs: Mapping[str, Any], allowed: Iterable[str], *,
                       owner: str) -> dict[str, Any]:
    """A call's options in both skins, by one rule: ``kwargs`` (the call's) over ``defaults`` (the instance's
    fields). A name not in ``allowed`` is a ``TypeError`` naming it; ``max_tokens`` and ``max_new_tokens`` are two
    spellings of one option, named ``max_new_tokens`` in the result, and giving both is a ``TypeError``.
    Only names in :data:`CALL_KEYS` are returned (a framework's own keys in ``allowed`` are not options)."""
    check_call_kwargs(kwargs, allowed, owner=owner)
    kw = {k: v for k, v in kwargs.items() if k in CALL_KEYS}
    if "max_tokens" in kw:
        if "max_new_tokens" in kw:
            raise TypeError(f"{owner}: max_tokens= repeats max_new_tokens= (two spellings of one option); pass one")
        kw["max_new_tokens"] = kw.pop("max_tokens")
    return {**defaults, **kw}


def typed_call(rag: Any, merged: Mapping[str, Any]) -> dict[str, Any]:
    """A skin's merged per-call options (:func:`merge_call_options`) as ``KVBoostRAG.generate``/``stream`` take
    them: the engine's options (repair, recompute_ratio, store_prefix, add_special_tokens, ...) built once into one
    checked ``CallOptions`` (``call_options=``), beside the sampling settings and ``kv_documents``. So a skin's
    ``repair`` travels from its entry to the forward as one typed value, and a bad one fails at the skin's call."""
    engine = {k: v for k, v in merged.items() if k in ENGINE_KEYS and k != "kv_documents"}
    rest = {k: v for k, v in merged.items() if k not in engine}
    return {**rest, "call_options": rag.call_options(**engine)}


def pipeline_options(task: str | None, pipeline_kwargs: Mapping[str, Any] | None,
                     *, budget_name: str, source: str = "pipeline_kwargs") -> dict[str, Any]:
    """``HuggingFacePipeline``-style ``task``/``pipeline_kwargs`` -> this skin's field values.

    ``budget_name`` is the skin's name of the token budget (``max_tokens`` in LangChain, ``max_new_tokens``
    in LlamaIndex); ``source`` names the argument in errors (``generate_kwargs`` for HuggingFaceLLM's, which
    take the same keys). ``do_sample=False`` means greedy (temperature 0); ``do_sample=True`` without a
    temperature samples at 1.0, as transformers does.
    """
    if task is not None and task not in _TASKS:
        raise ValueError(f"task={task!r} is not supported: kvboost runs decoder-only causal LMs "
                         f"(task='text-generation', or leave task out)")
    if pipeline_kwargs is None:
        return {}
    if not isinstance(pipeline_kwargs, Mapping):
        raise TypeError(f"{source} must be a dict, got {type(pipeline_kwargs).__name__}")
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
            raise ValueError(f"{source}[{key!r}] cannot be mapped: {_UNMAPPABLE[key]}")
        else:
            raise ValueError(f"{source}[{key!r}] is not supported; kvboost maps max_new_tokens, "
                             "temperature, top_p, do_sample, seed and stop (pass them as fields instead)")
    if "do_sample" in pipeline_kwargs:
        if not pipeline_kwargs["do_sample"]:
            out["temperature"] = 0.0
        else:
            out.setdefault("temperature", 1.0)
            if not out["temperature"]:
                raise ValueError(f"{source} do_sample=True with temperature=0 is contradictory; "
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


# ---------------------------------------------------------------------------------------------------- loading
_LOADING = ("device", "dtype", "device_map", "model_kwargs", "tokenizer_name")


def one_device(device: Any, name: str = "device") -> str:
    """One device as HF spells it -> a torch device string: -1 is the CPU (the pipelines' convention), an
    int n >= 0 is ``cuda:n``, a str or a ``torch.device`` is taken as is."""
    if isinstance(device, bool):
        raise TypeError(f"{name} must be an int, a str or a torch.device, got bool")
    if isinstance(device, int):
        if device < -1:
            raise ValueError(f"{name}={device} is not a device: use -1 for the CPU or n >= 0 for cuda:n")
        return "cpu" if device == -1 else f"cuda:{device}"
    if type(device).__name__ == "device" and hasattr(device, "type"):  # torch.device, without importing torch
        return str(device)
    if isinstance(device, str) and device.strip():
        return device.strip()
    raise TypeError(f"{name} must be an int (-1: cpu, n: cuda:n), a str such as 'cuda:0' or a torch.device, "
                    f"got {device!r}")


def _device_map_device(device_map: Any) -> str | None:
    """The one device a ``device_map`` names; None for "auto" (kvboost's own choice: cuda when available,
    else the CPU). kvboost runs the whole model on one device, where the KV cache is assembled, so a map
    that splits the model is refused."""
    if device_map is None or device_map == "auto":
        return None
    if isinstance(device_map, str) and device_map in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map={device_map!r} splits the model over devices; kvboost runs it on one "
                         "device (the KV cache is assembled there): use device_map='auto', a device, or device=")
    if isinstance(device_map, Mapping):
        devices = {one_device(v, "device_map value") for v in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"device_map puts the model on {sorted(devices)}; kvboost runs it on one device "
                             "(the KV cache is assembled there)")
        return devices.pop()
    return one_device(device_map, "device_map")


def load_device(device: Any = None, device_map: Any = None) -> str | None:
    """The device to load on from HF's ``device`` and ``device_map`` (None: kvboost's default choice);
    ValueError when they name different devices."""
    dev = None if device is None else one_device(device)
    mapped = _device_map_device(device_map)
    if dev is not None and mapped is not None and dev != mapped:
        raise ValueError(f"device={device!r} and device_map={device_map!r} name different devices; pass one")
    return dev or mapped


def model_kwargs_of(model_kwargs: Any) -> tuple[dict[str, Any], Any]:
    """(``model_kwargs`` for ``from_pretrained``, a ``device_map`` found in them): ``torch_dtype`` becomes
    ``dtype`` (its transformers 5 name); what remains overrides kvboost's defaults (dtype, attention)."""
    if model_kwargs is None:
        return {}, None
    if not isinstance(model_kwargs, Mapping):
        raise TypeError(f"model_kwargs must be a dict, got {type(model_kwargs).__name__}")
    out = dict(model_kwargs)
    if "torch_dtype" in out:
        if "dtype" in out:
            raise TypeError("model_kwargs has both torch_dtype and dtype (two spellings of one option); pass one")
        out["dtype"] = out.pop("torch_dtype")
    return out, out.pop("device_map", None)


def check_engine_kwargs(engine_kw: Mapping[str, Any], *, owner: str) -> None:
    """Check engine options (EngineConfig fields, or ``config=``) before any weights load: an unknown name is
    a TypeError naming it and a bad value the config's own error, at once rather than after the load."""
    from dataclasses import fields

    from kvboost_core import EngineConfig

    names = {f.name for f in fields(EngineConfig) if f.init}
    unknown = sorted(set(engine_kw) - names - {"config"})
    if unknown:
        raise TypeError(f"{owner}.from_model_id got unexpected keyword argument(s) {unknown}: not a field, a "
                        f"loading option {list(_LOADING)} nor an engine option {sorted(names)}")
    rest = {k: v for k, v in engine_kw.items() if k != "config"}
    config = engine_kw.get("config")
    if config is None:
        EngineConfig(**rest)
    elif not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a kvboost_core EngineConfig, got {type(config).__name__}")
    else:
        config.with_(**rest)


def stop_token_ids(stopping_ids: Any) -> tuple[int, ...]:
    """HuggingFaceLLM's ``stopping_ids`` (token ids that end generation) checked: a list of ints >= 0."""
    if stopping_ids is None:
        return ()
    if isinstance(stopping_ids, (str, bytes)) or not isinstance(stopping_ids, Iterable):
        raise TypeError(f"stopping_ids must be a list of token ids, got {type(stopping_ids).__name__}")
    ids = tuple(stopping_ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"stopping_ids must be token ids (ints >= 0), got {list(ids)!r}")
    return ids

"""What KVBoostLLM and ChatKVBoost share: pydantic fields, the KVBoostRAG they wrap, per-call options.

No engine logic lives here: every call goes to ``kvboost_rag.KVBoostRAG``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvboost_rag.aio import aiter_in_thread
from kvboost_rag.options import (
    CALL_KEYS,
    merge_call_options,
    pipeline_options,
    split_model_kwargs,
    typed_call,
)
from langchain_kvboost._retrieval import watch_retrievals

if TYPE_CHECKING:  # the engine (torch, transformers) loads when one is built, not on import langchain_kvboost
    from kvboost_rag import KVBoostRAG, WarmReport

# Keyword arguments LangChain itself may hand to _generate/_stream alongside the user's per-call options.
_FRAMEWORK_KEYS = frozenset({"run_manager", "callbacks", "tags", "metadata", "run_name", "run_id",
                             "ls_structured_output_format", "structured_output_format"})
_ALLOWED = CALL_KEYS | _FRAMEWORK_KEYS

__all__ = ["KVBoostFields", "aiter_in_thread"]


def field_spellings(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted spelling of every field of ``model`` (its name and its aliases) -> the field name."""
    names: dict[str, str] = {}
    for name, info in model.model_fields.items():
        names[name] = name
        alias = info.validation_alias
        for a in getattr(alias, "choices", [alias] if isinstance(alias, str) else []):
            if isinstance(a, str):
                names[a] = name
        if info.alias:
            names[info.alias] = name
    return names


class KVBoostFields(BaseModel):
    """Fields and helpers common to the LLM and the chat model."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=())

    engine: Any = Field(default=None, exclude=True,
                        description="The kvboost_core KVEngine to run (or a KVBoostRAG to share its registry). "
                                    "Use from_model_id(...) to load one from a HuggingFace id or path.")
    model_id: str | None = Field(default=None, description="HuggingFace model id or local path (informational "
                                                           "when engine= is given; reported as model_name).")
    max_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
                            description="Maximum number of new tokens per call (alias: max_new_tokens).")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (with temperature > 0).")
    seed: int | None = Field(default=None, description="Seed for sampling (temperature > 0).")
    stop: list[str] | None = Field(default=None, description="Stop strings; generation ends before the first one.")
    repair: str | None = Field(default=None, description="KV repair for reused documents: none, selective, "
                                                         "cacheblend or full (None: the engine's default).")
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0,
                                          description="CacheBlend recompute ratio (None: the engine's default).")
    transparent: bool = Field(default=True, description="Find warmed documents inside flat prompts (no prompt "
                                                        "changes; kv_documents=[...] per call is explicit mode).")
    preserve_order: bool = Field(default=False, description="Explicit mode: keep the given document order instead "
                                                            "of a stable order sorted by document id.")
    auto_warm: bool = Field(default=False, description="Warm retrieved documents that were not warmed yet after "
                                                       "the call that used them, so the next query reuses "
                                                       "their KV (misses are logged either way).")

    exact_turns: bool = Field(default=False, description="Chat calls: compute every turn exactly (documents "
                                                         "never re-placed), so a follow-up waits for no backfill; "
                                                         "a chat's first turn then costs a full prefill.")

    _rag: Any = PrivateAttr(default=None)  # the KVBoostRAG calls go to (set by the validator)

    @model_validator(mode="after")
    def _build_adapter(self) -> KVBoostFields:
        from kvboost_core.engine import KVEngine
        from kvboost_rag.options import RAGOptions
        from kvboost_rag.rag import KVBoostRAG

        engine = self.engine
        if isinstance(engine, KVBoostRAG):
            self._rag, self.engine = engine, engine.engine
            engine.options = engine.options.switched_on(auto_warm=self.auto_warm, exact_turns=self.exact_turns)
        elif isinstance(engine, KVEngine):
            self._rag = KVBoostRAG(engine, RAGOptions(transparent=self.transparent,
                                                      preserve_order=self.preserve_order, auto_warm=self.auto_warm,
                                                      exact_turns=self.exact_turns))
        elif engine is None:
            raise ValueError(f"{type(self).__name__} needs engine=KVEngine(model, tokenizer); or build one with "
                             f"{type(self).__name__}.from_model_id('org/model')")
        else:
            raise TypeError(f"engine must be a kvboost_core KVEngine or a kvboost_rag KVBoostRAG, got "
                            f"{type(engine).__name__}")
        watch_retrievals()  # retrieved documents become visible, so unwarmed ones are reported
        return self

    @classmethod
    def from_model_id(cls, model_id: str, *, device: Any = None, dtype: Any = None, device_map: Any = None,
                      model_kwargs: dict | None = None, task: str | None = None,
                      pipeline_kwargs: dict | None = None, tokenizer_name: str | None = None,
                      **kwargs: Any) -> Any:
        """Load ``model_id`` (hub id or local path) like HuggingFacePipeline.from_model_id.

        Keyword arguments naming a field of this class, or an alias of one (``max_new_tokens`` for
        ``max_tokens``), configure it; ``task``/``pipeline_kwargs`` are mapped as HuggingFacePipeline reads
        them (max_new_tokens, temperature, do_sample, top_p, seed, stop; anything else is refused with what
        to use instead); the rest (chunk_size, store, sink_tokens, ...) go to the engine's EngineConfig and
        are checked before the weights load. ``device`` as HF pipelines take it (-1: the CPU, n: cuda:n),
        ``device_map`` naming one device (or "auto"), ``model_kwargs`` over kvboost's loading defaults
        (``dtype``, ``attn_implementation``): see :func:`kvboost_rag.rag.load_engine`."""
        from kvboost_rag.rag import load_engine

        mapped = pipeline_options(task, pipeline_kwargs, budget_name="max_tokens")
        fields, engine_kw = split_model_kwargs(kwargs, field_spellings(cls))
        fields = {**mapped, **fields}  # explicit fields win over pipeline_kwargs
        engine = load_engine(model_id, device=device, dtype=dtype, device_map=device_map, model_kwargs=model_kwargs,
                             tokenizer_name=tokenizer_name, owner=cls.__name__, **engine_kw)
        return cls(engine=engine, model_id=model_id, **fields)

    # ------------------------------------------------------------------ shared helpers
    @property
    def rag(self) -> KVBoostRAG:
        assert self._rag is not None  # set by the validator
        return self._rag

    @property
    def last_stats(self) -> dict[str, Any]:
        return self.rag.last_stats

    @property
    def model_name(self) -> str:
        cfg = self.rag.engine.model.config
        return self.model_id or getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", "kvboost")

    def warm_documents(self, docs: Any, *, batch_size: int = 8, show_progress: bool | None = None,
                       progress: bool | None = None) -> WarmReport:
        """Warm and register documents so prompts containing them reuse their KV. ``show_progress``
        (alias ``progress``): None shows a bar on a terminal only."""
        return self.rag.warm_documents(docs, batch_size=batch_size, show_progress=show_progress,
                                       progress=progress)

    def _call_options(self, stop: list[str] | None, kwargs: dict[str, Any],
                      add_special_tokens: bool | None = None) -> dict[str, Any]:
        """Merge instance defaults with per-call overrides (LangChain passes bound kwargs here) by the rule both
        skins share (:func:`kvboost_rag.options.merge_call_options`): an unknown keyword is a TypeError, never
        silently ignored, and so is giving both max_tokens and max_new_tokens. The engine's options become one
        ``CallOptions`` here (:func:`kvboost_rag.options.typed_call`); ``add_special_tokens`` (a chat template's
        BOS rule) overrides the call's."""
        stops = list(self.stop or []) + list(stop or [])
        defaults: dict[str, Any] = {"max_new_tokens": self.max_tokens, "temperature": self.temperature,
                                    "top_p": self.top_p, "seed": self.seed, "stop": stops or None}
        defaults |= {k: getattr(self, k) for k in ("repair", "recompute_ratio") if getattr(self, k) is not None}
        opts = merge_call_options(defaults, kwargs, _ALLOWED, owner=type(self).__name__)
        opts["max_new_tokens"] = int(opts["max_new_tokens"])
        opts["temperature"], opts["top_p"] = float(opts["temperature"]), float(opts["top_p"])
        if add_special_tokens is not None:
            opts["add_special_tokens"] = add_special_tokens
        return typed_call(self.rag, opts)

    def _params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "repair": self.repair, "recompute_ratio": self.recompute_ratio,
                "transparent": self.transparent}


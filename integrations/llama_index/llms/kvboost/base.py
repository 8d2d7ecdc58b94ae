"""LlamaIndex skin over :class:`kvboost_rag.rag.KVBoostRAG`: :class:`KVBoostLLM`, a ``CustomLLM`` whose
prompts reuse the KV of warmed documents (transparently: the synthesizer's flat prompt is searched for warmed
document texts). Ingestion helpers are in :mod:`.ingestion`.

No engine logic lives here: everything is delegated to ``KVBoostRAG``. The async methods run the blocking
generation in a worker thread, so the event loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvboost_rag.aio import aiter_in_thread, run_blocking
from kvboost_rag.options import (
    CALL_KEYS,
    RAGOptions,
    merge_call_options,
    pipeline_options,
    split_model_kwargs,
    stop_token_ids,
    typed_call,
)
from kvboost_rag.toolcalls import chat_inputs, max_calls

_HINT = "pip install 'kvboost-rag[llamaindex]'"

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.llms.kvboost._responses import (
        completion,
        keeper,
        raw,
        stats_kwargs,
        stream_completions,
        to_chat,
        to_chat_stream,
    )
    from llama_index.llms.kvboost._retrieval import render_node, watch_retrievals
    from llama_index.llms.kvboost._structured import StructuredOutput
    from llama_index.llms.kvboost._tools import (
        ToolCalling,
        ToolRequest,
        chat_history,
        stream_with_tool_calls,
        tool_chat_dicts,
        tool_request,
        with_tool_calls,
    )
except ImportError as exc:  # pragma: no cover - exercised only without llama-index installed
    raise ImportError(f"llama_index.llms.kvboost needs llama-index-core: {_HINT}") from exc

if TYPE_CHECKING:
    from kvboost_core import KVEngine
    from kvboost_rag.rag import KVBoostRAG

# Per-call engine options complete()/stream_complete() accept as keyword arguments (max_tokens is an alias
# of max_new_tokens, as in the field).
_CALL_OPTIONS = CALL_KEYS - {"max_tokens"}
# Spellings from_model_id and the constructor accept for fields, besides the field names.
_FIELD_ALIASES = {"max_tokens": "max_new_tokens"}
# HuggingFaceLLM's loading arguments: meaningful for from_model_id only (an engine is loaded already).
_LOADING = ("tokenizer_name", "device_map", "model_kwargs", "device", "dtype")


# ---------------------------------------------------------------------------------------------------- helpers
def _rag_class() -> type[KVBoostRAG]:
    try:
        from kvboost_rag.rag import KVBoostRAG
    except ImportError as exc:
        raise ImportError(f"kvboost_rag.rag is not importable ({exc}); reinstall kvboost-rag: {_HINT}") from exc
    return KVBoostRAG


def _as_rag(obj: Any, options: RAGOptions) -> KVBoostRAG:
    """A KVBoostRAG from a KVBoostRAG, a KVEngine (wrapped with ``options``) or a KVBoostLLM."""
    if isinstance(obj, KVBoostLLM):
        return obj.rag
    cls = _rag_class()
    if isinstance(obj, cls):
        return obj
    from kvboost_core import KVEngine

    if isinstance(obj, KVEngine):
        return cls(obj, options)
    raise TypeError(f"expected a KVBoostLLM, a KVBoostRAG or a kvboost_core KVEngine, got {type(obj).__name__}")


def registry_key(text: str) -> str:
    """The registry key of a rendered document: kvboost_rag's ``doc_key`` (xxh3-128 hex of the UTF-8 text)."""
    try:
        from kvboost_rag.registry import doc_key
    except ImportError:  # the registry is not importable: the same digest, computed here
        import xxhash

        return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))
    return doc_key(text)


def _model_name(engine: KVEngine) -> str:
    cfg = getattr(engine.model, "config", None)
    return str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or "kvboost")


# ---------------------------------------------------------------------------------------------------- the LLM
class KVBoostLLM(StructuredOutput, ToolCalling, FunctionCallingLLM, CustomLLM):
    """A local HuggingFace model behind kvboost: warmed documents' KV is reused wherever they appear in a prompt.

    Build it with ``KVBoostLLM.from_model_id(path, **engine_kwargs)`` or ``KVBoostLLM(engine=KVEngine(...))``.
    Warm documents with :meth:`warm_documents` or a :class:`KVWarmer` at the end of an ingestion pipeline; any
    stock query engine then reuses their KV. ``last_stats`` tells how much was reused by the last call.
    Structured output (``structured_predict`` and its async/streaming variants) is constrained JSON: see
    :class:`~llama_index.llms.kvboost._structured.StructuredOutput`.
    """

    model_name: str = Field(default="kvboost", description="Name reported in the LLM metadata.")
    max_new_tokens: int = Field(default=256, gt=0, description="Maximum number of tokens generated per call "
                                "(reported as num_output to the synthesizers).")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (temperature > 0).")
    seed: int | None = Field(default=None, description="Seed of the sampler (temperature > 0).")
    stop: list[str] | None = Field(default=None, description="Strings that end generation when produced.")
    repair: str | None = Field(default=None, description="KV repair strategy per call: 'none', 'selective', "
                               "'cacheblend' or 'full' (exact); None uses the engine's configuration.")
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0, description="CacheBlend recompute "
                                          "ratio per call; None uses the engine's configuration.")
    context_window: int | None = Field(default=None, gt=0, description="Context window reported to LlamaIndex; "
                                       "None reports the model's max_position_embeddings. Must not exceed it.")
    is_chat_model: bool = Field(default=False, description="Report a chat model: synthesizers then send chat "
                                "messages, rendered with the tokenizer's chat template.")
    engine_call_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra per-call engine options "
                                               "(select, check_layer, store_prefix, add_special_tokens).")
    auto_warm: bool = Field(default=False, description="Warm retrieved nodes that were not warmed yet after the "
                            "call that used them, so the next query reuses their KV (misses are logged "
                            "either way).")
    exact_turns: bool = Field(default=False, description="chat/stream_chat: compute every turn exactly "
                              "(documents never re-placed), so a follow-up waits for no backfill; a chat's first "
                              "turn then costs a full prefill.")
    is_function_calling_model: bool | None = Field(default=None, description="Report a function-calling model "
                                                   "(FunctionAgent, predict_and_call); None: whenever chat calls "
                                                   "with tools render with the tokenizer's chat template.")
    stopping_ids: list[int] | None = Field(default=None, description="Token ids that end a generation, kept in "
                                           "the output (HuggingFaceLLM's); forced calls and JSON end by grammar.")

    _rag: Any = PrivateAttr(default=None)
    _template_chat: bool = PrivateAttr(default=True)

    def __init__(self, engine: KVEngine | KVBoostRAG | None = None, *, rag: KVBoostRAG | None = None,
                 transparent: bool = True, preserve_order: bool = False, **kwargs: Any) -> None:
        for alias, name in _FIELD_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"{alias}= repeats {name}= (two spellings of one option); pass one of them")
                kwargs[name] = kwargs.pop(alias)
        loading = sorted(set(kwargs) & set(_LOADING))
        if loading:
            raise TypeError(f"{loading} configure loading; this KVBoostLLM wraps a loaded engine: pass them to "
                            "KVBoostLLM.from_model_id(model_id, ...) instead")
        # HuggingFaceLLM's generate_kwargs, mapped to the fields with the same meaning (explicit fields win)
        kwargs = {**pipeline_options(None, kwargs.pop("generate_kwargs", None), budget_name="max_new_tokens",
                                     source="generate_kwargs"), **kwargs}
        if kwargs.get("stopping_ids") is not None:
            kwargs["stopping_ids"] = list(stop_token_ids(kwargs["stopping_ids"]))
        if (engine is None) == (rag is None):
            raise TypeError("KVBoostLLM needs exactly one of engine= (a kvboost_core KVEngine or a KVBoostRAG) or "
                            "rag=; or build it with KVBoostLLM.from_model_id(model_id, ...)")
        the_rag = _as_rag(rag if rag is not None else engine,
                          RAGOptions(transparent=transparent, preserve_order=preserve_order))
        unknown = set(kwargs.get("engine_call_kwargs") or {}) - _CALL_OPTIONS
        if unknown:
            raise TypeError(f"unknown engine_call_kwargs {sorted(unknown)}; allowed: {sorted(_CALL_OPTIONS)}")
        kwargs.setdefault("model_name", _model_name(the_rag.engine))
        template_chat = kwargs.get("messages_to_prompt") is None
        super().__init__(**kwargs)
        self._rag = the_rag
        the_rag.options = the_rag.options.switched_on(auto_warm=self.auto_warm, exact_turns=self.exact_turns)
        self._template_chat = template_chat
        watch_retrievals()  # retrieved nodes become visible, so unwarmed ones are reported
        real = self._model_context()
        if self.context_window is not None and real and self.context_window > real:
            raise ValueError(f"context_window={self.context_window} exceeds the model's context "
                             f"of {real} tokens")

    @classmethod
    def from_model_id(cls, model_id: str, *, device: Any = None, dtype: Any = None, device_map: Any = None,
                      model_kwargs: dict | None = None, tokenizer_name: str | None = None,
                      transparent: bool = True, preserve_order: bool = False, task: str | None = None,
                      pipeline_kwargs: dict | None = None, generate_kwargs: dict | None = None,
                      **kwargs: Any) -> KVBoostLLM:
        """Load a local HuggingFace model. Keyword arguments naming a field of this class (``max_new_tokens``
        or its alias ``max_tokens``, ``repair``, ``stopping_ids``, ...) configure the LLM;
        ``task``/``pipeline_kwargs`` and HuggingFaceLLM's ``generate_kwargs`` are mapped as HF reads them
        (max_new_tokens, temperature, do_sample, top_p, seed, stop; anything else is refused with what to use
        instead); ``device`` (-1: the CPU, n: cuda:n), ``device_map`` (one device or "auto"), ``model_kwargs``
        and ``tokenizer_name`` load as in HF (:func:`kvboost_rag.rag.load_engine`); the others configure
        the engine (``chunk_size``, ``store``, ...) and are checked before the weights load."""
        spellings = {name: name for name in cls.model_fields} | _FIELD_ALIASES
        mapped = pipeline_options(task, pipeline_kwargs, budget_name="max_new_tokens")
        mapped |= pipeline_options(None, generate_kwargs, budget_name="max_new_tokens", source="generate_kwargs")
        llm_kw, engine_kw = split_model_kwargs(kwargs, spellings)
        llm_kw = {**mapped, **llm_kw}
        if llm_kw.get("stopping_ids") is not None:
            stop_token_ids(llm_kw["stopping_ids"])  # checked before the weights load
        rag = _rag_class().from_model_id(model_id, device=device, dtype=dtype, device_map=device_map,
                                         model_kwargs=model_kwargs, tokenizer_name=tokenizer_name,
                                         options=RAGOptions(transparent=transparent, preserve_order=preserve_order),
                                         owner="KVBoostLLM",
                                         **engine_kw)
        llm_kw.setdefault("model_name", model_id)
        return cls(rag=rag, **llm_kw)

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostLLM"

    # -- handles ------------------------------------------------------------------------------------------
    @property
    def rag(self) -> KVBoostRAG:
        return self._rag

    @property
    def engine(self) -> KVEngine:
        return self._rag.engine

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last call's prefill statistics (``reuse_ratio``, ``doc_tokens``, ``doc_tokens_reused``, ``ttft_s``...)."""
        return dict(self._rag.last_stats or {})

    def warm_documents(self, docs: Any, *, batch_size: int = 8, show_progress: bool | None = None,
                       progress: bool | None = None) -> Any:
        """Warm strs, LangChain Documents or LlamaIndex nodes (rendered with MetadataMode.LLM). Idempotent.
        ``show_progress`` (alias ``progress``): None shows a bar on a terminal only."""
        return self._rag.warm_documents(docs, batch_size=batch_size, show_progress=show_progress,
                                        progress=progress)

    def _model_context(self) -> int:
        return int(self._rag.context_window or 0)

    @property
    def metadata(self) -> LLMMetadata:
        ctx = self.context_window or self._model_context()
        calling = self.is_function_calling_model
        if calling is None:  # tools work whenever they render: in the template's tools section or a system message
            calling = self._template_chat and self._rag.can_call_tools()
        return LLMMetadata(context_window=ctx, num_output=self.max_new_tokens, model_name=self.model_name,
                           is_chat_model=self.is_chat_model, is_function_calling_model=calling)

    # -- completion ---------------------------------------------------------------------------------------
    def _call_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Instance defaults with per-call overrides, by the rule both skins share
        (:func:`kvboost_rag.options.merge_call_options`), the engine's options built into one ``CallOptions``
        (:func:`kvboost_rag.options.typed_call`)."""
        defaults: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                    "top_p": self.top_p, "stop": self.stop, "seed": self.seed}
        defaults |= {k: getattr(self, k) for k in ("repair", "recompute_ratio") if getattr(self, k) is not None}
        merged = merge_call_options({**defaults, **self.engine_call_kwargs}, kwargs, CALL_KEYS, owner="KVBoostLLM")
        return typed_call(self._rag, merged)

    def _full_prompt(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if formatted:
            return prompt
        prompt = self.completion_to_prompt(prompt) if self.completion_to_prompt else prompt
        return f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt

    def _free_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A free (unconstrained) generation's options: the call's, and the stop tokens."""
        call_kw = self._call_kwargs(kwargs)
        if self.stopping_ids:
            from kvboost_rag.rag import StopOnTokens

            call_kw["logits_processor"] = StopOnTokens(self.stopping_ids)
        return call_kw

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any],
                  history: str | None = None) -> CompletionResponse:
        return completion(self._rag.generate(self._full_prompt(prompt, formatted), chat_history=history,
                                             **self._free_kwargs(kwargs)))

    def _stream(self, prompt: str, formatted: bool, kwargs: dict[str, Any],
                history: str | None = None) -> CompletionResponseGen:
        full = self._full_prompt(prompt, formatted)
        call_kw, done = self._free_kwargs(kwargs), {}  # validated now, before the caller iterates
        return stream_completions(self._rag.stream(full, on_result=keeper(done), chat_history=history, **call_kw), done)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(prompt, formatted, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await run_blocking(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        gen = self._stream(prompt, formatted, kwargs)

        async def agen() -> CompletionResponseAsyncGen:
            async for item in aiter_in_thread(lambda: gen):
                yield item

        return agen()

    # -- chat: through the tokenizer's chat template (tools: see _tools) ---------------------------------------
    def _chat_prompt(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None) -> str:
        if not self._template_chat:
            if tools:
                raise ValueError("tools need the tokenizer's chat template; this KVBoostLLM has messages_to_prompt")
            return self.messages_to_prompt(messages)
        return self._rag.chat_prompt(*chat_inputs(self._rag.tokenizer, tool_chat_dicts(messages), tools))

    def _chat_kwargs(self, prompt: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        # A template that writes BOS itself must not get a second one (as apply_chat_template(tokenize=True)).
        if self._template_chat and "add_special_tokens" not in kwargs:
            return {**kwargs, "add_special_tokens": self._rag.chat_add_special_tokens(prompt)}
        return kwargs

    def _chat_call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
                   ) -> tuple[str, dict[str, Any], ToolRequest | None, str]:
        """(prompt, per-call options, the tools and whether a call is forced, the history: see chat_history)."""
        kwargs = dict(kwargs)
        req = tool_request(kwargs.pop("tools", None), kwargs.pop("tool_choice", None),
                           kwargs.pop("parallel_tool_calls", False))
        tools = req.tools if req else None
        prompt = self._chat_prompt(messages, tools)
        history = chat_history(self._rag, messages, tools, None if self._template_chat else self.messages_to_prompt)
        return prompt, self._chat_kwargs(prompt, kwargs), req, history

    def _forced(self, prompt: str, call_kw: dict[str, Any], req: ToolRequest, history: str) -> ChatResponse:
        """A forced call, constrained by grammar to a valid call of an allowed tool."""
        from kvboost_rag.constrained import generate_tool_call

        call_kw = self._call_kwargs(call_kw)
        call_kw.pop("stop", None)  # a stop string would cut the call short
        res, text = generate_tool_call(self._rag, prompt, req.tools, req.name, calls=max_calls(req.parallel),
                                       chat_history=history, **call_kw)
        return with_tool_calls(ChatResponse(message=ChatMessage(role="assistant", content=text), raw=raw(res),
                                            additional_kwargs=stats_kwargs(res)), req.parallel)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        prompt, call_kw, req, history = self._chat_call(messages, kwargs)
        if req is not None and req.forced:
            return self._forced(prompt, call_kw, req, history)
        resp = to_chat(self._complete(prompt, True, call_kw, history))
        return with_tool_calls(resp, req.parallel) if req is not None else resp

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        prompt, call_kw, req, history = self._chat_call(messages, kwargs)
        if req is None:
            return to_chat_stream(self._stream(prompt, True, call_kw, history))
        if req.forced:  # a forced call is no text: one response, with the call (generated when iterated)
            self._call_kwargs(call_kw)  # validated now, before the caller iterates
            return (self._forced(prompt, call_kw, req, history) for _ in range(1))
        return stream_with_tool_calls(self._stream(prompt, True, call_kw, history), req.parallel)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await run_blocking(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        gen = self._stream_chat(messages, kwargs)  # validated now, before the caller iterates

        async def agen() -> ChatResponseAsyncGen:
            async for item in aiter_in_thread(lambda: gen):
                yield item

        return agen()


__all__ = ["KVBoostLLM", "registry_key", "render_node"]

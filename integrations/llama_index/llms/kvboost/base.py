"""LlamaIndex skin over :class:`kvboost_rag.adapter.KVBoostRAG`.

- :class:`KVBoostLLM` — a ``CustomLLM`` whose prompts reuse the KV of warmed documents (transparently: the
  synthesizer's flat prompt is searched for warmed document texts).
- :class:`KVWarmer` — the last transform of an ``IngestionPipeline``: warms every node's LLM rendering.
- :class:`StableOrderPostprocessor` — sorts retrieved nodes by the registry key of their rendering, so the same
  document set always yields the same prompt (exact prefix hits).

No engine logic lives here: everything is delegated to ``KVBoostRAG``.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

_HINT = "pip install 'kvboost-rag[llamaindex]'"

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TransformComponent
except ImportError as exc:  # pragma: no cover - exercised only without llama-index installed
    raise ImportError(f"llama_index.llms.kvboost needs llama-index-core: {_HINT}") from exc

if TYPE_CHECKING:
    from kvboost_core.engine import KVEngine
    from kvboost_rag.adapter import KVBoostRAG

# Per-call engine options complete()/stream_complete() accept as keyword arguments.
_CALL_OPTIONS = frozenset({"max_new_tokens", "temperature", "top_p", "stop", "seed", "repair", "recompute_ratio",
                           "select", "check_layer", "add_special_tokens", "store_prefix", "kv_documents"})


# ---------------------------------------------------------------------------------------------------- helpers
def _rag_class() -> type[KVBoostRAG]:
    try:
        from kvboost_rag.adapter import KVBoostRAG
    except ImportError as exc:
        raise ImportError(f"kvboost_rag.adapter is not importable ({exc}); reinstall kvboost-rag: {_HINT}") from exc
    return KVBoostRAG


def _as_rag(obj: Any, *, transparent: bool = True, preserve_order: bool = False) -> KVBoostRAG:
    """A KVBoostRAG from a KVBoostRAG, a KVEngine or a KVBoostLLM."""
    if isinstance(obj, KVBoostLLM):
        return obj.rag
    cls = _rag_class()
    if isinstance(obj, cls):
        return obj
    from kvboost_core.engine import KVEngine

    if isinstance(obj, KVEngine):
        return cls(obj, transparent=transparent, preserve_order=preserve_order)
    raise TypeError(f"expected a KVBoostLLM, a KVBoostRAG or a kvboost_core KVEngine, got {type(obj).__name__}")


def render_node(node: BaseNode | NodeWithScore) -> str:
    """The text a response synthesizer puts in the prompt for ``node`` (``get_content(MetadataMode.LLM)``)."""
    if isinstance(node, NodeWithScore):
        node = node.node
    return node.get_content(metadata_mode=MetadataMode.LLM)


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


class _StoreTokens:
    """An identity token per KV store instance, renewed when the store may have lost warmed entries.

    ``IngestionPipeline`` caches a transform's output under a hash of the nodes and ``transform.to_dict()``;
    :class:`KVWarmer` puts this token in its ``to_dict()`` so a cached result is only reused for the very store
    it warmed, and only while that store has not evicted or dropped entries since.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._by_id: dict[int, tuple[Any, dict[str, Any]]] = {}  # stores that refuse weak references

    def _state(self, store: Any) -> dict[str, Any]:
        try:
            st = self._weak.get(store)
            if st is None:
                st = self._weak[store] = {"token": uuid.uuid4().hex, "entries": 0, "evictions": 0}
            return st
        except TypeError:
            ref, st = self._by_id.get(id(store), (None, None))
            if ref is not store or st is None:
                st = {"token": uuid.uuid4().hex, "entries": 0, "evictions": 0}
                self._by_id[id(store)] = (store, st)
            return st

    @staticmethod
    def _counts(store: Any) -> tuple[int, int]:
        try:
            s = store.stats()
        except Exception:  # a store without stats: never trust the cache
            return -1, -1
        return int(s.get("entries", 0) or 0), int(s.get("evictions", 0) or 0)

    def token(self, store: Any) -> str:
        with self._lock:
            st = self._state(store)
            entries, evictions = self._counts(store)
            if entries < 0 or entries < st["entries"] or evictions > st["evictions"]:
                st["token"] = uuid.uuid4().hex  # entries were lost (evicted, cleared): warm again
            st["entries"], st["evictions"] = max(entries, 0), max(evictions, 0)
            return st["token"]

    def warmed(self, store: Any) -> None:
        with self._lock:
            st = self._state(store)
            entries, evictions = self._counts(store)
            if evictions > st["evictions"]:  # the warm itself evicted: the next run must warm again
                st["token"] = uuid.uuid4().hex
            st["entries"], st["evictions"] = max(entries, 0), max(evictions, 0)


_STORE_TOKENS = _StoreTokens()


# ---------------------------------------------------------------------------------------------------- the LLM
class KVBoostLLM(CustomLLM):
    """A local HuggingFace model behind kvboost: warmed documents' KV is reused wherever they appear in a prompt.

    Build it with ``KVBoostLLM.from_model_id(path, **engine_kwargs)`` or ``KVBoostLLM(engine=KVEngine(...))``.
    Warm documents with :meth:`warm_documents` or a :class:`KVWarmer` at the end of an ingestion pipeline; any
    stock query engine then reuses their KV. ``last_stats`` tells how much was reused by the last call.
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

    _rag: Any = PrivateAttr(default=None)
    _template_chat: bool = PrivateAttr(default=True)

    def __init__(self, engine: KVEngine | KVBoostRAG | None = None, *, rag: KVBoostRAG | None = None,
                 transparent: bool = True, preserve_order: bool = False, **kwargs: Any) -> None:
        if (engine is None) == (rag is None):
            raise TypeError("KVBoostLLM needs exactly one of engine= (a kvboost_core KVEngine or a KVBoostRAG) or "
                            "rag=; or build it with KVBoostLLM.from_model_id(model_id, ...)")
        the_rag = _as_rag(rag if rag is not None else engine, transparent=transparent,
                          preserve_order=preserve_order)
        unknown = set(kwargs.get("engine_call_kwargs") or {}) - _CALL_OPTIONS
        if unknown:
            raise TypeError(f"unknown engine_call_kwargs {sorted(unknown)}; allowed: {sorted(_CALL_OPTIONS)}")
        kwargs.setdefault("model_name", _model_name(the_rag.engine))
        template_chat = kwargs.get("messages_to_prompt") is None
        super().__init__(**kwargs)
        self._rag = the_rag
        self._template_chat = template_chat
        real = self._model_context()
        if self.context_window is not None and real and self.context_window > real:
            raise ValueError(f"context_window={self.context_window} exceeds the model's context "
                             f"of {real} tokens")

    @classmethod
    def from_model_id(cls, model_id: str, *, device: str | None = None, dtype: Any = None,
                      transparent: bool = True, preserve_order: bool = False, **kwargs: Any) -> KVBoostLLM:
        """Load a local HuggingFace model. Keyword arguments naming a field of this class (``max_new_tokens``,
        ``repair``, ...) configure the LLM; the others configure the engine (``chunk_size``, ``store``, ...)."""
        fields = set(cls.model_fields)
        llm_kw = {k: v for k, v in kwargs.items() if k in fields}
        engine_kw = {k: v for k, v in kwargs.items() if k not in fields}
        rag = _rag_class().from_model_id(model_id, device=device, dtype=dtype, transparent=transparent,
                                         preserve_order=preserve_order, **engine_kw)
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

    def warm_documents(self, docs: Any, *, batch_size: int = 8, progress: bool = False) -> Any:
        """Warm strs, LangChain Documents or LlamaIndex nodes (rendered with MetadataMode.LLM). Idempotent."""
        return self._rag.warm_documents(docs, batch_size=batch_size, progress=progress)

    def _model_context(self) -> int:
        return int(self._rag.context_window or 0)

    @property
    def metadata(self) -> LLMMetadata:
        ctx = self.context_window or self._model_context()
        return LLMMetadata(context_window=ctx, num_output=self.max_new_tokens, model_name=self.model_name,
                           is_chat_model=self.is_chat_model)

    # -- completion ---------------------------------------------------------------------------------------
    def _call_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - _CALL_OPTIONS
        if unknown:
            raise TypeError(f"KVBoostLLM got unexpected keyword arguments {sorted(unknown)}; per-call options are "
                            f"{sorted(_CALL_OPTIONS)}")
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                               "top_p": self.top_p, "stop": self.stop, "seed": self.seed}
        if self.repair is not None:
            out["repair"] = self.repair
        if self.recompute_ratio is not None:
            out["recompute_ratio"] = self.recompute_ratio
        out.update(self.engine_call_kwargs)
        out.update(kwargs)
        return out

    def _full_prompt(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if formatted:
            return prompt
        prompt = self.completion_to_prompt(prompt) if self.completion_to_prompt else prompt
        return f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self._rag.generate(self._full_prompt(prompt, formatted), **self._call_kwargs(kwargs))
        raw = {"finish_reason": result.finish_reason, "ttft_s": result.ttft_s, "total_s": result.total_s,
               "reuse_ratio": result.reuse_ratio, "token_ids": list(result.token_ids),
               "prompt_tokens": len(result.prompt_token_ids), "stats": self.last_stats}
        return CompletionResponse(text=result.text, raw=raw)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        full = self._full_prompt(prompt, formatted)
        call_kw = self._call_kwargs(kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in self._rag.stream(full, **call_kw):
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()

    # -- chat: through the tokenizer's chat template ----------------------------------------------------------
    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        if not self._template_chat:
            return self.messages_to_prompt(messages)
        rendered = [{"role": m.role.value if hasattr(m.role, "value") else str(m.role), "content": m.content or ""}
                    for m in messages]
        return self._rag.chat_prompt(rendered)

    def _chat_kwargs(self, prompt: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        # A template that writes BOS itself must not get a second one (as apply_chat_template(tokenize=True)).
        if self._template_chat and "add_special_tokens" not in kwargs:
            return {**kwargs, "add_special_tokens": self._rag.chat_add_special_tokens(prompt)}
        return kwargs

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        from llama_index.core.base.llms.generic_utils import completion_response_to_chat_response

        prompt = self._chat_prompt(messages)
        return completion_response_to_chat_response(self.complete(prompt, formatted=True,
                                                                  **self._chat_kwargs(prompt, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        from llama_index.core.base.llms.generic_utils import stream_completion_response_to_chat_response

        prompt = self._chat_prompt(messages)
        gen = self.stream_complete(prompt, formatted=True, **self._chat_kwargs(prompt, kwargs))
        return stream_completion_response_to_chat_response(gen)


# ---------------------------------------------------------------------------------------------------- ingestion
class KVWarmer(TransformComponent):
    """Last step of an ``IngestionPipeline``: warms each node's KV and returns the nodes unchanged.

    Nodes are rendered with ``MetadataMode.LLM``, exactly as the response synthesizers put them in prompts.
    The pipeline's transform cache cannot skip warming a store that lacks the nodes: the cache key
    (``to_dict()``) carries an identity token of the engine's KV store, renewed when the store loses entries.
    """

    batch_size: int = Field(default=8, gt=0, description="Documents warmed per batch.")
    show_progress: bool = Field(default=False, description="Show a progress bar while warming.")

    _rag: Any = PrivateAttr(default=None)
    _last_report: Any = PrivateAttr(default=None)

    def __init__(self, llm: KVBoostLLM | KVBoostRAG | KVEngine, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rag = _as_rag(llm)

    @classmethod
    def class_name(cls) -> str:
        return "KVWarmer"

    @property
    def last_report(self) -> Any:
        """The ``WarmReport`` of the last call (None before the first)."""
        return self._last_report

    def _store(self) -> Any:
        return self._rag.engine.store

    def to_dict(self, **kwargs: Any) -> dict[str, Any]:
        data = super().to_dict(**kwargs)
        data["kv_store_token"] = _STORE_TOKENS.token(self._store())
        data["kv_fingerprint"] = str(self._rag.engine.fingerprint)
        data["kv_namespace"] = self._rag.engine.config.namespace
        return data

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = [render_node(n) for n in nodes]
        texts = [t for t in texts if t.strip()]
        if texts:
            self._last_report = self._rag.warm_documents(texts, batch_size=self.batch_size,
                                                         progress=self.show_progress)
            _STORE_TOKENS.warmed(self._store())
        return nodes


# ---------------------------------------------------------------------------------------------------- retrieval
class StableOrderPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes by the registry key of their rendered text (xxh3 of ``get_content(LLM)``).

    The same set of documents then always yields the same prompt, so a repeated document set is an exact
    prefix hit. Put it last in ``node_postprocessors`` (after any reranker/cut-off that depends on scores).
    """

    @classmethod
    def class_name(cls) -> str:
        return "StableOrderPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return sorted(nodes, key=lambda n: registry_key(render_node(n)))


__all__ = ["KVBoostLLM", "KVWarmer", "StableOrderPostprocessor", "registry_key", "render_node"]

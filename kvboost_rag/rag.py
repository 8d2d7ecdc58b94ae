"""KVBoostRAG: the one object framework integrations wrap.

Two ways to tell the engine where documents are:

- transparent (default): the chain hands us a flat prompt string. We tokenize it exactly as a plain HF
  wrapper would (``tokenizer(prompt)``), find registered documents in the string, and cut the prompt's own
  ids into plain and document segments. The ids the model sees never change (zero prompt drift); only where
  the KV comes from does.
- explicit: ``kv_documents=[...]`` gives the documents; they are laid out in a stable order with exact
  boundaries, each its own cacheable segment, followed by the prompt.

Misses are never silent: retrieved documents in a prompt that were not warmed (see :mod:`kvboost_rag.misses`
for what is detectable) are counted in ``last_stats["documents_not_warmed"]``, logged (rate-limited), and
with ``auto_warm=True`` warmed after the call so the next query reuses them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvboost_core import GenerationResult, KVEngine, Segment, StopGeneration, cache_counts
from kvboost_core.call_options import CallOptions
from kvboost_core.chunking import common_prefix
from kvboost_core.segments import check_utf8, lead_token_ids
from kvboost_rag.chat_turns import check_chat_messages, history_messages, turn_end_text
from kvboost_rag.documents import document_texts
from kvboost_rag.locate import align
from kvboost_rag.misses import MissWarning, unwarmed_in_prompt
from kvboost_rag.options import RAGOptions, check_engine_kwargs, load_device, model_kwargs_of
from kvboost_rag.registry import DocumentRegistry, RegisteredDoc, assemble, doc_key
from kvboost_rag.reports import (  # noqa: F401  (re-exported: the per-call reports live apart, torch-free)
    CALL_INFO_KEYS,
    call_info,
    openai_finish_reason,
    usage_counts,
)
from kvboost_rag.toolcalls import chat_inputs
from kvboost_rag.warming import WarmReport, warm_documents

# A tool to render in can_call_tools' probe.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(slots=True)
class PromptPlan:
    """What ``KVBoostRAG.plan`` made of a prompt: the segments the engine gets (warmed documents marked
    cacheable, the rest plain text) and the document accounting that ``last_stats`` reports."""

    segments: list[Segment]
    doc_ranges: list[tuple[int, int]]  # prompt token ranges attributed to documents
    mode: str  # "transparent", "explicit" or "plain"
    documents: int = 0  # documents found (transparent) or given (explicit)
    extra: dict[str, Any] = field(default_factory=dict)  # more stats for last_stats (transparent: confirmations)
    unwarmed: list[str] = field(default_factory=list)  # retrieved/given documents in the prompt not warmed


def doc_stats(ranges: Sequence[tuple[int, int]], stats: dict[str, Any]) -> dict[str, int]:
    """Per-prompt document accounting from the engine's counters, exact and approximate reuse told apart as
    :class:`kvboost_core.CacheCounts` defines them (``cached_tokens`` / ``cached_tokens_approximate``).

    Prefix positions are [0, hits_exact) (exact) then [hits_exact, hits_exact + hits_repaired) (an earlier
    repaired prefill's KV, approximate, served only when the engine stores them) and are never recomputed;
    content hits (re-placed KV) happen only inside cacheable segments, i.e. documents.

    - ``doc_tokens``: prompt tokens attributed to documents.
    - ``doc_tokens_reused``: of those, served from the cache (a prefix hit or re-placed document KV).
    - ``doc_tokens_recomputed``: of the reused, recomputed by repair (all of them under ``repair="full"``,
      about ``recompute_ratio`` under CacheBlend).
    - ``doc_tokens_kept``: reused and used as is (``reused - recomputed``): the compute actually saved. It is
      ``doc_tokens_cached`` (exact: a prefix hit, or a block adapter's own prefill) plus
      ``doc_tokens_approximate`` (re-placed or repaired KV kept without recompute).
    """
    counts = cache_counts(stats)
    exact_end = int(stats.get("hits_exact", 0))
    prefix_end = exact_end + int(stats.get("hits_repaired", 0))
    in_exact = sum(max(0, min(b, exact_end) - a) for a, b in ranges)
    in_repaired = sum(max(0, min(b, prefix_end) - max(a, exact_end)) for a, b in ranges)
    content = int(stats.get("hits_content", 0))
    cached, approx = in_exact + counts.replaced_cached, in_repaired + counts.replaced_approximate
    return {"doc_tokens": sum(b - a for a, b in ranges), "doc_tokens_reused": in_exact + in_repaired + content,
            "doc_tokens_recomputed": content - counts.replaced_cached - counts.replaced_approximate,
            "doc_tokens_kept": cached + approx, "doc_tokens_cached": cached, "doc_tokens_approximate": approx}


class KVBoostRAG:
    """Document warming, transparent/explicit document reuse and generation over one ``KVEngine``."""

    def __init__(self, engine: KVEngine, options: RAGOptions | None = None, **changes: Any) -> None:
        """``options`` (:class:`kvboost_rag.options.RAGOptions`), or its fields as keywords (``transparent``,
        ``preserve_order``, ``separator``, ``auto_warm``, ``miss_warning_interval_s``), which override it."""
        if not isinstance(engine, KVEngine):
            raise TypeError(f"engine must be a kvboost_core KVEngine, got {type(engine).__name__}; build one "
                            "with KVEngine(model, tokenizer) or use KVBoostRAG.from_model_id(...)")
        if options is not None and not isinstance(options, RAGOptions):
            raise TypeError(f"options must be a kvboost_rag.options.RAGOptions, got {type(options).__name__}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.options = (options or RAGOptions()).with_(**changes)
        self._miss_warning = MissWarning(self.options.miss_warning_interval_s)
        self.registry = DocumentRegistry()
        self.last_stats: dict[str, Any] = {}
        self.last_result: GenerationResult | None = None
        # Share the engine's tokenizer lock: HF fast tokenizers are not safe to call concurrently.
        self._tok_lock = getattr(engine, "tokenizer_lock", None) or threading.Lock()
        self._offsets = bool(getattr(self.tokenizer, "is_fast", False))  # slow tokenizers give no offsets
        self._lead = tuple(lead_token_ids(self.tokenizer))
        self._tools_probe: dict[str, bool] = {}  # chat template -> whether tools render (can_call_tools)
        self._turn_ends: dict[str, tuple[int, ...]] = {}  # chat template -> chat_turn_end()

    @classmethod
    def from_model_id(cls, model_id: str, *, device: Any = None, dtype: Any = None, device_map: Any = None,
                      model_kwargs: dict | None = None, tokenizer_name: str | None = None,
                      options: RAGOptions | None = None, **kwargs: Any) -> KVBoostRAG:
        """Load a HuggingFace causal LM (a hub id or a local path) and wrap it (see :func:`load_engine`).
        Keywords naming a :class:`RAGOptions` field set it (over ``options``); the others configure the engine."""
        changes = {k: kwargs.pop(k) for k in RAGOptions.names() & set(kwargs)}
        rag_options = (options or RAGOptions()).with_(**changes)  # checked before the weights load
        engine = load_engine(model_id, device=device, dtype=dtype, device_map=device_map,
                             model_kwargs=model_kwargs, tokenizer_name=tokenizer_name, **kwargs)
        return cls(engine, rag_options)

    # ------------------------------------------------------------------ tokenizer
    def _tokenize(self, text: str, add_special_tokens: bool, offsets: bool
                  ) -> tuple[list[int], list[tuple[int, int]] | None]:
        with self._tok_lock:
            if offsets and self._offsets:
                enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
                return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), None

    def _encode_doc(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        return self._tokenize(text, False, True)

    def _encode(self, text: str) -> list[int]:
        return self._tokenize(text, False, False)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenize(text, add_special_tokens, False)[0]

    def token_ids(self, text: str) -> list[int]:
        """Ids as a plain HF wrapper computes them: ``tokenizer(text).input_ids`` (BOS included for Llama)."""
        return self.encode(text, True)

    def count_tokens(self, text: str) -> int:
        return len(self.token_ids(text))

    @property
    def context_window(self) -> int:
        return int(getattr(self.engine.model.config, "max_position_embeddings", 0) or 0)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's rendering of ``messages`` (and of ``tools``, OpenAI-style function schemas,
        for templates that support them) followed by the assistant's generation prompt. Each message is checked
        first (:func:`check_chat_messages`)."""
        check_chat_messages(messages)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template or use the "
                             "completion interface (generate/KVBoostLLM) instead")
        extra = {"tools": tools} if tools else {}
        with self._tok_lock:
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          **extra))

    def chat_history(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat's history as ``chat_prompt`` renders it: the messages up to the end of the last assistant
        message, without a generation prompt ("" before the first answer). Pass it as ``chat_history=`` to
        :meth:`generate`/:meth:`stream` to make the call a chat turn (see :mod:`kvboost_core.engine.exact_history`)."""
        n = history_messages(messages)
        if not n:
            return ""
        extra = {"tools": tools} if tools else {}
        with self._tok_lock:
            return str(self.tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=False,
                                                          **extra))

    def chat_turn_end(self) -> tuple[int, ...]:
        """The token ids the chat template writes after an assistant message's text (``<|im_end|>\n``): the
        backfill appends them to the answer, so it stores the next turn's history as the template renders it."""
        template = str(getattr(self.tokenizer, "chat_template", None) or "")
        if template not in self._turn_ends:
            text = turn_end_text(self.chat_history) if template else ""
            self._turn_ends[template] = tuple(self._encode(text)) if text else ()
        return self._turn_ends[template]

    def chat_turn(self, plan: PromptPlan, chat_history: str | None, special: bool) -> dict[str, Any]:
        """The engine options that make a call over ``plan`` a chat turn whose history renders as
        ``chat_history`` (:meth:`chat_history`): ``history_tokens`` and ``turn_end`` ({} for a completion)."""
        if chat_history is None:
            return {}
        if not isinstance(chat_history, str):
            raise TypeError(f"chat_history must be a str, got {type(chat_history).__name__}")
        ids = self.engine.tokenize_ids(plan.segments, add_special_tokens=False)  # the plan holds the lead
        if self.options.exact_turns:  # the whole prompt is read as history: exact, nothing re-placed
            return {"history_tokens": len(ids), "turn_end": self.chat_turn_end()}
        # the history's length in the prompt: the longest common prefix of the two (a template that renders a past
        # turn differently in the current prompt only shortens it)
        n = common_prefix(self.encode(chat_history, special), ids) if chat_history else 0
        return {"history_tokens": n, "turn_end": self.chat_turn_end()}

    def can_call_tools(self) -> bool:
        """Whether chat calls with tools render with this tokenizer: its template renders ``tools`` itself or
        takes them described in a system message (:func:`kvboost_rag.toolcalls.chat_inputs`). Probed by
        rendering once per template, since some templates refuse a system message."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            return False
        key = repr(template)
        if key not in self._tools_probe:
            probe = [{"role": "user", "content": "hi"}]
            try:
                self.chat_prompt(*chat_inputs(self.tokenizer, probe, [_PROBE_TOOL]))
                self._tools_probe[key] = True
            except Exception:  # noqa: BLE001 - a user template may raise anything (jinja, ValueError, ...)
                self._tools_probe[key] = False
        return self._tools_probe[key]

    def chat_add_special_tokens(self, prompt: str) -> bool:
        """Whether to add BOS when tokenizing a rendered chat prompt: not when the template wrote it already
        (HF's apply_chat_template(tokenize=True) tokenizes without special tokens for the same reason)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        return not (isinstance(bos, str) and bos and prompt.startswith(bos))

    # ------------------------------------------------------------------ warming
    def warm_documents(self, docs: Any, *, batch_size: int = 8, show_progress: bool | None = None,
                       progress: bool | None = None) -> WarmReport:
        """Warm and register strs, LangChain Documents or LlamaIndex nodes. Idempotent.

        ``show_progress``: None (default) shows a bar on a terminal and nothing otherwise; ``progress`` is
        the older name of the same option."""
        return warm_documents(self.engine, self.registry, self._encode_doc, docs, batch_size=batch_size,
                              show_progress=show_progress, progress=progress)

    def is_warm(self, text: str) -> bool:
        """Whether ``text`` (a rendered document) was warmed through this KVBoostRAG."""
        return self.registry.by_text(text) is not None

    # ------------------------------------------------------------------ prompt planning
    def _special(self, add_special_tokens: bool | None) -> bool:
        return self.engine.config.add_special_tokens if add_special_tokens is None else bool(add_special_tokens)

    def plan(self, prompt: str, *, kv_documents: Any = None, add_special_tokens: bool | None = None
             ) -> PromptPlan:
        """The segments the engine will get for ``prompt`` (see the module docstring for the two modes)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}; for chat messages use "
                            "chat_prompt(messages) first")
        check_utf8(prompt, "prompt")  # the tokenizer's own error is a bare TypeError
        special = self._special(add_special_tokens)
        if kv_documents is not None:
            return self._plan_explicit(prompt, kv_documents, special)
        return self._plan_transparent(prompt, special)

    def _plan_explicit(self, prompt: str, kv_documents: Any, special: bool) -> PromptPlan:
        docs: list[RegisteredDoc] = []
        unwarmed: list[str] = []
        for i, text in enumerate(document_texts(kv_documents)):
            check_utf8(text, f"kv_documents[{i}]")
            reg = self.registry.by_text(text)
            if reg is None and text:
                unwarmed.append(text)
            # A document never warmed still gets exact boundaries; its KV is simply computed this time.
            docs.append(reg if reg is not None else RegisteredDoc(doc_key(text), text, tuple(self._encode(text)),
                                                                   None))
        asm = assemble(docs, prompt, self._encode, lead=self._lead if special else (),
                       separator=self.options.separator, preserve_order=self.options.preserve_order)
        return PromptPlan(asm.segments, asm.doc_ranges, "explicit", documents=len(asm.doc_ranges),
                          unwarmed=list(dict.fromkeys(unwarmed)))

    def _plan_transparent(self, prompt: str, special: bool) -> PromptPlan:
        use = self.options.transparent and self._offsets and len(self.registry) > 0
        ids, offsets = self._tokenize(prompt, special, use)
        if not ids:
            raise ValueError("the prompt is empty after tokenization; pass non-empty text")
        unwarmed = unwarmed_in_prompt(prompt, self.is_warm) if self.options.transparent else []
        if not use or offsets is None:
            return PromptPlan([Segment(token_ids=ids)], [], "plain", unwarmed=unwarmed)
        matches = self.registry.index.find(prompt)
        aligned = align(ids, offsets, matches, self.registry.sources([m.key for m in matches]))
        return PromptPlan(aligned.segments, aligned.doc_ranges, "transparent", documents=len(aligned.doc_ranges),
                          extra={"confirmations": self.registry.index.last_confirmations}, unwarmed=unwarmed)

    # ------------------------------------------------------------------ generation
    def _record(self, result: GenerationResult, plan: PromptPlan, plan_s: float) -> dict[str, Any]:
        # Added to the result's own stats dict too, so a caller running calls concurrently can read its own.
        stats = result.stats
        # TTFT counts from this call's start: finding the documents in the prompt is part of it.
        stats["ttft_s"] = result.ttft_s + plan_s
        stats["plan_s"] = plan_s
        stats.update(doc_stats(plan.doc_ranges, stats))
        stats.update(mode=plan.mode, documents=plan.documents, output_tokens=len(result.token_ids),
                     documents_not_warmed=len(plan.unwarmed), **plan.extra)
        self.last_stats = dict(stats)
        self.last_result = result
        self._after_call(plan)
        return stats

    def _after_call(self, plan: PromptPlan) -> None:
        """Say so when documents missed; with ``auto_warm`` warm them so the next prompt reuses them."""
        if not plan.unwarmed:
            return
        # explicit: ``documents`` counts every given document; transparent: only the warmed ones found
        total = plan.documents if plan.mode == "explicit" else plan.documents + len(plan.unwarmed)
        self._miss_warning.report(len(plan.unwarmed), total, auto_warm=self.options.auto_warm)
        if self.options.auto_warm:
            self.warm_documents(plan.unwarmed, show_progress=False)

    def _prepare(self, prompt: str, kv_documents: Any, chat_history: str | None, options: CallOptions | None,
                 engine_kw: dict[str, Any]) -> tuple[PromptPlan, CallOptions, float]:
        """(the plan, the engine's options with the chat turn's history and no lead (the plan holds it), seconds)."""
        t0 = time.perf_counter()
        opts = self.engine.call_options(options, **engine_kw)
        plan = self.plan(prompt, kv_documents=kv_documents, add_special_tokens=opts.add_special_tokens)
        turn = self.chat_turn(plan, chat_history, self._special(opts.add_special_tokens))
        if turn and opts.chat:
            raise TypeError("pass chat_history= or history_tokens=, not both (chat_history= computes it)")
        return plan, replace(opts, add_special_tokens=False, **turn), time.perf_counter() - t0

    def generate(self, prompt: str, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, kv_documents: Any = None,
                 chat_history: str | None = None, call_options: CallOptions | None = None,
                 **engine_kw: Any) -> GenerationResult:
        """Generate a completion of ``prompt``. The engine's per-call options (repair, recompute_ratio,
        store_prefix, add_special_tokens, ...) come as keywords ``engine_kw``, or built once as ``call_options=``
        (:meth:`call_options`); ``logits_processor`` goes to the engine too. ``chat_history``
        (:meth:`chat_history`) makes it a chat turn: its history exact, backfilled for the next turn."""
        processor = engine_kw.pop("logits_processor", None)
        plan, opts, plan_s = self._prepare(prompt, kv_documents, chat_history, call_options, engine_kw)
        result = self.engine.generate(plan.segments, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, stop=stop, seed=seed, logits_processor=processor, options=opts)
        self._record(result, plan, plan_s)
        return result

    def stream(self, prompt: str, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               stop: str | Sequence[str] | None = None, seed: int | None = None, kv_documents: Any = None,
               on_result: Callable[[GenerationResult, dict[str, Any]], None] | None = None,
               chat_history: str | None = None, call_options: CallOptions | None = None,
               **engine_kw: Any) -> Iterator[str]:
        """Yield text pieces; ``last_stats``/``last_result`` are set once the stream is exhausted, and
        ``on_result(result, stats)`` is called with this stream's own result (safe under concurrency).
        ``chat_history``, ``call_options`` and ``engine_kw``: as in :meth:`generate`."""
        processor = engine_kw.pop("logits_processor", None)
        plan, opts, plan_s = self._prepare(prompt, kv_documents, chat_history, call_options, engine_kw)
        stream = self.engine.stream(plan.segments, max_new_tokens, temperature, top_p, stop, seed,
                                    logits_processor=processor, options=opts)
        yield from stream
        if stream.result is not None:
            stats = self._record(stream.result, plan, plan_s)
            if on_result is not None:
                on_result(stream.result, stats)

    def call_options(self, **engine_kw: Any) -> CallOptions:
        """``engine_kw`` as one checked value for ``call_options=`` (:meth:`KVEngine.call_options`)."""
        return self.engine.call_options(**engine_kw)


def load_engine(model_id: str, *, device: Any = None, dtype: Any = None, device_map: Any = None,
                model_kwargs: dict | None = None, tokenizer_name: str | None = None, owner: str = "KVBoostRAG",
                **engine_kwargs: Any) -> KVEngine:
    """``KVEngine.from_pretrained`` with the keywords HF's wrappers take, all checked before the weights load.

    ``device``: a str, a ``torch.device``, or an int as in HF pipelines (-1: the CPU, n: ``cuda:n``);
    ``device_map``: "auto" (cuda when available, else the CPU) or one device (a map splitting the model over
    devices is refused: the KV cache is assembled on one); ``model_kwargs`` go to ``from_pretrained`` over
    kvboost's defaults (``dtype``/``torch_dtype`` and ``attn_implementation`` included; ``device_map`` in them
    counts as ``device_map=``); ``tokenizer_name``: load the tokenizer from elsewhere (HuggingFaceLLM's).
    ``engine_kwargs`` are EngineConfig fields: an unknown one is a TypeError before anything loads."""
    check_engine_kwargs(engine_kwargs, owner=owner)
    kwargs, mapped = model_kwargs_of(model_kwargs)
    if device_map is not None and mapped is not None and device_map != mapped:
        raise ValueError(f"device_map={device_map!r} and model_kwargs['device_map']={mapped!r} differ; pass one")
    target = load_device(device, device_map if device_map is not None else mapped)
    if dtype is not None and "dtype" in kwargs and kwargs["dtype"] != dtype:
        raise ValueError(f"dtype={dtype!r} and model_kwargs dtype={kwargs['dtype']!r} differ; pass one")
    if tokenizer_name is not None and (not isinstance(tokenizer_name, str) or not tokenizer_name):
        raise TypeError(f"tokenizer_name must be a hub id or a local path (str), got {tokenizer_name!r}")
    extra = {"tokenizer_name": tokenizer_name} if tokenizer_name not in (None, model_id) else {}
    return KVEngine.from_pretrained(model_id, device=target, dtype=dtype, model_kwargs=kwargs or None, **extra,
                                    **engine_kwargs)


class StopOnTokens:
    """A ``logits_processor`` that ends generation once the last generated token is one of ``ids``
    (HuggingFaceLLM's ``stopping_ids``: the token stays in the output, as there; ``finish_reason`` is
    "stop"). The engine asks the processor before sampling, so stopping costs one decode step whose
    logits are discarded."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = frozenset(int(i) for i in ids)

    def __call__(self, generated_ids: list[int], logits: Any) -> Any:
        if generated_ids and generated_ids[-1] in self.ids:
            raise StopGeneration
        return logits

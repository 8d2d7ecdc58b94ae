"""KVEngine: warm documents, then prefill and generate with their KV reused at any position.

Data flows one way: text → segments → tokens → chunks/keys → store lookups → assembled cache (placed and
re-rotated) → repair (a compute schedule) → logits → decode.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvboost_core.adapters import ModelAdapter, ScatterCache
from kvboost_core.assembly import (
    APPROX,
    EXACT,
    FRESH,
    REPAIRED,
    Plan,
    chunk_prefix_keys,
    lookup,
    place,
    plan_chunks,
)
from kvboost_core.autocalib import FirstUse, load_cached
from kvboost_core.autocalib import apply as apply_calibration
from kvboost_core.backfill import (
    FOLLOW_UP_WAIT_S,
    Backfiller,
    BackfillJob,
    BackfillResult,
    conversation_job,
    run_job,
)
from kvboost_core.chunking import boundary_predicate, chunk_spans
from kvboost_core.config import (
    EngineConfig,
    validate_adaptive,
    validate_check_layer,
    validate_flag,
    validate_recheck,
    validate_repair,
)
from kvboost_core.decode import (
    LogitsProcessor,
    SamplingParams,
    TextStream,
    check_logits_processor,
    process_and_sample,
)
from kvboost_core.forward import Schedule, decode_step, run_forward
from kvboost_core.keys import Fingerprint, content_key, kv_precision, model_fingerprint
from kvboost_core.kv_encode import maybe_quantize
from kvboost_core.repair import RepairSpec, build_schedule
from kvboost_core.results import AssembledCache, Counters, GenerationResult, PrefillResult, WarmResult
from kvboost_core.segments import (
    Segment,
    TokenizedSegment,
    chat_head_text,
    check_utf8,
    check_vocab,
    lead_token_ids,
    normalize_prompt,
    tokenize_segments,
)
from kvboost_core.store import DensePayload, KVBlock, KVGeometry
from kvboost_core.store.factory import build_store

if TYPE_CHECKING:
    from kvboost_core.calibrate import Calibration

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype: Any, device: str) -> torch.dtype:
    if dtype is None:
        # fp32 is the fast dtype on CPUs without bf16 matrix units; GPUs want bf16.
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


class GenerationStream:
    """An iterator of text pieces; ``result`` is set when it is exhausted."""

    def __init__(self, engine: KVEngine, prompt: Any, params: SamplingParams, kw: dict[str, Any]) -> None:
        self._holder: dict[str, GenerationResult] = {}
        self._it = engine._run(prompt, params, holder=self._holder, **kw)
        self.result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        while True:
            try:
                piece = next(self._it)
            except StopIteration:
                self.result = self._holder.get("result")
                raise
            if piece:
                return piece


class KVEngine:
    """Position-independent KV reuse around one HuggingFace causal LM."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            if overrides.get("block_adapter") and "repair" not in overrides:
                overrides["repair"] = "none"  # re-placed documents are then the adapted model's own prefill
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.with_(**overrides)
        self.config = config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter.for_model(model)
        if self.adapter.no_reuse:  # once per engine: every request then runs as plain HF generation
            warnings.warn(f"kvboost: {self.adapter.no_reuse}", stacklevel=2)
        self._vocab = int(model.get_input_embeddings().num_embeddings)
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to call concurrently
        self._lead = lead_token_ids(tokenizer)
        self._warm_prefix = self._resolve_warm_prefix(config.warm_prefix)
        # of the base model, before any adapter; a block adapter changes the model, hence the cache keys
        self.base_fingerprint = model_fingerprint(model, tokenizer)
        self.fingerprint = self.base_fingerprint
        self.reader = self._load_reader(config.reader_adapter)
        self.block = self._load_block(config.block_adapter)
        self.store = build_store(config.store, max_bytes=config.max_cache_bytes, fingerprint=self.fingerprint,
                                 namespace=config.namespace, secret=config.store_secret,
                                 geometry=KVGeometry.for_engine(self.adapter, config))
        self._is_boundary = boundary_predicate(tokenizer)
        self._counters = Counters()
        self._eos = self._eos_ids()
        self._backfill = Backfiller(self._backfill_step)  # exact history (kvboost_core.backfill); idle until used
        # calibration on first use (kvboost_core.autocalib): a cached result for this model applies at once
        self.calibration: dict[str, Any] | None = None
        cached = load_cached(self) if config.auto_calibrate and not self.adapter.no_reuse else None
        if cached is not None:
            apply_calibration(self, cached, "cached")
        self._first_use = FirstUse(done=not config.auto_calibrate or cached is not None or bool(self.adapter.no_reuse))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: str | None = None, dtype: Any = None,
                        model_kwargs: dict | None = None, tokenizer_name: str | None = None,
                        **config_kwargs: Any) -> KVEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvboost_core import zoo

        if config_kwargs.get("block_adapter") == "shipped":  # the adapter trained for this zoo model
            config_kwargs["block_adapter"] = zoo.shipped_block_adapter(name_or_path)
        if zoo.is_zoo_name(name_or_path):  # a short name such as "smollm2-135m-instruct": offline weights
            name_or_path = zoo.resolve(name_or_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = _resolve_dtype(dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or name_or_path)
        # the caller's model_kwargs override these defaults (dtype, attn_implementation), as in HF pipelines
        load_kw = {"dtype": torch_dtype, "attn_implementation": "sdpa", **(model_kwargs or {})}
        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **load_kw)
        except ValueError as e:  # families without an SDPA path (Gemma 2) load with eager attention
            if "scaled_dot_product_attention" not in str(e) or "attn_implementation" in (model_kwargs or {}):
                raise
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **{**load_kw, "attn_implementation": "eager"})
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to() narrowly
        if "config" not in config_kwargs:  # a calibrated kvboost.json beside the weights sets defaults
            from kvboost_core.calibrate import shipped_defaults

            shipped = shipped_defaults(name_or_path, model, tokenizer)  # or a known model's, by fingerprint
            # without one, calibrate on the first warmed documents, unless the caller chose the repair setting
            chosen = {"recompute_ratio", "check_layer", "repair", "block_adapter"} & set(config_kwargs)
            off = os.environ.get("KVBOOST_AUTO_CALIBRATE", "").lower() in ("0", "false", "off", "no")
            if not shipped and not chosen and not off:
                config_kwargs.setdefault("auto_calibrate", True)
            config_kwargs = {**shipped, **config_kwargs}
            if config_kwargs.get("block_adapter") and "repair" not in config_kwargs:
                config_kwargs["repair"] = "none"  # re-placed documents are then the adapted model's own prefill
        return cls(model, tokenizer, **config_kwargs)

    def _load_reader(self, path: str | None) -> Any:
        if path is None:
            return None
        if not self.adapter.layerwise or not self.adapter.rope.rerotatable:
            raise ValueError("reader_adapter needs a model whose documents can be re-placed (a supported RoPE "
                             "family); this one reuses exact prefixes only")
        from kvboost_core.reader import ReaderAdapter

        reader = ReaderAdapter.load(self.model, os.path.expanduser(path), self.fingerprint)
        self.adapter.reader = reader
        log.info("kvboost: reader adapter loaded from %s (rank %d)", path, reader.meta.rank)
        return reader

    def _load_block(self, path: str | None) -> Any:
        if path is None:
            return None
        if not self.adapter.layerwise or not self.adapter.rope.rerotatable:
            raise ValueError("block_adapter needs a model whose documents can be re-placed (a supported RoPE "
                             "family); this one reuses exact prefixes only")
        from kvboost_core.block_adapter import BlockAdapter, adapted_fingerprint

        block = BlockAdapter.load(self.model, os.path.expanduser(path), self.base_fingerprint, self._warm_prefix)
        self.fingerprint = Fingerprint(adapted_fingerprint(self.base_fingerprint, block.fingerprint))
        log.info("kvboost: block adapter loaded from %s (rank %d); documents at repair='none' are block-exact",
                 path, block.meta.rank)
        return block

    def _resolve_warm_prefix(self, spec: Any) -> tuple[int, ...]:
        if spec == "chat":  # the chat template's head before a user message (see segments.chat_head_text)
            head = chat_head_text(self.tokenizer)
            if head is not None:
                special = not (self.tokenizer.bos_token and head.startswith(self.tokenizer.bos_token))
                with self._tok_lock:
                    return tuple(self.tokenizer(head, add_special_tokens=special)["input_ids"])
            spec = None  # no template: fall back to the lead token
        if spec is None:
            if self._lead:
                return tuple(self._lead)
            eos = self.tokenizer.eos_token_id
            return (eos,) if isinstance(eos, int) else ()
        if isinstance(spec, str):
            check_utf8(spec, "warm_prefix")
            return tuple(self._encode(spec))
        if isinstance(spec, Sequence):
            ids = tuple(int(t) for t in spec)
            check_vocab(ids, self._vocab, "warm_prefix")
            return ids
        raise TypeError("warm_prefix must be None, 'chat', a str or a list of token ids")

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.tokenizer, self.model.config):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return ids

    @property
    def tokenizer_lock(self) -> threading.Lock:
        """Hold this around direct calls to ``self.tokenizer`` from other threads."""
        return self._tok_lock

    def _encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        return chunk_spans(ids, self.config.chunk_size, self.config.boundary_window, self._is_boundary)

    def _repair_spec(self, repair: str | None, recompute_ratio: float | None, select: str | None,
                     check_layer: int | None, reuse_repaired: bool = True, recompute_mass: float | None = None,
                     query_tokens: int | None = None, recheck_layer: int | None = None,
                     recheck_ratio: float | None = None) -> RepairSpec:
        """Per-call overrides, validated as the config validates its own (a per-call check_layer also against
        the model's layers: the config's is clamped to the last layer since the config does not know the model)."""
        if check_layer is not None:
            validate_check_layer(check_layer, self.adapter.num_layers)
        validate_flag("reuse_repaired", reuse_repaired, allow_none=False)
        c = self.config
        spec = RepairSpec(repair=c.repair if repair is None else repair,
                          recompute_ratio=c.recompute_ratio if recompute_ratio is None else recompute_ratio,
                          check_layer=c.check_layer if check_layer is None else check_layer,
                          select=c.select if select is None else select, overlap_k=c.overlap_k,
                          reuse_repaired=reuse_repaired,
                          recompute_mass=c.recompute_mass if recompute_mass is None else recompute_mass,
                          max_recompute_ratio=c.max_recompute_ratio,
                          query_tokens=c.query_tokens if query_tokens is None else query_tokens,
                          recheck_layer=c.recheck_layer if recheck_layer is None else recheck_layer,
                          recheck_ratio=c.recheck_ratio if recheck_ratio is None else recheck_ratio)
        validate_repair(spec.repair, spec.recompute_ratio, spec.select)
        validate_recheck(spec.recheck_layer, spec.recheck_ratio, spec.check_layer,
                         self.adapter.num_layers if recheck_layer is not None else None)
        validate_adaptive(spec.recompute_mass, spec.max_recompute_ratio, spec.query_tokens)
        return spec

    # ------------------------------------------------------------------ warming
    def warm(self, docs: str | Segment | Sequence[str | Segment]) -> WarmResult:
        """Store the KV of each document's chunks, computed after the warm prefix (never as a sequence start,
        so a document's first tokens do not become a second attention sink)."""
        t0 = time.perf_counter()
        segments = normalize_prompt(docs)
        warmed = already = chunks = tokens = nbytes = not_stored = 0
        doc_ids: list[list[int]] = []
        for seg in segments:
            ids = list(seg.token_ids) if seg.token_ids is not None else self._encode(seg.text or "")
            check_vocab(ids, self._vocab)
            doc_ids.append(ids)
            if not ids or self.adapter.no_reuse:
                continue
            spans = self._spans(ids)
            prec = kv_precision(self.config.kv_bits, self.config.kv_group_size)
            keys = [content_key(self.config.namespace, self.fingerprint, ids[a:b], precision=prec) for a, b in spans]
            if all(self._holds_content(k, ids[a:b]) for k, (a, b) in zip(keys, spans)):
                already += 1
                continue
            if not self.adapter.layerwise:
                # prefix-only models cannot re-place a document: store it as a prompt prefix instead
                self.prefill([Segment(token_ids=ids)], store_prefix=True)
                warmed += 1
                tokens += len(ids)
                continue
            prefix = list(self._warm_prefix)
            full = prefix + ids
            self._check_context(len(full))
            cache = self._new_cache(len(full))
            ids_t = torch.tensor(full, device=self.adapter.device)
            positions = torch.arange(len(full), device=ids_t.device)  # the lead-in is computed, not stored
            run_forward(self.adapter, ids_t, cache, Schedule(base=positions, candidates=positions[:0]), len(full))
            stored_all = True
            for (a, b), key in zip(spans, keys):
                block = self._block(cache, ids[a:b], len(prefix) + a, kind="content", parent=None)
                if self.store.put(key, block):
                    nbytes += block.nbytes
                    chunks += 1
                else:  # the budget is full of entries it may not evict (pinned, or larger than the budget)
                    stored_all = False
            if stored_all:
                warmed += 1
                tokens += len(ids)
            else:
                not_stored += 1
        if not_stored:
            log.warning("kvboost: %d of %d documents were computed but not stored (the cache budget is full of "
                        "entries it may not evict); raise max_cache_bytes", not_stored, len(segments))
        self._counters.add(warmed_tokens=tokens)
        self._first_use.observe(self, doc_ids)
        return WarmResult(documents=len(segments), warmed=warmed, already_warm=already, chunks=chunks,
                          tokens=tokens, bytes=nbytes, seconds=time.perf_counter() - t0, doc_token_ids=doc_ids,
                          not_stored=not_stored)

    def _holds_content(self, key: Any, ids: Sequence[int]) -> bool:
        """The store serves this chunk's own KV under ``key`` (a key alone may collide)."""
        block = self.store.get(key)
        return block is not None and block.kind == "content" and list(block.token_ids) == list(ids)

    def _block(self, cache: ScatterCache | AssembledCache, ids: Sequence[int], start: int, *, kind: str,
               parent: Any, digest: bytes = b"") -> KVBlock:
        end = start + len(ids)
        k = torch.stack([kb[0, :, start:end] for kb in cache.keys]).clone()  # (L, H, n, D)
        v = torch.stack([vb[0, :, start:end] for vb in cache.values]).clone()
        # The chunk at the sequence start holds the attention sink (BOS), whose outlier keys would widen every
        # channel's quantization range; it is a single chunk per prefix chain, so it stays dense.
        bits = None if start == 0 else self.config.kv_bits
        # Rotatable RoPE: quantize keys pre-RoPE (position 0); placement rotates them to where they land.
        rotary = self.adapter.inner.rotary_emb if self.adapter.layerwise and self.adapter.rope.rerotatable else None
        payload = maybe_quantize(DensePayload(k, v), bits, self.config.kv_group_size, start=start,
                                 rotary_emb=rotary)
        return KVBlock(tuple(ids), payload, start, self.fingerprint, self.config.namespace, kind=kind,
                       parent=parent, context_digest=digest)

    # ------------------------------------------------------------------ prefill
    def _new_cache(self, capacity: int) -> ScatterCache:
        a = self.adapter
        shape = (1, a.num_kv_heads, capacity, a.head_dim)
        if a.no_reuse:  # HF's own cache holds the KV; a zero-stride view keeps the capacity without the memory
            one = torch.empty(1, a.num_kv_heads, 1, a.head_dim, dtype=a.dtype, device=a.device).expand(shape)
            return ScatterCache([one] * a.num_layers, [one] * a.num_layers)
        # empty, not zeros: every slot below `length` is either placed or computed before it is read.
        keys = [torch.empty(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        values = [torch.empty(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        return ScatterCache(keys, values)

    def _check_context(self, n_prompt: int) -> None:
        ctx = self.adapter.max_context
        if ctx and n_prompt > ctx:
            raise ValueError(f"the prompt has {n_prompt} tokens but the model's context is {ctx} tokens; "
                             "shorten the prompt or retrieve fewer documents (nothing is truncated silently)")

    def tokenize(self, prompt: Any, add_special_tokens: bool | None = None) -> list[TokenizedSegment]:
        segments = normalize_prompt(prompt)
        use_lead = self.config.add_special_tokens if add_special_tokens is None else add_special_tokens
        lead = self._lead if use_lead else ()
        with self._tok_lock:
            out = tokenize_segments(self.tokenizer, segments, lead)
        for seg in out:
            check_vocab(seg.token_ids, self._vocab)
        return out

    def tokenize_ids(self, prompt: Any, add_special_tokens: bool | None = None) -> list[int]:
        """The token ids the model sees for ``prompt`` (segments concatenated, lead tokens included)."""
        return [t for seg in self.tokenize(prompt, add_special_tokens) for t in seg.token_ids]

    def verify(self, prompts: Sequence[Any], repairs: Sequence[str] = ("none", "selective", "cacheblend"),
               max_new_tokens: int = 16, **repair_kw: Any):
        """Fidelity of each repair strategy against a full prefill; see :mod:`kvboost_core.fidelity`."""
        from kvboost_core.fidelity import verify

        if isinstance(prompts, (str, bytes, Segment)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (each a str, a Segment or a list of them), got "
                            f"a {type(prompts).__name__}; wrap a single prompt in a list")
        if isinstance(repairs, str) or not isinstance(repairs, Sequence):
            raise TypeError(f"repairs must be a list of repair names, got {type(repairs).__name__} {repairs!r}")
        for r in repairs:
            validate_repair(r, 0.0)
        return verify(self, prompts, repairs, max_new_tokens, **repair_kw)

    def _prompt_chunks(self, prompt: Any, add_special_tokens: bool | None
                       ) -> tuple[list[TokenizedSegment], int, list[Any]]:
        """The prompt's segments, token count and chunks; refuses an empty prompt or one over the context."""
        segs = self.tokenize(prompt, add_special_tokens)
        total = sum(len(s.token_ids) for s in segs)
        if total == 0:
            raise ValueError("the prompt is empty after tokenization; pass non-empty text")
        self._check_context(total)
        return segs, total, plan_chunks(segs, self._spans)

    def _prefill(self, prompt: Any, spec: RepairSpec, n_new: int, add_special_tokens: bool | None,
                 t0: float, prepared: tuple[list[TokenizedSegment], int, list[Any]] | None = None,
                 count: bool = True) -> tuple[PrefillResult, Plan, ScatterCache]:
        segs, total, chunks = prepared or self._prompt_chunks(prompt, add_special_tokens)
        t_tok = time.perf_counter()
        # Repaired (approximate) prefixes are served only where this engine stores them: never by default.
        allow_repaired = spec.repair != "full" and spec.reuse_repaired and self.config.store_repaired
        if self.adapter.no_reuse:
            plan = Plan(token_ids=[t for s in segs for t in s.token_ids], chunks=chunks, status=[FRESH] * total,
                        misses=total)
        else:
            plan = lookup(self.store, segs, chunks, namespace=self.config.namespace, fingerprint=self.fingerprint,
                          spans_of=self._spans, sink_tokens=self.config.sink_tokens,
                          allow_approx=self.adapter.rope.rerotatable, allow_repaired=allow_repaired,
                          precision=kv_precision(self.config.kv_bits, self.config.kv_group_size))
        t_lookup = time.perf_counter()
        ctx = self.adapter.max_context or (total + n_new)
        cache = self._new_cache(max(total, min(total + n_new, ctx)))
        a = self.adapter
        place(plan, cache.keys, cache.values, a.inner.rotary_emb if a.layerwise else None)
        t_place = time.perf_counter()
        ids_t = torch.tensor(plan.token_ids, device=a.device)
        if a.layerwise:
            schedule = build_schedule(plan, spec, a.num_layers, a.device)
            cache.gate_from = self._gate_from(plan, spec, schedule)
            with torch.inference_mode():
                hidden, trace = run_forward(a, ids_t, cache, schedule, total)
                logits = a.logits(hidden)[0, -1].float()
            final = schedule.base if trace.selected is None else torch.unique(torch.cat((schedule.base,
                                                                                        trace.selected)))
            per_layer, kv_only = trace.tokens_per_layer, trace.kv_only_tokens
        else:
            reused = min(plan.exact_len, total - 1)  # the last token's logits are the output: compute it
            logits = a.hf_prefill(ids_t, cache, reused).float()
            final = torch.arange(reused, total)
            per_layer, kv_only = [total - reused] * a.num_layers, 0
        t_fwd = time.perf_counter()
        stats = self._prefill_stats(plan, final, spec, per_layer)
        stats.update(reader=cache.gate_from is not None, check_kv_tokens=kv_only, tokenize_s=t_tok - t0, lookup_s=t_lookup - t_tok,
                     assemble_s=t_place - t_lookup, forward_s=t_fwd - t_place, prefill_s=t_fwd - t0)
        if count:  # a backfill step is not a request: stats() counts it apart
            self._counters.add(hits_exact=plan.hits_exact, hits_repaired=plan.hits_repaired,
                               hits_content=plan.hits_content, misses=plan.misses, prefills=1)
        result = PrefillResult(token_ids=list(plan.token_ids), last_logits=logits,
                               cache=AssembledCache(cache.keys, cache.values, total), stats=stats)
        return result, plan, cache

    def _gate_from(self, plan: Plan, spec: RepairSpec, schedule: Schedule) -> int | None:
        """Where the reader adapter starts: after the last re-placed (approximate) token, when the schedule may
        leave any of them unrecomputed; None (the base model throughout) otherwise, so exact and fully
        recomputed prompts are answered exactly as the base model answers them."""
        if self.reader is None or spec.repair == "full":
            return None
        approx = [i for i, s in enumerate(plan.status) if s in (APPROX, REPAIRED)]
        if not approx:
            return None
        if schedule.keeps_every_candidate():
            return None  # CacheBlend keeps every candidate: nothing approximate is read
        return approx[-1] + 1

    def _prefill_stats(self, plan: Plan, final: torch.Tensor, spec: RepairSpec, per_layer: list[int]
                       ) -> dict[str, Any]:
        status = torch.tensor(plan.status, dtype=torch.int8)
        in_final = torch.zeros(len(plan.status), dtype=torch.bool)
        in_final[final.cpu()] = True
        total = len(plan.status)
        reused_exact = int(((status == EXACT) & ~in_final).sum())
        reused_approx = int(((status == APPROX) & ~in_final).sum())
        reused_repaired = int(((status == REPAIRED) & ~in_final).sum())  # an earlier repair's approximation
        computed = int((status == FRESH).sum())
        recomputed = total - reused_exact - reused_approx - reused_repaired - computed
        # Under a block adapter at repair="none", a re-placed document is exactly that model's block prefill
        # (kvboost_core.block_prefill); with any recompute it is neither that nor a full prefill: approximate.
        reused_block = reused_approx if self.block is not None and spec.repair == "none" else 0
        reused_approx -= reused_block
        return {"prompt_tokens": total, "reused_exact": reused_exact, "reused_block": reused_block,
                "reused_approx": reused_approx, "reused_repaired": reused_repaired, "recomputed": recomputed,
                "computed": computed, "reuse_ratio": (reused_exact + reused_block + reused_approx + reused_repaired)
                / total, "repair": spec.repair,
                "recompute_ratio": spec.recompute_ratio, "select": spec.select, "tokens_per_layer": per_layer,
                "recheck_layer": spec.recheck_layer,
                "hits_exact": plan.hits_exact, "hits_repaired": plan.hits_repaired,
                "hits_content": plan.hits_content, "misses": plan.misses}

    def _store_prefix(self, plan: Plan, cache: ScatterCache, spec: RepairSpec, enabled: bool | None) -> None:
        if not (self.config.store_prefix if enabled is None else enabled) or self.adapter.no_reuse:
            return
        # KV is exact up to the first approximate position: a re-placed token that was not recomputed in
        # every layer with an exact context, or a repaired prefix hit. Chunks past it are stored as "repaired".
        frontier = len(plan.status)
        if spec.repair != "full":  # full recomputes every re-placed token and never serves repaired entries
            first_approx = next((i for i, s in enumerate(plan.status) if s == APPROX), frontier)
            frontier = min(first_approx, frontier if plan.repaired_from is None else plan.repaired_from)
        full_hits = {pl.dst for pl in plan.placements if pl.exact and pl.length == pl.block.num_tokens}
        for ch, (parent, key, digest) in zip(plan.chunks, chunk_prefix_keys(
                self.config.namespace, self.fingerprint, plan.token_ids, plan.chunks,
                precision=kv_precision(self.config.kv_bits, self.config.kv_group_size))):
            if ch.end <= plan.exact_len and ch.start in full_hits:
                continue  # stored already: it was the hit
            kind = "prefix" if ch.end <= frontier else "repaired"
            if kind == "repaired" and not self.config.store_repaired:
                break
            block = self._block(cache, plan.token_ids[ch.start:ch.end], ch.start, kind=kind, parent=parent,
                                digest=digest)
            self.store.put(key, block)

    def prefill(self, prompt: Any, *, repair: str | None = None, recompute_ratio: float | None = None,
                select: str | None = None, check_layer: int | None = None,
                add_special_tokens: bool | None = None, store_prefix: bool | None = None,
                reuse_repaired: bool = True, recompute_mass: float | None = None,
                query_tokens: int | None = None, recheck_layer: int | None = None,
                recheck_ratio: float | None = None) -> PrefillResult:
        """Assemble the prompt's KV from the cache, repair it, and return the next-token logits.

        ``reuse_repaired=False`` ignores prefix entries stored from earlier repaired (approximate) prefills, so
        the call measures its own strategy; ``repair="full"`` always ignores them."""
        t0 = time.perf_counter()
        spec = self._repair_spec(repair, recompute_ratio, select, check_layer, reuse_repaired, recompute_mass,
                                 query_tokens, recheck_layer, recheck_ratio)
        validate_flag("add_special_tokens", add_special_tokens)
        validate_flag("store_prefix", store_prefix)
        result, plan, cache = self._prefill(prompt, spec, 0, add_special_tokens, t0)
        self._store_prefix(plan, cache, spec, store_prefix)
        return result

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               stop: str | Sequence[str] | None = None, seed: int | None = None, *,
               logits_processor: LogitsProcessor | None = None, **kw: Any) -> GenerationStream:
        """Yield text pieces as tokens are produced; the returned stream's ``.result`` holds the
        :class:`GenerationResult` once it is exhausted. Arguments are validated before the first piece.
        ``logits_processor``: see :meth:`generate`."""
        params = SamplingParams.create(max_new_tokens, temperature, top_p, stop, seed)
        self._check_run_kw(kw)
        check_logits_processor(logits_processor)
        return GenerationStream(self, prompt, params, dict(kw, logits_processor=logits_processor))

    _RUN_KW = ("repair", "recompute_ratio", "select", "check_layer", "add_special_tokens", "store_prefix",
               "reuse_repaired", "recompute_mass", "query_tokens", "recheck_layer", "recheck_ratio")

    def _check_run_kw(self, kw: dict[str, Any]) -> None:
        unknown = sorted(set(kw) - set(self._RUN_KW))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; accepted: {', '.join(self._RUN_KW)}")
        self._repair_spec(kw.get("repair"), kw.get("recompute_ratio"), kw.get("select"), kw.get("check_layer"),
                          kw.get("reuse_repaired", True), kw.get("recompute_mass"), kw.get("query_tokens"),
                          kw.get("recheck_layer"), kw.get("recheck_ratio"))
        validate_flag("add_special_tokens", kw.get("add_special_tokens"))
        validate_flag("store_prefix", kw.get("store_prefix"))

    def generate(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, *,
                 logits_processor: LogitsProcessor | None = None, **kw: Any) -> GenerationResult:
        """Generate a completion of ``prompt`` (document KV reused as in :meth:`prefill`).

        ``logits_processor(generated_ids, logits) -> logits`` is applied to the next-token logits (float32,
        shape (V,)) before every token is sampled, the first one included; it may raise
        :class:`kvboost_core.decode.StopGeneration` to end the generation (``finish_reason == "stop"``).
        It only changes which token is picked: prefill, reuse and the stats are those of a plain call."""
        holder: dict[str, GenerationResult] = {}
        params = SamplingParams.create(max_new_tokens, temperature, top_p, stop, seed)
        self._check_run_kw(kw)
        check_logits_processor(logits_processor)
        for _ in self._run(prompt, params, holder=holder, logits_processor=logits_processor, **kw):
            pass
        return holder["result"]

    def _run(self, prompt: Any, params: SamplingParams, holder: dict | None, *, repair: str | None = None,
             recompute_ratio: float | None = None, select: str | None = None, check_layer: int | None = None,
             add_special_tokens: bool | None = None, store_prefix: bool | None = None,
             reuse_repaired: bool = True, recompute_mass: float | None = None,
             query_tokens: int | None = None, recheck_layer: int | None = None,
             recheck_ratio: float | None = None, logits_processor: LogitsProcessor | None = None) -> Iterator[str]:
        t0 = time.perf_counter()
        if self.config.backfill:  # a follow-up of a turn still being backfilled waits for its exact history
            self._backfill.wait_for(self.tokenize_ids(prompt, add_special_tokens), FOLLOW_UP_WAIT_S)
        with self._backfill.request():  # no backfill step starts while this request runs
            yield from self._run_request(prompt, params, holder, t0, repair, recompute_ratio, select, check_layer,
                                         add_special_tokens, store_prefix, reuse_repaired, recompute_mass,
                                         query_tokens, recheck_layer, recheck_ratio, logits_processor)

    def _run_request(self, prompt: Any, params: SamplingParams, holder: dict | None, t0: float, repair: str | None,
                     recompute_ratio: float | None, select: str | None, check_layer: int | None,
                     add_special_tokens: bool | None, store_prefix: bool | None, reuse_repaired: bool,
                     recompute_mass: float | None, query_tokens: int | None, recheck_layer: int | None,
                     recheck_ratio: float | None, logits_processor: LogitsProcessor | None) -> Iterator[str]:
        spec = self._repair_spec(repair, recompute_ratio, select, check_layer, reuse_repaired, recompute_mass,
                                 query_tokens, recheck_layer, recheck_ratio)
        prepared = self._prompt_chunks(prompt, add_special_tokens)
        pre, plan, cache = self._prefill(prompt, spec, params.max_new_tokens, add_special_tokens, t0, prepared)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.adapter.device).manual_seed(params.seed)
        generated: list[int] = []
        # The processor may mask in place: it gets a copy, so the result's first_logits stay the model's own.
        first = pre.last_logits if logits_processor is None else pre.last_logits.clone()
        token = process_and_sample(logits_processor, generated, first, params, generator)  # None: stopped
        ttft = time.perf_counter() - t0
        self._store_prefix(plan, cache, spec, store_prefix)  # after the first token: not on the TTFT path

        capacity = cache.keys[0].shape[2]
        all_ids = torch.empty(capacity, dtype=torch.long, device=self.adapter.device)
        all_ids[: len(pre.token_ids)] = torch.tensor(pre.token_ids)
        text = TextStream(self.tokenizer, params.stop)
        pos = len(pre.token_ids)
        finish = "length"
        while True:
            if token is None:  # the logits processor ended the generation
                finish = "stop"
                break
            generated.append(token)
            if token in self._eos:
                finish = "eos"
                break
            yield text.push(token)
            if text.stopped:
                finish = "stop"
                break
            if len(generated) >= params.max_new_tokens or pos >= capacity:
                finish = "length"
                break
            all_ids[pos] = token
            if cache.hf is not None:
                logits = self.adapter.hf_step(cache, token)
            else:
                logits = decode_step(self.adapter, all_ids, pos, cache)
            pos += 1
            token = process_and_sample(logits_processor, generated, logits.float(), params, generator)
        yield text.flush()
        if holder is not None:
            stats = dict(pre.stats, ttft_s=ttft, finish_reason=finish)
            holder["result"] = GenerationResult(
                text=text.text, token_ids=generated, prompt_token_ids=pre.token_ids, ttft_s=ttft,
                total_s=time.perf_counter() - t0, reuse_ratio=pre.stats["reuse_ratio"], finish_reason=finish,
                stats=stats, first_logits=pre.last_logits)
        if self._backfills(store_prefix):
            self._backfill.submit(conversation_job(prepared[0], plan.chunks, generated, self._spans))

    # ------------------------------------------------------------------ exact history (kvboost_core.backfill)
    def _backfills(self, store_prefix: bool | None) -> bool:
        return bool(self.config.backfill) and not self.adapter.no_reuse and (
            self.config.store_prefix if store_prefix is None else store_prefix)

    def _backfill_step(self, job: BackfillJob, end: int) -> tuple[int, int]:
        """Compute the prefix ``[0, end)`` of ``job`` exactly (stored exact prefix reused, the rest computed
        causally in every layer) and store its chunks as exact prefix entries: (tokens reused, tokens computed)."""
        chunks = [c for c in job.chunks if c.end <= end]
        seg = TokenizedSegment(token_ids=job.token_ids[:end], start=0, cacheable=False)
        spec = self._repair_spec("full", None, None, None, False, None, None, None, None)
        _, plan, cache = self._prefill(None, spec, 0, None, time.perf_counter(), ([seg], end, chunks), count=False)
        self._store_prefix(plan, cache, spec, True)
        computed = end - plan.exact_len
        self._counters.add(backfill_tokens=computed)
        return plan.exact_len, computed

    def backfill(self, prompt: Any, generated: Sequence[int] = (), *,
                 add_special_tokens: bool | None = None) -> BackfillResult:
        """Store the exact KV of ``prompt`` followed by ``generated`` token ids, now, in this thread.

        The next prompt that continues this sequence (the next turn of a chat) then finds it as an exact prefix.
        Engines with ``backfill=True`` do this by themselves after every generation, in a background thread;
        call this where generation happens elsewhere (a batch scheduler) or to backfill synchronously."""
        if not self.config.store_prefix or self.adapter.no_reuse:
            raise ValueError("backfill needs an engine that stores prefixes (store_prefix=True) and reuses KV")
        gen = list(generated)
        check_vocab(gen, self._vocab, "generated")
        segs, total, chunks = self._prompt_chunks(prompt, add_special_tokens)
        self._check_context(total + len(gen))
        return run_job(conversation_job(segs, chunks, gen, self._spans), self._backfill_step)

    def wait_backfill(self, timeout: float | None = None) -> bool:
        """Block until the background backfill jobs submitted so far are done; False on timeout."""
        return self._backfill.wait(timeout)

    # ------------------------------------------------------------------ reference & introspection
    @torch.inference_mode()
    def full_prefill_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits of a plain HF full prefill of ``token_ids`` (the fidelity reference)."""
        ids = torch.tensor([list(token_ids)], device=self.adapter.device)
        return self.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()

    def stats(self) -> dict[str, Any]:
        s = dict(self.store.stats())
        c = self._counters.snapshot()
        return {"entries": s.get("entries", 0), "tokens": s.get("tokens", 0), "bytes": s.get("bytes", 0),
                "evictions": s.get("evictions", 0), "hits_exact": c["hits_exact"],
                "hits_repaired": c["hits_repaired"], "hits_content": c["hits_content"], "misses": c["misses"], "prefills": c["prefills"],
                "warmed_tokens": c["warmed_tokens"], "backfill_tokens": c.get("backfill_tokens", 0),
                "backfill_pending": self._backfill.pending, "store": s}

    def calibrate(self, docs: Sequence[str | Sequence[int]] | None = None, *, prompts: Sequence[Any] | None = None,
                  max_kl: float = 0.01, min_top1: float = 0.95, budget_s: float | None = None,
                  save: bool = True) -> Calibration:
        """Measure and apply the cheapest CacheBlend setting (ratio, check layer) whose mean first-token KL
        against full prefill is <= ``max_kl`` with top-1 agreement >= ``min_top1``.

        Probes are built from ``docs`` (texts or token ids; warmed here first), else from the documents warmed so
        far; or pass your own ``prompts`` (lists of segments, documents warmed beforehand). The result is applied
        to ``self.config``, recorded in ``self.calibration`` and, for probes from documents, cached under the
        model's fingerprint for ``auto_calibrate`` engines. ``budget_s`` bounds the search (None: the config's)."""
        from kvboost_core import autocalib

        if docs is not None:
            if isinstance(docs, (str, bytes)) or not isinstance(docs, Sequence):
                raise TypeError(f"docs must be a list of texts or token-id lists, got {type(docs).__name__}")
            ids = [self._encode(d) if isinstance(d, str) else list(d) for d in docs]
            self.warm([Segment(token_ids=d) for d in ids])
            sample = [d[: autocalib.MAX_DOC_TOKENS] for d in ids]
        else:
            sample = self._first_use.docs
        if prompts is None and len(sample) < autocalib.PER_PROMPT + 1:
            raise ValueError(f"calibrate needs at least {autocalib.PER_PROMPT + 1} warmed documents (docs=) or "
                             f"prompts=; this engine has {len(sample)}")
        budget = self.config.calibration_budget_s if budget_s is None else budget_s
        with self._first_use.lock:
            self._first_use.done = True
            return autocalib.run(self, sample, budget_s=budget, prompts=prompts, max_kl=max_kl, min_top1=min_top1,
                                 save=save)

    def clear(self) -> None:
        self.store.clear()

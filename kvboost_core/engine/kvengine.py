"""KVEngine: warm documents, then prefill and generate with their KV reused at any position.

Data flows one way: text → segments → tokens → chunks/keys → store lookups → assembled cache (placed and
re-rotated) → repair (a compute schedule) → logits → decode.

The engine is one class, one module per stage: :mod:`kvboost_core.engine.base` (state, tokenization),
:mod:`kvboost_core.engine.prefill`, :mod:`kvboost_core.engine.warming`, :mod:`kvboost_core.engine.generation`;
this module constructs it (weights, adapters, the warm prefix, calibration) and answers questions about it
(stats, verify, calibrate).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvboost_core.chunking import boundary_predicate
from kvboost_core.config import EngineConfig, validate_repair
from kvboost_core.engine.generation import GenerationMixin, GenerationStream
from kvboost_core.engine.warming import WarmMixin
from kvboost_core.keys import Fingerprint, model_fingerprint
from kvboost_core.model import weights
from kvboost_core.model.driver import ModelDriver
from kvboost_core.results import Counters
from kvboost_core.segments import Segment, chat_head_text, check_utf8, check_vocab, lead_token_ids
from kvboost_core.serving.backfill import Backfiller, FollowUps
from kvboost_core.store import KVGeometry
from kvboost_core.store.factory import build_store
from kvboost_core.tuning.autocalib import FirstUse, load_cached
from kvboost_core.tuning.autocalib import apply as apply_calibration

if TYPE_CHECKING:
    from kvboost_core.tuning.calibrate import Calibration

log = logging.getLogger(__name__)

__all__ = ["GenerationStream", "KVEngine"]

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


class KVEngine(GenerationMixin, WarmMixin):
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
        self.driver = ModelDriver.for_model(model)
        if self.driver.no_reuse:  # once per engine: every request then runs as plain HF generation
            warnings.warn(f"kvboost: {self.driver.no_reuse}", stacklevel=2)
        self._vocab = int(model.get_input_embeddings().num_embeddings)
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to call concurrently
        self._lead = lead_token_ids(tokenizer)
        self._warm_prefix = self._resolve_warm_prefix(config.warm_prefix)
        # of the base model, before any adapter; a block adapter changes the model, hence the cache keys
        self.base_fingerprint = model_fingerprint(model, tokenizer)
        self.fingerprint = self.base_fingerprint
        self.reader = self._load_reader(config.reader_adapter)
        self.block = self._load_block(config.block_adapter)
        # after the adapters (a block adapter merges into the fp32 weights): the KV's key says the precision
        weights.pack(model, config.weights)
        self.fingerprint = Fingerprint(weights.fingerprint(self.fingerprint, config.weights))
        self.store = build_store(config.store, max_bytes=config.max_cache_bytes, fingerprint=self.fingerprint,
                                 namespace=config.namespace, secret=config.store_secret,
                                 geometry=KVGeometry.for_engine(self.driver, config))
        self._is_boundary = boundary_predicate(tokenizer)
        self._counters = Counters()
        self._eos = frozenset(self._eos_ids())
        self._backfill = Backfiller(self._backfill_step)  # exact history (kvboost_core.serving.backfill); idle until used
        self._follow_ups = FollowUps()  # backfill="auto": which prompts continue an earlier one
        # calibration on first use (kvboost_core.tuning.autocalib): a cached result for this model applies at once
        self.calibration: dict[str, Any] | None = None
        cached = load_cached(self) if config.auto_calibrate and not self.driver.no_reuse else None
        if cached is not None:
            apply_calibration(self, cached, "cached")
        self._first_use = FirstUse(done=not config.auto_calibrate or cached is not None or bool(self.driver.no_reuse))

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
            from kvboost_core.tuning.calibrate import shipped_defaults

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
        if not self.driver.layerwise or not self.driver.rope.rerotatable:
            raise ValueError("reader_adapter needs a model whose documents can be re-placed (a supported RoPE "
                             "family); this one reuses exact prefixes only")
        from kvboost_core.lora.reader import ReaderAdapter

        reader = ReaderAdapter.load(self.model, os.path.expanduser(path), self.fingerprint)
        self.driver.reader = reader
        log.info("kvboost: reader adapter loaded from %s (rank %d)", path, reader.meta.rank)
        return reader

    def _load_block(self, path: str | None) -> Any:
        if path is None:
            return None
        if not self.driver.layerwise or not self.driver.rope.rerotatable:
            raise ValueError("block_adapter needs a model whose documents can be re-placed (a supported RoPE "
                             "family); this one reuses exact prefixes only")
        from kvboost_core.lora.block_adapter import BlockAdapter, adapted_fingerprint

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
            return tuple(self.encode(spec))
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

    def verify(self, prompts: Sequence[Any], repairs: Sequence[str] = ("none", "selective", "cacheblend"),
               max_new_tokens: int = 16, **repair_kw: Any):
        """Fidelity of each repair strategy against a full prefill; see :mod:`kvboost_core.tuning.fidelity`."""
        from kvboost_core.tuning.fidelity import verify

        if isinstance(prompts, (str, bytes, Segment)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (each a str, a Segment or a list of them), got "
                            f"a {type(prompts).__name__}; wrap a single prompt in a list")
        if isinstance(repairs, str) or not isinstance(repairs, Sequence):
            raise TypeError(f"repairs must be a list of repair names, got {type(repairs).__name__} {repairs!r}")
        for r in repairs:
            validate_repair(r, 0.0)
        return verify(self, prompts, repairs, max_new_tokens, **repair_kw)

    # ------------------------------------------------------------------ reference & introspection
    @torch.inference_mode()
    def full_prefill_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits of a plain HF full prefill of ``token_ids`` (the fidelity reference)."""
        ids = torch.tensor([list(token_ids)], device=self.driver.device)
        return self.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()

    def stats(self) -> dict[str, Any]:
        s = dict(self.store.stats())
        c = self._counters.snapshot()
        return {"entries": s.get("entries", 0), "tokens": s.get("tokens", 0), "bytes": s.get("bytes", 0),
                "evictions": s.get("evictions", 0), "hits_exact": c["hits_exact"],
                "hits_repaired": c["hits_repaired"], "hits_content": c["hits_content"], "misses": c["misses"], "prefills": c["prefills"],
                "warmed_tokens": c["warmed_tokens"], "backfill_tokens": c.get("backfill_tokens", 0),
                "backfill_pending": self._backfill.pending, "backfill_dropped": self._backfill.dropped,
                "follow_ups_forgotten": self._follow_ups.forgotten, "store": s}

    def calibrate(self, docs: Sequence[str | Sequence[int]] | None = None, *, prompts: Sequence[Any] | None = None,
                  max_kl: float = 0.01, min_top1: float = 0.95, budget_s: float | None = None,
                  save: bool = True) -> Calibration:
        """Measure and apply the cheapest CacheBlend setting (ratio, check layer) whose mean first-token KL
        against full prefill is <= ``max_kl`` with top-1 agreement >= ``min_top1``.

        Probes are built from ``docs`` (texts or token ids; warmed here first), else from the documents warmed so
        far; or pass your own ``prompts`` (lists of segments, documents warmed beforehand). The result is applied
        to ``self.config``, recorded in ``self.calibration`` and, for probes from documents, cached under the
        model's fingerprint for ``auto_calibrate`` engines. ``budget_s`` bounds the search (None: the config's)."""
        from kvboost_core.tuning import autocalib

        if docs is not None:
            if isinstance(docs, (str, bytes)) or not isinstance(docs, Sequence):
                raise TypeError(f"docs must be a list of texts or token-id lists, got {type(docs).__name__}")
            ids = [self.encode(d) if isinstance(d, str) else list(d) for d in docs]
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

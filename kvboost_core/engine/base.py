"""What every stage of the engine reads: its state, set once by ``KVEngine.__init__``, and the prompt's tokens.

The engine is one class assembled from one module per stage, each a mixin over this base:
:mod:`kvboost_core.engine.prefill` (lookup, place, forward, stats, store the prefix),
:mod:`kvboost_core.engine.warming` (documents' KV), :mod:`kvboost_core.engine.generation` (the decode loop) and
:mod:`kvboost_core.engine.kvengine` (construction, loading, introspection). The attributes below are declared here
so each stage is type-checked against them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvboost_core.chunking import chunk_spans
from kvboost_core.config import EngineConfig
from kvboost_core.segments import TokenizedSegment, check_vocab, normalize_prompt, tokenize_segments

if TYPE_CHECKING:
    from kvboost_core.keys import Fingerprint
    from kvboost_core.model.driver import ModelDriver
    from kvboost_core.results import Counters
    from kvboost_core.serving.backfill import Backfiller, FollowUps
    from kvboost_core.store import KVStore
    from kvboost_core.tuning.autocalib import FirstUse


class EngineBase:
    """The engine's state and tokenization; see :class:`kvboost_core.engine.KVEngine` for what each holds."""

    config: EngineConfig
    model: Any  # the HuggingFace causal LM, in eval mode
    tokenizer: Any
    driver: ModelDriver
    store: KVStore
    fingerprint: Fingerprint  # of the model that computes the KV (a block adapter included): keys the cache
    base_fingerprint: Fingerprint  # of the base model, before any adapter
    reader: Any  # a kvboost_core.lora.reader.ReaderAdapter, or None
    block: Any  # a kvboost_core.lora.block_adapter.BlockAdapter, or None
    calibration: dict[str, Any] | None
    _vocab: int
    _tok_lock: threading.Lock
    _lead: tuple[int, ...]  # the special tokens the tokenizer puts in front of a text
    _warm_prefix: tuple[int, ...]  # computed before every warmed document, never stored
    _is_boundary: Callable[[int], bool]
    _counters: Counters
    _eos: frozenset[int]
    _first_use: FirstUse
    _backfill: Backfiller  # exact history (kvboost_core.serving.backfill)
    _follow_ups: FollowUps  # backfill="auto" (kvboost_core.serving.backfill)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation (the generation config's, the tokenizer's and the model config's)."""
        return self._eos

    @property
    def warm_prefix_ids(self) -> tuple[int, ...]:
        """The tokens every document is warmed after (``config.warm_prefix`` resolved): the lead-in a block
        adapter was trained behind and a reference prefill of a lone document starts with."""
        return self._warm_prefix

    @property
    def counters(self) -> Counters:
        """The engine's running counts (hits, misses, warmed and backfilled tokens): what ``stats()`` reports."""
        return self._counters

    @property
    def tokenizer_lock(self) -> threading.Lock:
        """Hold this around direct calls to ``self.tokenizer`` from other threads."""
        return self._tok_lock

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids as a document is tokenized: no special tokens, under the tokenizer lock."""
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """Chunk boundaries of a token sequence, by the config's chunk size and boundary rule."""
        return chunk_spans(ids, self.config.chunk_size, self.config.boundary_window, self._is_boundary)

    def _check_context(self, n_prompt: int) -> None:
        ctx = self.driver.max_context
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

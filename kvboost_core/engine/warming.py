"""Warming: each document's KV computed once, after the warm prefix, and stored per chunk as content entries
that a later prefill re-places at any position (:mod:`kvboost_core.engine.prefill`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kvboost_core.engine.prefill import PrefillMixin
from kvboost_core.keys import content_key, kv_precision
from kvboost_core.model.forward import Schedule, run_forward
from kvboost_core.results import WarmResult
from kvboost_core.segments import Segment, check_vocab, normalize_prompt

if TYPE_CHECKING:
    from kvboost_core.stages import TuningEngine

log = logging.getLogger(__name__)


class WarmMixin(PrefillMixin):
    """``warm()``: the documents' KV into the store."""

    def warm(self, docs: str | Segment | Sequence[str | Segment]) -> WarmResult:
        """Store the KV of each document's chunks, computed after the warm prefix (never as a sequence start,
        so a document's first tokens do not become a second attention sink)."""
        t0 = time.perf_counter()
        segments = normalize_prompt(docs)
        warmed = already = chunks = tokens = nbytes = not_stored = 0
        doc_ids: list[list[int]] = []
        for seg in segments:
            ids = list(seg.token_ids) if seg.token_ids is not None else self.encode(seg.text or "")
            check_vocab(ids, self._vocab)
            doc_ids.append(ids)
            if not ids or self.driver.no_reuse:
                continue
            spans = self.spans(ids)
            prec = kv_precision(self.config.kv_bits, self.config.kv_group_size)
            keys = [content_key(self.config.namespace, self.fingerprint, ids[a:b], precision=prec) for a, b in spans]
            if all(self._holds_content(k, ids[a:b]) for k, (a, b) in zip(keys, spans)):
                already += 1
                continue
            if not self.driver.layerwise:
                # prefix-only models cannot re-place a document: store it as a prompt prefix instead
                self.prefill([Segment(token_ids=ids)], store_prefix=True)
                warmed += 1
                tokens += len(ids)
                continue
            prefix = list(self._warm_prefix)
            full = prefix + ids
            self._check_context(len(full))
            cache = self.new_cache(len(full))
            ids_t = torch.tensor(full, device=self.driver.device)
            positions = torch.arange(len(full), device=ids_t.device)  # the lead-in is computed, not stored
            run_forward(self.driver, ids_t, cache, Schedule(base=positions, candidates=positions[:0]), len(full))
            stored_all = True
            for (a, b), key in zip(spans, keys):
                block = self.stored_block(cache, ids[a:b], len(prefix) + a, kind="content", parent=None)
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
        self._first_use.observe(cast("TuningEngine", self), doc_ids)  # the assembled KVEngine is one
        return WarmResult(documents=len(segments), warmed=warmed, already_warm=already, chunks=chunks,
                          tokens=tokens, bytes=nbytes, seconds=time.perf_counter() - t0, doc_token_ids=doc_ids,
                          not_stored=not_stored)

    def _holds_content(self, key: Any, ids: Sequence[int]) -> bool:
        """The store serves this chunk's own KV under ``key`` (a key alone may collide)."""
        block = self.store.get(key)
        return block is not None and block.kind == "content" and list(block.token_ids) == list(ids)

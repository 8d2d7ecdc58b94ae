"""The engine's exact-history stage (see :mod:`kvboost_core.serving.backfill`): the background thread's step, the
public ``backfill``/``wait_backfill``, and a chat call's prefill.

A chat call (``history_tokens=h``: the skins' chat calls pass the length of the prompt up to the end of its last
assistant message) follows one rule: the history ``[0, h)`` is never re-placed. Its KV is the exact
full-attention prefill in canonical chunks (:mod:`kvboost_core.serving.canonical`): each chunk one forward over the
canonical KV before it, so it is bitwise the same whether it comes from the store (a backfill put it there) or
is computed now. Warmed documents are re-placed only after ``h`` (the new turn: turn 1's system and user
messages, a later turn's new question and tool results), planned from the warmed documents alone. A chat
prompt's output then depends only on the prompt, ``h`` and the warmed documents: not on whether the previous
turn's backfill ran, is running, or was evicted. After the call the prompt and its answer are backfilled as
canonical chunks (from turn 1 on), so the next turn finds its whole history in the store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvboost_core.assembly import plan_chunks
from kvboost_core.call_options import check_history_tokens, repair_spec
from kvboost_core.engine.prefill import PrefillMixin
from kvboost_core.model.driver import ScatterCache
from kvboost_core.repair import RepairSpec
from kvboost_core.results import PrefillResult
from kvboost_core.segments import Segment, TokenizedSegment, check_vocab, cut_messages
from kvboost_core.serving.backfill import BackfillJob, BackfillResult, conversation_job, run_job
from kvboost_core.serving.canonical import CanonicalJob

__all__ = ["BackfillMixin", "check_history_tokens"]  # check_history_tokens: kvboost_core.call_options

Prepared = tuple[list[TokenizedSegment], int, list[Any]]  # a prompt's segments, token count and chunks


class BackfillMixin(PrefillMixin):
    def _backfills(self, store_prefix: bool | None, prompt_ids: Sequence[int]) -> bool:
        """Backfill after this generation? ``backfill=True``: always; ``"auto"``: when the prompt continues an
        earlier prompt of this engine (a chat's second turn on), so its later turns find the history exact."""
        mode = self.config.backfill
        if not mode or self.driver.no_reuse:
            return False
        follow_up = self._follow_ups.observe(prompt_ids) if mode == "auto" else True
        return follow_up and bool(self.config.store_prefix if store_prefix is None else store_prefix)

    def chat_canonical(self) -> bool:
        """Can chat calls take the canonical path? A layer-wise model without a reader or block adapter (their
        forwards are not the canonical one); elsewhere a chat call is an ordinary one, backfilled all the same."""
        a = self.driver
        return a.layerwise and not a.no_reuse and self.reader is None and self.block is None

    def _chat_backfills(self, store_prefix: bool | None) -> bool:
        """Backfill after a chat call? Whenever backfill is on (``"auto"`` or True): a chat call is a turn."""
        return bool(self.config.backfill) and not self.driver.no_reuse and bool(
            self.config.store_prefix if store_prefix is None else store_prefix)

    def split_at(self, prepared: Prepared, history: int, turn_end: Sequence[int] = ()) -> Prepared:
        """The prompt's segments and chunks with the history cut per message (:func:`cut_messages`): at
        ``history`` and after every ``turn_end`` before it, as the earlier turns' backfills chunked it."""
        segs, total, _ = prepared
        out = cut_messages(segs, history, turn_end)
        return (out, total, plan_chunks(out, self.spans)) if len(out) > len(segs) else prepared

    def turn_answer(self, generated: Sequence[int], text: str, turn_end: Sequence[int]) -> list[int]:
        """The answer as the next turn's history holds it. With ``turn_end`` (what the chat template writes after
        an assistant message) the template renders the answer's text: its ids re-encoded (a model may end on a
        token that decodes to a partial character, which the text holds as U+FFFD), then ``turn_end``. Without
        it, the generated ids as they are."""
        if not turn_end:
            return list(generated)
        ids = self.tokenize_ids(Segment(text=text), add_special_tokens=False) if text else []
        return [*ids, *turn_end]

    def _chat_prefill(self, prepared: Prepared, spec: RepairSpec, n_new: int, history: int,
                      store_prefix: bool | None, turn_end: Sequence[int] = ()
                      ) -> tuple[PrefillResult, ScatterCache, list[tuple[Any, Any]]]:
        """A chat call's prefill (the module docstring's rule): (result, cache with room for ``n_new`` more
        tokens, the computed canonical chunks to store)."""
        prepared = self.split_at(prepared, history, turn_end)
        total = prepared[1]
        ctx = self.driver.max_context or (total + n_new)
        enabled = bool(self.config.store_prefix if store_prefix is None else store_prefix)
        job = CanonicalJob(self, None, spec, None, build_blocks=enabled, prepared=prepared, exact_before=history,
                           capacity=min(total + n_new, ctx))
        done = job.finish()
        done.result.stats.reader, done.result.stats.chat_history_tokens = False, history
        return done.result, job.cache, done.to_store

    def _backfill_step(self, job: BackfillJob, end: int) -> tuple[int, int]:
        """Compute the prefix ``[0, end)`` of ``job`` exactly (stored exact prefix reused, the rest computed
        causally in every layer) and store its chunks as exact prefix entries: (tokens reused, tokens computed).
        A canonical job's chunks are computed and stored as a chat call's history reads them."""
        chunks = [c for c in job.chunks if c.end <= end]
        seg = TokenizedSegment(token_ids=job.token_ids[:end], start=0, cacheable=False)
        spec = repair_spec(self.config, None, repair="full", reuse_repaired=False)
        if job.canonical:
            cj = CanonicalJob(self, None, spec, None, build_blocks=True, prepared=([seg], end, chunks),
                              exact_before=end, head_end=end)
            for key, block in cj.finish_head():
                self.store.put(key, block)
            self._counters.add(backfill_tokens=end - cj.hit_end)
            return cj.hit_end, end - cj.hit_end
        _, plan, cache = self._prefill(None, spec, 0, None, time.perf_counter(), ([seg], end, chunks), count=False)
        self._store_prefix(plan, cache, spec, True)
        computed = end - plan.exact_len
        self._counters.add(backfill_tokens=computed)
        return plan.exact_len, computed

    def backfill_step(self, job: BackfillJob, end: int) -> tuple[int, int]:
        """One slice of ``job`` for a caller that schedules backfills itself (the server, between requests): its
        prefix ``[0, end)`` (``end`` a chunk end, see :func:`kvboost_core.serving.backfill.step_ends`) exact in the
        store, computed where not stored yet. Returns (tokens found stored, tokens computed)."""
        if not self.config.store_prefix or self.driver.no_reuse:
            raise ValueError("backfill needs an engine that stores prefixes (store_prefix=True) and reuses KV")
        if not any(c.end == end for c in job.chunks):
            raise ValueError(f"end must be one of the job's chunk ends, got {end!r}")
        return self._backfill_step(job, end)

    def backfill(self, prompt: Any, generated: Sequence[int] = (), *,
                 add_special_tokens: bool | None = None, chat: bool = False,
                 turn_end: Sequence[int] = ()) -> BackfillResult:
        """Store the exact KV of ``prompt`` followed by ``generated`` token ids, now, in this thread.
        ``chat=True``: as a chat call's history (canonical chunks: what a call with ``history_tokens`` reads),
        cut after every ``turn_end`` as that call's ``turn_end`` cuts it (pass the same ids).

        The next prompt that continues this sequence (the next turn of a chat) then finds it as an exact prefix.
        Engines with ``backfill=True`` do this by themselves after every generation (``"auto"``, the default:
        after every generation whose prompt continues an earlier one), in a background thread; call this where
        generation happens elsewhere or to backfill synchronously."""
        if not self.config.store_prefix or self.driver.no_reuse:
            raise ValueError("backfill needs an engine that stores prefixes (store_prefix=True) and reuses KV")
        gen = list(generated)
        check_vocab(gen, self._vocab, "generated")
        check_history_tokens(None, turn_end)
        check_vocab(list(turn_end), self._vocab, "turn_end")
        segs, total, chunks = self.prompt_chunks(prompt, add_special_tokens)
        self._check_context(total + len(gen))
        canonical = chat and self.chat_canonical()
        return run_job(conversation_job(segs, chunks, gen, self.spans, canonical=canonical,
                                        turn_end=turn_end if canonical else ()), self._backfill_step)

    @property
    def backfill_results(self) -> tuple[BackfillResult, ...]:
        """The latest background backfill jobs' results (up to 64, oldest first): tokens found stored and
        computed, seconds, whether the job finished. For benchmarks and monitoring."""
        return tuple(self._backfill.results)

    def close_backfill(self, timeout: float | None = None) -> None:
        """Stop the background backfill: pending jobs are dropped and the worker ends after its current step
        (waited for up to ``timeout``). Later chat calls still read any history stored, but queue no backfill."""
        self._backfill.close(timeout)

    def wait_backfill(self, timeout: float | None = None) -> bool:
        """Block until the background backfill jobs submitted so far are done; False on timeout."""
        return self._backfill.wait(timeout)

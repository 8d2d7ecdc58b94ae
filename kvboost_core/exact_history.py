"""The engine's exact-history stage (see :mod:`kvboost_core.backfill`): the background thread's step, and the
public ``backfill``/``wait_backfill``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvboost_core.backfill import BackfillJob, BackfillResult, conversation_job, run_job
from kvboost_core.prefill import PrefillMixin
from kvboost_core.segments import TokenizedSegment, check_vocab


class BackfillMixin(PrefillMixin):
    def _backfills(self, store_prefix: bool | None, prompt_ids: Sequence[int]) -> bool:
        """Backfill after this generation? ``backfill=True``: always; ``"auto"``: when the prompt continues an
        earlier prompt of this engine (a chat's second turn on), so its later turns find the history exact."""
        mode = self.config.backfill
        if not mode or self.adapter.no_reuse:
            return False
        follow_up = self._follow_ups.observe(prompt_ids) if mode == "auto" else True
        return follow_up and bool(self.config.store_prefix if store_prefix is None else store_prefix)

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
        Engines with ``backfill=True`` do this by themselves after every generation (``"auto"``, the default:
        after every generation whose prompt continues an earlier one), in a background thread; call this where
        generation happens elsewhere or to backfill synchronously."""
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

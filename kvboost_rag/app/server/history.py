"""Exact chat history through the server (issue 33): a chat completion is a chat turn, and its prompt and answer
are backfilled for the chat's next request.

The rule is the in-process one (:mod:`kvboost_core.engine.exact_history`): everything before the prompt's last user
turn (up to the end of its last assistant message) is history, and the history is never re-placed. Its KV is
the exact full-attention prefill in canonical chunks, read from the store where a backfill put it and computed
now where none did, bitwise the same either way. So a request's output still depends only on its messages and
the warmed documents: not on whether its chat's backfill ran, is half done, or was evicted.

After a chat completion finishes, :class:`TurnBackfills` holds a job for its prompt plus answer (plus what the
chat template writes after an answer) and runs it on the engine thread, a slice of about ``step_tokens`` tokens
(whole canonical chunks) per scheduler iteration, only while the server is idle: no request waiting, prefilling
or decoding. A request that arrives during a slice waits for that slice at most. A chat whose next request
comes before its backfill is done loses no bit, only time: that request computes the missing history itself
(and stores it), and the backfill then finds it stored.

Entries live in the request's namespace (one engine per tenant, keys rooted in its namespace), so one tenant's
history is never served to another. They are ordinary store entries, evicted by the store's own policy; an
evicted chunk is recomputed, never served partially (each canonical chunk is checked against its whole chain).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvboost_core.serving.backfill import MAX_PENDING, MAX_PENDING_TOKENS, BackfillJob, step_ends

log = logging.getLogger("kvboost_rag.app.server")


@dataclass(slots=True, eq=False)
class _Job:
    engine: Any  # the namespace's KVEngine
    job: BackfillJob
    ends: list[int]  # chunk-aligned ends of its slices
    next: int = 0  # slices run


@dataclass(slots=True)
class BackfillTotals:
    """What the server's chat backfills did since it started (``/health``'s ``backfill``)."""

    jobs: int = 0  # finished
    tokens: int = 0  # computed (the rest was found stored)
    seconds: float = 0.0  # engine-thread time spent in slices
    superseded: int = 0  # replaced by the same chat's later turn before they finished (nothing lost)
    dropped: int = 0  # dropped unrun past the queue's bounds: that chat's next turn computes its history
    failed: int = 0  # failed (logged): that chat's next turn computes its history
    pending: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class TurnBackfills:
    """The scheduler's queue of chat-turn backfills; every method runs on the engine thread."""

    def __init__(self, step_tokens: int = 256, *, max_pending: int = MAX_PENDING,
                 max_pending_tokens: int = MAX_PENDING_TOKENS) -> None:
        for name, v in (("step_tokens", step_tokens), ("max_pending", max_pending),
                        ("max_pending_tokens", max_pending_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.step_tokens, self._max_jobs, self._max_tokens = step_tokens, max_pending, max_pending_tokens
        self._queue: collections.deque[_Job] = collections.deque()
        self.totals = BackfillTotals()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, engine: Any, job: BackfillJob) -> None:
        """Queue ``job`` on ``engine``. A pending job of the same engine whose tokens the new one starts with is
        replaced (the later turn holds the earlier one; what the earlier one stored is found stored)."""
        kept = [j for j in self._queue
                if not (j.engine is engine and job.token_ids[: len(j.job.token_ids)] == j.job.token_ids)]
        self.totals.superseded += len(self._queue) - len(kept)
        self._queue = collections.deque(kept)
        self._queue.append(_Job(engine, job, step_ends(job.chunks, self.step_tokens)))
        while len(self._queue) > 1 and (len(self._queue) > self._max_jobs
                                        or sum(len(j.job.token_ids) for j in self._queue) > self._max_tokens):
            self._queue.popleft()
            self.totals.dropped += 1
            (log.warning if self.totals.dropped == 1 else log.debug)(
                "the chat backfill queue is full (%d jobs, %d tokens); dropped the oldest job, whose chat's next "
                "request computes its history instead of reading it", self._max_jobs, self._max_tokens)
        self.totals.pending = len(self._queue)

    def step(self) -> None:
        """One slice of the oldest job: its prefix up to the next chunk-aligned end, computed exactly where not
        stored yet, and stored."""
        if not self._queue:
            return
        j = self._queue[0]
        t0 = time.perf_counter()
        try:
            _, computed = j.engine.backfill_step(j.job, j.ends[j.next])
        except Exception as exc:  # a failed job loses only its chat's speed-up: never the loop or a request
            log.warning("a chat backfill failed (%s); that chat's next request computes its history",
                        type(exc).__name__)
            self._queue.popleft()
            self.totals.failed += 1
        else:
            j.next += 1
            self.totals.tokens += computed
            if j.next == len(j.ends):
                self._queue.popleft()
                self.totals.jobs += 1
        self.totals.seconds += time.perf_counter() - t0
        self.totals.pending = len(self._queue)

"""Exact history: after a generation, recompute its KV as a plain prefill would and store it as exact prefix.

Why: a turn served from re-placed documents holds approximate KV, which is never stored (``store_repaired`` is
off), so the next turn of the same conversation finds an exact prefix only up to the first re-placed document
and repairs the whole history again: every follow-up pays CacheBlend's cost and CacheBlend's error. A backfill
job computes the prompt plus the generated tokens causally in every layer (exact prefix entries reused, the rest
computed) and stores each chunk as an exact prefix entry. The next turn then finds its whole history exact, as
vLLM's prefix cache does after a full prefill, and its answer is the full prefill's answer wherever nothing new
was re-placed.

The cost is one prefill of what was not exact yet, paid between turns by one daemon thread, in steps of about
``step_tokens`` that start only while no request is in flight (a request that arrives mid-step shares the CPU
with at most one step).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kvboost_core.assembly import Chunk, plan_chunks
from kvboost_core.segments import TokenizedSegment, cut_messages

log = logging.getLogger(__name__)

STEP_TOKENS = 512  # tokens per step: bounds how long a request arriving mid-step shares the CPU with a job
FOLLOW_UP_WAIT_S = 120.0  # how long a follow-up waits for its history's backfill before it re-places instead
EXIT_WAIT_S = 60.0  # at interpreter exit: how long to let a running step finish (a step is about a second)
# A step starts only once no request has been in flight for this long: a stream's reader taking its next piece,
# or calls back to back, keep the backfill off; a reader that leaves a stream open does not.
IDLE_GRACE_S = 0.05
# Jobs waiting at once (each one chat's latest turn: a newer turn replaces its chat's older one) and their tokens
# (held as Python ints, about 40 bytes each). Past either bound the oldest job is dropped, counted in
# ``Backfiller.dropped`` (the engine's ``stats()["backfill_dropped"]``): that chat's next turn is re-placed.
MAX_PENDING = 256
MAX_PENDING_TOKENS = 1 << 20
REMEMBER = 4096  # prompts FollowUps remembers (about 150 bytes each); past it the oldest is forgotten, counted


@dataclass(frozen=True, slots=True)
class BackfillJob:
    """A token sequence and the chunks its prefix entries are stored under (the next prompt's chunks)."""

    token_ids: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    prompt_len: int = -1  # tokens of the prompt it was generated from (-1: all of token_ids)
    # True: stored as canonical chunks (kvboost_core.serving.canonical), which a chat call's history reads; False: as
    # the engine's ordinary prefix entries, which other calls read
    canonical: bool = False

    def continued_by(self, ids: Sequence[int]) -> bool:
        """Is ``ids`` a later turn of this conversation (this job's prompt followed by more)?"""
        n = len(self.token_ids) if self.prompt_len < 0 else self.prompt_len
        return len(ids) > n and tuple(ids[:n]) == self.token_ids[:n]

    def __post_init__(self) -> None:
        if not self.chunks or self.chunks[0].start != 0 or self.chunks[-1].end != len(self.token_ids):
            raise ValueError("BackfillJob.chunks must cover token_ids from 0 to the end")
        if any(a.end != b.start for a, b in zip(self.chunks, self.chunks[1:])):
            raise ValueError("BackfillJob.chunks must be contiguous")


class FollowUps:
    """An engine's recent prompts, to tell a conversation's later turn from a new question (``backfill="auto"``).

    A prompt that starts with all of an earlier prompt and goes on (its answer, the next question) is a
    follow-up: the conversation has a history worth keeping exact. A RAG question that only shares the system
    turn or the documents with an earlier one is not, so one-shot questions never pay for a backfill.

    Each prompt is remembered as its length and a 61-bit polynomial hash of its ids (a collision costs one
    needless backfill, never a wrong answer), ``remember`` of them, least recently seen forgotten first and
    counted in ``forgotten``. A lookup hashes the new prompt once and probes each remembered length."""

    __slots__ = ("_recent", "_lengths", "_remember", "_lock", "forgotten")

    _MOD = (1 << 61) - 1
    _BASE = 0x5BD1E995

    def __init__(self, remember: int = REMEMBER) -> None:
        if remember < 1:
            raise ValueError(f"remember must be >= 1, got {remember!r}")
        self._recent: OrderedDict[tuple[int, int], None] = OrderedDict()  # (length, hash), least recent first
        self._lengths: Counter[int] = Counter()  # length -> remembered prompts of that length
        self._remember = remember
        self._lock = threading.Lock()
        self.forgotten = 0  # prompts forgotten to make room: a chat among them is no longer recognised

    def observe(self, ids: Sequence[int]) -> bool:
        """Remember ``ids``; True when it continues a remembered prompt."""
        n = len(ids)
        with self._lock:
            probes = {length for length in self._lengths if length < n}
            prefix: list[tuple[int, int]] = []
            h = 0
            for i, t in enumerate(ids, 1):
                h = (h * self._BASE + int(t) + 1) % self._MOD
                if i in probes:
                    prefix.append((i, h))
            follow = any(p in self._recent for p in prefix)
            key = (n, h)
            if key in self._recent:
                self._recent.move_to_end(key)
            else:
                self._recent[key] = None
                self._lengths[n] += 1
                if len(self._recent) > self._remember:
                    (old, _), _ = self._recent.popitem(last=False)
                    self._lengths[old] -= 1
                    if not self._lengths[old]:
                        del self._lengths[old]
                    self.forgotten += 1
        return follow


@dataclass(frozen=True, slots=True)
class BackfillResult:
    tokens: int  # in the sequence
    reused_exact: int  # tokens whose exact KV was stored already (counted once, at the first step)
    computed: int  # tokens computed by this job
    seconds: float
    complete: bool  # False: stopped before the end (the worker was closed)
    cpu_s: float = 0.0  # CPU time of the thread that ran it (the worker's: what the backfill cost the machine)
    steps: int = 0  # steps run
    max_step_s: float = 0.0  # the longest step's wall time: what a request arriving mid-step may wait for


def conversation_job(segments: Sequence[TokenizedSegment], chunks: Sequence[Chunk], generated: Sequence[int],
                     spans_of: Callable[[Sequence[int]], list[tuple[int, int]]], *,
                     canonical: bool = False, turn_end: Sequence[int] = ()) -> BackfillJob:
    """The job for a prompt and what was generated after it, chunked as the next turn's prompt will be.

    A chat template continues the prompt's last text segment with the answer, so the generated tokens extend
    that segment and it is re-cut with the same rule (chunking depends only on the segment's ids, and a cut
    depends only on the tokens up to ``chunk_size + boundary_window`` after the chunk's start, so every full
    chunk matches the next prompt's; the last one is matched token by token by the lookup's partial rule).
    After a document (cacheable) segment the generated tokens start a segment of their own.

    ``canonical`` with ``turn_end``: a chat's history, cut after every message (:func:`cut_messages`) as the next
    turn's history read cuts it, so the chunks up to this turn's history are the ones it read (and stored), and
    only the new question and answer are computed."""
    ids = [t for s in segments for t in s.token_ids]
    gen = list(generated)
    if not segments or not ids:
        raise ValueError("conversation_job needs a non-empty prompt")
    last = segments[-1]
    if canonical and turn_end:
        segs = list(segments)
        if last.cacheable or last.is_lead:
            segs += [TokenizedSegment(tuple(gen), len(ids), cacheable=False)] if gen else []
        else:
            segs[-1] = replace(last, token_ids=(*last.token_ids, *gen))
        cut = cut_messages(segs, len(ids) + len(gen), turn_end)
        return BackfillJob(token_ids=tuple(ids + gen), chunks=tuple(plan_chunks(cut, spans_of)),
                           prompt_len=len(ids), canonical=True)
    if last.cacheable or last.is_lead:
        head = list(chunks)
        tail_start, tail_ids, seg_index = len(ids), gen, len(segments)
    else:
        head = [c for c in chunks if c.segment != len(segments) - 1]
        tail_start, tail_ids, seg_index = last.start, [*last.token_ids, *gen], len(segments) - 1
    tail = [Chunk(tail_start + a, tail_start + b, seg_index) for a, b in spans_of(tail_ids)] if tail_ids else []
    return BackfillJob(token_ids=tuple(ids + gen), chunks=tuple(head + tail), prompt_len=len(ids),
                       canonical=canonical)


def step_ends(chunks: Sequence[Chunk], step_tokens: int) -> list[int]:
    """Chunk-aligned positions at which a job's steps end: each step holds whole chunks, about ``step_tokens``."""
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens!r}")
    ends, start = [], 0
    for ch in chunks:
        if ch.end - start >= step_tokens:
            ends.append(ch.end)
            start = ch.end
    if not ends or ends[-1] != chunks[-1].end:
        ends.append(chunks[-1].end)
    return ends


# run_step(job, end) -> (tokens already exact, tokens computed) for the prefix [0, end) of the job
StepFn = Callable[[BackfillJob, int], tuple[int, int]]


def run_job(job: BackfillJob, run_step: StepFn, *, step_tokens: int = STEP_TOKENS,
            may_continue: Callable[[], bool] = lambda: True) -> BackfillResult:
    """Run ``job`` step by step; ``may_continue()`` is asked before each step (it may wait), False stops it."""
    t0 = time.perf_counter()
    reused = computed = steps = 0
    cpu = longest = 0.0  # the steps' CPU time only: waiting for an idle moment costs none
    for i, end in enumerate(step_ends(job.chunks, step_tokens)):
        if not may_continue():
            return BackfillResult(len(job.token_ids), reused, computed, time.perf_counter() - t0, False, cpu,
                                  steps, longest)
        c0, w0 = time.thread_time(), time.perf_counter()
        exact, done = run_step(job, end)
        cpu += time.thread_time() - c0
        longest, steps = max(longest, time.perf_counter() - w0), steps + 1
        if i == 0:
            reused = exact
        computed += done
    return BackfillResult(len(job.token_ids), reused, computed, time.perf_counter() - t0, True, cpu, steps, longest)


class Backfiller:
    """One daemon worker running backfill jobs in steps, each step only while no request is in flight.

    A job whose sequence extends a pending one's replaces it (the newer turn holds the older one's tokens).
    Pending jobs are bounded by ``max_pending`` and ``max_pending_tokens`` (see ``MAX_PENDING``); past them the
    oldest is dropped and counted in ``dropped``."""

    def __init__(self, run_step: StepFn, *, step_tokens: int = STEP_TOKENS, max_pending: int = MAX_PENDING,
                 max_pending_tokens: int = MAX_PENDING_TOKENS) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending!r}")
        if max_pending_tokens < 1:
            raise ValueError(f"max_pending_tokens must be >= 1, got {max_pending_tokens!r}")
        self._run_step = run_step
        self._step_tokens = step_tokens
        self._pending: deque[BackfillJob] = deque()
        self._max_pending = max_pending
        self._max_tokens = max_pending_tokens
        self._pending_tokens = 0
        self._dropped = 0
        self._cond = threading.Condition()
        self._busy = 0  # requests in flight
        self._idle_since = float("-inf")  # when the last request in flight ended
        self._running: BackfillJob | None = None  # the job being worked on
        self._closed = False
        self._thread: threading.Thread | None = None
        self.results: deque[BackfillResult] = deque(maxlen=64)  # the latest, for stats and benchmarks

    def submit(self, job: BackfillJob) -> None:
        with self._cond:
            if self._closed:
                return
            for old in list(self._pending):
                if old.canonical == job.canonical and job.token_ids[: len(old.token_ids)] == old.token_ids:
                    self._pending.remove(old)  # superseded: the new job covers it
                    self._pending_tokens -= len(old.token_ids)
            self._pending.append(job)
            self._pending_tokens += len(job.token_ids)
            while len(self._pending) > 1 and (len(self._pending) > self._max_pending
                                              or self._pending_tokens > self._max_tokens):
                old = self._pending.popleft()
                self._pending_tokens -= len(old.token_ids)
                self._dropped += 1
                (log.warning if self._dropped == 1 else log.debug)("kvboost: the backfill queue is full (%d jobs, %d tokens); dropped the oldest job, "
                            "whose chat's next turn is re-placed instead of exact", self._max_pending,
                            self._max_tokens)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvboost-backfill", daemon=True)
                self._thread.start()
                _LIVE.add(self)
            self._cond.notify_all()

    @contextmanager
    def request(self) -> Iterator[None]:
        """Mark a request in flight: no backfill step starts until it ends."""
        with self._cond:
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                if not self._busy:
                    self._idle_since = time.monotonic()
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job is done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_for(self, ids: Sequence[int], timeout: float) -> bool:
        """Block while a pending or running job is an earlier turn of ``ids`` (up to ``timeout`` s), so a quick
        follow-up gets the exact history rather than an answer that depends on the backfill's timing. False on
        timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(j.continued_by(ids) for j in (*self._pending, self._running) if j is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + int(self._running is not None)

    @property
    def dropped(self) -> int:
        """Jobs dropped unrun because the queue was full (not those superseded by their chat's next turn)."""
        with self._cond:
            return self._dropped

    def close(self, timeout: float | None = None) -> None:
        """Drop pending jobs and stop the worker after its current step (waiting up to ``timeout`` for it)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._pending_tokens = 0
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _idle_left(self) -> float:
        """Seconds until a step may start (<= 0: now): none while a request is in flight, then ``IDLE_GRACE_S``
        after the last one ended. Called with the lock held."""
        return 0.05 if self._busy else self._idle_since + IDLE_GRACE_S - time.monotonic()

    def _idle_step(self) -> bool:
        """Wait until no request has been in flight for ``IDLE_GRACE_S``; False when closed."""
        with self._cond:
            while not self._closed:
                left = self._idle_left()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False

    def _loop(self) -> None:
        while True:
            with self._cond:
                # a job is taken only when a step may start: until then it stays pending, where a later turn of
                # its chat can still replace it (taken at once, it would run after a request as a stale turn)
                while not self._closed:
                    if not self._pending:
                        self._cond.wait()
                        continue
                    left = self._idle_left()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                job = self._pending.popleft()
                self._pending_tokens -= len(job.token_ids)
                self._running = job
            try:
                self.results.append(self._run(job))
            except Exception:  # a failed job loses only its own speed-up: never the worker or a request
                log.warning("kvboost: a backfill job failed; its conversation is served without it", exc_info=True)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _run(self, job: BackfillJob) -> BackfillResult:
        return run_job(job, self._run_step, step_tokens=self._step_tokens, may_continue=self._idle_step)


# A daemon thread still inside torch when the interpreter finalizes aborts the process ("terminate called without
# an active exception"): at exit every worker is closed and its running step awaited.
_LIVE: weakref.WeakSet[Backfiller] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for bf in list(_LIVE):
        bf.close(EXIT_WAIT_S)

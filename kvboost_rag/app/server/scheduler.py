"""Continuous batching at iteration level (Orca / vLLM style), on one engine thread.

Each loop iteration: run queued tasks, advance the document warm in progress by about ``warm_budget`` tokens
(kvboost_rag.app.server.warmjob: one layer at least, bit for bit an in-process warm), drop cancelled requests,
admit at most one waiting request, advance the prefill in progress by one piece, then one batched decode step
for every running request.
Chunked prefill (``prefill_chunk`` tokens, ``--prefill-chunk``): a prompt's head (everything before its first
re-placed document, e.g. all of a long cold prompt but its last chunk) is computed about ``prefill_chunk``
tokens per iteration, and the rest in one more, so the running requests wait for one piece between two tokens,
not for a whole prefill. Pieces are whole canonical chunks (kvboost_core.serving.canonical), so splitting changes no
bit of any output. ``prefill_chunk=None`` prefills a prompt in one iteration. A request leaves at
EOS, at a stop string, at its token limit, or when its client goes away (``cancel``). ``deterministic``
(``--deterministic``, default) keeps a request's logits independent of the batch (kvboost_core.serving.batch).

All model work happens on this one thread, so the engines (one per namespace, sharing the model) are never
driven concurrently. Requests talk to their HTTP handler through ``emit(kind, payload)``, which the handler
makes thread-safe (``loop.call_soon_threadsafe``). Events: ``("start", Started)`` once the prompt is
prefilled, ``("text", str)`` pieces, then ``("done", Finished)`` or ``("error", APIError)``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from kvboost_core import cache_counts
from kvboost_core.decode import BadLogits, TextStream, next_piece, sample
from kvboost_core.serving.batch import BatchedDecoder, BatchSlot, Prefilled, PrefillTask, start_prefill
from kvboost_core.serving.paged_batch import PagedBatchedDecoder
from kvboost_core.serving.pages import PoolFull
from kvboost_rag.aio import thread_setting
from kvboost_rag.app.server.history import TurnBackfills
from kvboost_rag.app.server.protocol import APIError
from kvboost_rag.app.server.request import Finished, GenRequest, QueueFull, Started
from kvboost_rag.app.server.warmjob import WarmJob

log = logging.getLogger("kvboost_rag.app.server")
# While requests decode, a warm slice ends at its first pause point (a layer) after this share of the last decode
# step's time. Measured on SmolLM2 (docs/serving.md): slices overrun it by up to a layer and a document's start.
WARM_SLICE_OF_STEP = 0.3

__all__ = ["Finished", "GenRequest", "QueueFull", "Scheduler", "Started"]


class Scheduler:
    def __init__(self, driver: Any, *, max_batch: int = 8, max_queue: int = 64, metrics: Any = None,
                 step_delay: float = 0.0, prefill_chunk: int | None = None, deterministic: bool = True,
                 warm_budget: int = 256, warm_step_share: float | None = WARM_SLICE_OF_STEP,
                 kv_pool_bytes: int | None = None, page_tokens: int = 16) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if isinstance(warm_budget, bool) or not isinstance(warm_budget, int) or warm_budget < 1:
            raise ValueError(f"warm_budget must be an int >= 1, got {warm_budget!r}")
        self.warm_budget = warm_budget
        if warm_step_share is not None and (isinstance(warm_step_share, bool)
                                            or not isinstance(warm_step_share, (int, float)) or not warm_step_share > 0):
            raise ValueError(f"warm_step_share must be None or a number > 0, got {warm_step_share!r}")
        self.warm_step_share = warm_step_share  # None: the token budget alone bounds a warm slice
        self._warms: collections.deque[WarmJob] = collections.deque()  # document warms, oldest first
        self._prefilling: tuple[GenRequest, PrefillTask] | None = None  # the chunked prefill in progress
        # kv_pool_bytes: the requests' KV in pages of one pool, identical pages held once (PagedBatchedDecoder);
        # a request the pool cannot hold yet waits, prefilled, until pages free up ("parked")
        self.decoder: BatchedDecoder | PagedBatchedDecoder = (
            BatchedDecoder(driver, max_batch, deterministic=deterministic) if kv_pool_bytes is None else
            PagedBatchedDecoder(driver, max_batch, pool_bytes=kv_pool_bytes, page_tokens=page_tokens,
                                deterministic=deterministic))
        self._parked: collections.deque[tuple[GenRequest, Prefilled, int]] = collections.deque()
        self.max_queue = max_queue
        self.metrics = metrics
        self.step_delay = step_delay  # tests only: slows decode so backpressure can be observed deterministically
        self._pending: collections.deque[GenRequest] = collections.deque()
        self._running: dict[BatchSlot, GenRequest] = {}
        self._tasks: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvboost-scheduler", daemon=True)
        self._apply_threads = thread_setting()  # --threads, set in this (the main) thread, for the engine thread
        self._tokens_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._last_step_s = 0.0  # the last decode step's wall time: bounds a warm slice while requests decode
        # chat turns' backfills (kvboost_rag.app.server.history): a slice per iteration while nothing else runs
        self.backfills = TurnBackfills(warm_budget)

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def submit(self, req: GenRequest) -> None:
        with self._cv:
            if len(self._pending) >= self.max_queue and not (self.decoder.free and not self._pending):
                raise QueueFull
            self._pending.append(req)
            self._cv.notify()

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True  # read by the engine thread at the next iteration
        with self._cv:
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between iterations (e.g. warming); returns a Future."""
        fut: Future = Future()
        with self._cv:
            self._tasks.append((fn, fut))
            self._cv.notify()
        return fut

    def warm(self, rag: Any, texts: list[str]) -> WarmJob:
        """Warm ``texts`` into ``rag`` on the engine thread, a piece per iteration between decode steps; the
        job's ``future`` resolves to its :class:`WarmTotals` (or an APIError)."""
        job = WarmJob(rag, list(texts), self.warm_budget, setup=self._apply_threads)
        with self._cv:
            self._warms.append(job)
            self._cv.notify()
        return job

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last steps (0 when idle)."""
        w = list(self._tokens_window)
        if len(w) < 2 or time.perf_counter() - w[-1][0] > 5.0:
            return 0.0
        return sum(n for _, n in w[1:]) / max(w[-1][0] - w[0][0], 1e-9)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        self._apply_threads()
        while True:
            with self._cv:
                while not (self._stop or self._tasks or self._running or self._pending or self._prefilling
                           or self._parked or self._warms or self.backfills.pending):
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    break
                task = self._tasks.popleft() if self._tasks else None
                job = self._warms[0] if self._warms else None
                free = self.decoder.free and self._prefilling is None and not self._parked
                req = self._pending.popleft() if self._pending and free else None
                idle = not (task or job or req or self._pending or self._running or self._prefilling
                            or self._parked)
            if idle:
                self.backfills.step()  # one slice; a request arriving meanwhile waits for it at most
            if task is not None:
                self._run_task(*task)
            if job is not None:
                self._advance_warm(job)
            try:
                self._drop_cancelled()
                self._unpark()
                if req is not None:
                    self._admit(req)
                if self._prefilling is not None:
                    self._advance_prefill()
                if self._running:
                    self._step()
            except Exception as exc:  # the loop must survive anything: fail the requests it holds, go on
                log.error("scheduler iteration failed: %s; failing %d running requests", type(exc).__name__,
                          len(self._running))
                self._fail_running()
        for job in self._warms:
            job.close()  # a warm paused between two layers: its thread unwinds
            if not job.future.done():
                job.future.set_exception(APIError(503, "the server is shutting down", type="server_error"))
        held = [self._prefilling[0]] if self._prefilling is not None else []
        for r in [*self._pending, *held, *(p[0] for p in self._parked), *self._running.values()]:
            r.emit("error", APIError(503, "the server is shutting down", type="server_error"))

    def _fail_running(self) -> None:
        for slot, r in list(self._running.items()):
            r.emit("error", APIError(500, "the engine failed while decoding", type="server_error"))
            self._running.pop(slot, None)
        self.decoder.reset()

    def _run_task(self, fn: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the caller's thread
            fut.set_exception(exc)

    def _advance_warm(self, job: WarmJob) -> None:
        """One slice of the oldest document warm (the others wait their turn: one warm at a time keeps the
        gap a stream sees to one slice). While requests decode, a slice also ends once it has run
        ``warm_step_share`` of the last decode step's time, so a stream's gap between two tokens stays within
        about 2x its usual one on any model and machine; with nothing decoding, only the token budget applies."""
        share = self.warm_step_share
        seconds = share * self._last_step_s if share and self._running and self._last_step_s else None
        try:
            job.step(seconds)
        except Exception as exc:  # a document refused or a failing engine: that request fails, the loop goes on
            if not isinstance(exc, ValueError):
                log.error("warming failed: %s", type(exc).__name__)  # never the documents
            job.fail(exc)
        if job.future.done():
            with self._cv:
                self._warms.popleft()

    def _drop_cancelled(self) -> None:
        if self._prefilling is not None and self._prefilling[0].cancelled:
            self._prefilling = None
        for slot, r in list(self._running.items()):
            if r.cancelled:
                self._leave(slot)
        self._parked = collections.deque(p for p in self._parked if not p[0].cancelled)
        with self._cv:
            if any(r.cancelled for r in self._pending):
                self._pending = collections.deque(r for r in self._pending if not r.cancelled)

    def _leave(self, slot: BatchSlot, scrub: bool = False) -> None:
        """``scrub``: the row's KV may hold NaN/inf (its logits were bad); zero it before another request
        reuses the row (see BatchedDecoder.remove)."""
        self._running.pop(slot, None)
        self.decoder.remove(slot, scrub=scrub)

    def _admit(self, r: GenRequest) -> None:
        if r.cancelled:
            return
        try:
            turn: dict[str, Any] = {}
            if r.messages is not None:  # exactly as ChatKVBoost renders and tokenizes a chat prompt (a turn)
                prompt = r.rag.chat_prompt(r.messages)
                special: bool | None = r.rag.chat_add_special_tokens(prompt)
                plan = r.rag.plan(prompt, add_special_tokens=special)
                turn = r.rag.chat_turn(plan, r.rag.chat_history(r.messages), bool(special))
                r.turn_end = tuple(turn["turn_end"])
            else:
                prompt, special = r.prompt or "", None
                plan = r.rag.plan(prompt, add_special_tokens=special)
            n_prompt = sum(len(s.token_ids) if s.token_ids is not None else 0 for s in plan.segments)
            ctx = r.rag.engine.driver.max_context
            if r.fill_context:
                r.params = replace(r.params, max_new_tokens=max(1, ctx - n_prompt) if ctx else 256)
            r.check_limits(n_prompt)
            task = r.task = start_prefill(r.rag.engine, plan.segments, add_special_tokens=False,
                                          history_tokens=turn.get("history_tokens"), turn_end=r.turn_end)
            if self.prefill_chunk is not None:
                self._prefilling = (r, task)  # advanced piece by piece, between decode steps
                return
            pre = task.finish()
        except Exception as exc:
            r.fail_prefill(exc)
            return
        self._join(r, pre)

    def _advance_prefill(self) -> None:
        assert self._prefilling is not None
        r, task = self._prefilling
        try:
            if not task.done:
                task.advance(self.prefill_chunk)  # one piece of the head; the rest in a later iteration
                return
            self._prefilling = None
            pre = task.finish()
        except Exception as exc:
            self._prefilling = None
            r.fail_prefill(exc)
            return
        self._join(r, pre)

    def _join(self, r: GenRequest, pre: Prefilled) -> None:
        """First token from the prefill's logits, then a row in the batch (with a page pool: the row first, so a
        request the pool cannot hold yet waits, parked, before its first token)."""
        res = pre.result
        if r.params.seed is not None:
            r.generator = torch.Generator(device=res.last_logits.device).manual_seed(r.params.seed)
        try:
            token = sample(res.last_logits, r.params, r.generator)
        except BadLogits as exc:  # this prompt's logits only: the batch never saw it
            r.fail_logits(exc)
            return
        if isinstance(self.decoder, PagedBatchedDecoder):
            added = self._add(r, pre)
            if added is None:
                self._parked.append((r, pre, token))  # retried as requests leave (_unpark)
            if not added:
                return
        self._start(r, pre, token)

    def _add(self, r: GenRequest, pre: Prefilled) -> bool | None:
        """Give ``r`` its batch row (or pages): True when it has them, None when the pool cannot hold it while
        others run (it waits), False when it failed (its error is sent)."""
        n = len(pre.result.token_ids)
        try:
            r.slot = self.decoder.add(pre.result.cache.keys, pre.result.cache.values, n, n + r.params.max_new_tokens)
            return True
        except PoolFull as exc:
            if self.decoder.size:
                return None
            r.emit("error", APIError(400, f"the server's KV pool cannot hold this request even alone ({exc}): "
                                          "lower max_tokens or shorten the prompt", param="max_tokens"))
        except Exception as exc:  # e.g. out of memory for the batch buffers
            log.error("joining the batch failed: %s", type(exc).__name__)
            r.emit("error", APIError(500, "the engine failed on this request", type="server_error"))
        return False

    def _unpark(self) -> None:
        """Parked requests join, oldest first, while the pool holds them."""
        while self._parked and self.decoder.free:
            r, pre, token = self._parked[0]
            added = self._add(r, pre)
            if added is None:  # still too big while others run: it keeps the head of the line
                return
            self._parked.popleft()
            if added:
                self._start(r, pre, token)

    def _start(self, r: GenRequest, pre: Prefilled, token: int) -> None:
        res = pre.result
        n = len(res.token_ids)
        counts, ttft = cache_counts(res.stats), time.perf_counter() - r.submitted
        r.emit("start", Started(prompt_tokens=n, counts=counts, ttft_s=ttft))
        if self.metrics is not None:
            self.metrics.on_start(ttft, n, counts)
        try:
            pre.store_prefix()  # after the first token: not on the TTFT path
        except Exception as exc:  # a failing store tier must not fail the request
            log.warning("storing the prompt prefix failed: %s", type(exc).__name__)
        r.stream = TextStream(r.rag.tokenizer, r.params.stop)
        if r.slot is None and not self._add(r, pre):  # the dense rows: after the first token, never full
            return
        assert r.slot is not None
        self._running[r.slot] = r
        if self._accept(r, token):
            self._leave(r.slot)

    def _accept(self, r: GenRequest, token: int) -> bool:
        """Record a generated token; True when the request is finished (and its "done" event sent)."""
        assert r.stream is not None and r.slot is not None
        r.generated.append(token)
        piece, reason = next_piece(r.stream, token, eos=r.rag.engine.eos_token_ids, generated=len(r.generated),
                                   limit=r.params.max_new_tokens, full=r.slot.length >= r.slot.capacity,
                                   ignore_eos=r.ignore_eos)
        if piece:
            r.emit("text", piece)
        if reason is None:
            r.next_token = token
            return False
        tail = r.stream.flush()
        if tail:
            r.emit("text", tail)
        r.emit("done", Finished(reason, len(r.generated), r.stream.text))
        if self.metrics is not None:
            self.metrics.on_finish(time.perf_counter() - r.submitted, len(r.generated))
        self._backfill_turn(r)
        return True

    def _backfill_turn(self, r: GenRequest) -> None:
        """Queue the backfill of a finished chat turn (prompt, answer, turn end) for the chat's next request."""
        eng = r.rag.engine
        if r.task is None or not r.task.is_turn or not (eng.config.backfill and eng.config.store_prefix):
            return
        assert r.stream is not None
        try:
            self.backfills.submit(eng, r.task.turn_job(r.generated, r.stream.text, r.turn_end))
        except Exception as exc:  # the answer is delivered: a job that cannot be built costs only speed
            log.warning("queuing a chat backfill failed: %s", type(exc).__name__)

    def _step(self) -> None:
        if self.step_delay:
            time.sleep(self.step_delay)
        t0 = time.perf_counter()
        try:
            logits = self.decoder.step({s: r.next_token for s, r in self._running.items()})
        except Exception as exc:
            log.error("decode step failed: %s; failing the %d running requests", type(exc).__name__,
                      len(self._running))
            self._fail_running()
            return
        finished, failed = [], []
        for s, r in list(self._running.items()):
            try:
                token = sample(logits[s], r.params, r.generator)
            except BadLogits as exc:  # one row's logits (NaN, all masked): that request fails, the others go on
                r.fail_logits(exc)
                failed.append(s)
                continue
            if self._accept(r, token):
                finished.append(s)
        for slot in finished:
            self._leave(slot)
        for slot in failed:
            self._leave(slot, scrub=True)
        now = time.perf_counter()
        self._last_step_s = now - t0
        self._tokens_window.append((now, len(logits)))
        if self.metrics is not None:
            self.metrics.on_step(now - t0, len(logits))

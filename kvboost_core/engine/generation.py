"""Generation: prefill (:mod:`kvboost_core.engine.prefill`), then the decode loop, as a whole result or a text stream."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from kvboost_core.call_options import CallOptions, call_options
from kvboost_core.decode import (
    LogitsProcessor,
    SamplingParams,
    TextStream,
    check_logits_processor,
    next_piece,
    process_and_sample,
)
from kvboost_core.engine.exact_history import BackfillMixin
from kvboost_core.kernels import ops
from kvboost_core.model.forward import decode_step
from kvboost_core.model.lean import lean_decoder
from kvboost_core.results import GenerationResult
from kvboost_core.segments import check_vocab
from kvboost_core.serving.backfill import FOLLOW_UP_WAIT_S, conversation_job


class GenerationStream:
    """An iterator of text pieces; ``result`` is set when it is exhausted."""

    def __init__(self, engine: GenerationMixin, prompt: Any, params: SamplingParams, kw: dict[str, Any]) -> None:
        self._holder: dict[str, GenerationResult] = {}
        self._it = engine._run(prompt, params, self._holder, kw["opts"], kw["logits_processor"], stream=True)
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



class GenerationMixin(BackfillMixin):
    """``generate()`` and ``stream()``."""

    def call_options(self, options: CallOptions | None = None, **kw: Any) -> CallOptions:
        """The call's options as one checked :class:`~kvboost_core.call_options.CallOptions` over this engine's
        config: the per-call keywords ``kw`` (repair, recompute_ratio, store_prefix, add_special_tokens, ...)
        built into one, or ``options`` (built before) checked and returned; both at once is a TypeError. What
        :meth:`generate`/:meth:`stream` take as ``options=``, so a caller (a framework skin) builds a call's
        options once, at its own entry, and carries that value down."""
        if options is None:
            return call_options(self.config, self.driver.num_layers, kw)
        if not isinstance(options, CallOptions):
            raise TypeError(f"options must be a kvboost_core CallOptions (engine.call_options(...)), got "
                            f"{type(options).__name__}")
        if kw:
            raise TypeError(f"pass the call's options as options= or as keywords, not both (got options= and "
                            f"{', '.join(sorted(kw))})")
        return options

    def stream(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               stop: str | Sequence[str] | None = None, seed: int | None = None, *,
               logits_processor: LogitsProcessor | None = None, options: CallOptions | None = None,
               **kw: Any) -> GenerationStream:
        """Yield text pieces as tokens are produced; the returned stream's ``.result`` holds the
        :class:`GenerationResult` once it is exhausted. Arguments are validated before the first piece.
        ``logits_processor`` and ``options``: see :meth:`generate`."""
        params = SamplingParams.create(max_new_tokens, temperature, top_p, stop, seed)
        opts = self.call_options(options, **kw)
        check_logits_processor(logits_processor)
        return GenerationStream(self, prompt, params, {"opts": opts, "logits_processor": logits_processor})

    def generate(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, *,
                 logits_processor: LogitsProcessor | None = None, options: CallOptions | None = None,
                 **kw: Any) -> GenerationResult:
        """Generate a completion of ``prompt`` (document KV reused as in :meth:`prefill`).

        ``logits_processor(generated_ids, logits) -> logits`` is applied to the next-token logits (float32,
        shape (V,)) before every token is sampled, the first one included; it may raise
        :class:`kvboost_core.decode.StopGeneration` to end the generation (``finish_reason == "stop"``).
        It only changes which token is picked: prefill, reuse and the stats are those of a plain call.

        ``history_tokens=h`` makes it a chat call whose history is the prompt's first ``h`` tokens (up to the end
        of its last assistant message; 0 on a chat's first turn): the history is computed exactly, never
        re-placed, and the prompt and answer are backfilled for the next turn (see
        :mod:`kvboost_core.engine.exact_history`). None (default): a one-shot completion. ``turn_end``: the token ids
        the chat template writes after an assistant message (``<|im_end|>\n``), so the backfill holds the next
        turn's history as it will be rendered.

        The per-call options ``kw`` (``repair``, ``recompute_ratio``, ``store_prefix``, ``add_special_tokens``,
        ``history_tokens``, ...) are checked into one :class:`~kvboost_core.call_options.CallOptions`; or pass one
        already built (:meth:`call_options`) as ``options=`` instead of them."""
        holder: dict[str, GenerationResult] = {}
        params = SamplingParams.create(max_new_tokens, temperature, top_p, stop, seed)
        opts = self.call_options(options, **kw)
        check_logits_processor(logits_processor)
        for _ in self._run(prompt, params, holder, opts, logits_processor):
            pass
        return holder["result"]

    def _run(self, prompt: Any, params: SamplingParams, holder: dict | None, opts: CallOptions,
             logits_processor: LogitsProcessor | None, *, stream: bool = False) -> Iterator[str]:
        t0 = time.perf_counter()
        if self.config.backfill and self._backfill.pending:  # a follow-up of a turn being backfilled waits for it
            self._backfill.wait_for(self.tokenize_ids(prompt, opts.add_special_tokens), FOLLOW_UP_WAIT_S)
        args = (prompt, params, holder, t0, opts, logits_processor)
        if stream:
            # No backfill step starts while the stream computes (its prefill, each decode step), but one may run
            # between its pieces: a stream its reader left open, neither finished nor closed, must not hold the
            # backfill off (a follow-up waiting for its history would wait for as long).
            yield from self._run_request(*args, busy=self._backfill.request)
        else:
            with self._backfill.request():  # generate() runs to the end at once: no backfill step starts meanwhile
                yield from self._run_request(*args, busy=contextlib.nullcontext)

    def _run_request(self, prompt: Any, params: SamplingParams, holder: dict | None, t0: float, opts: CallOptions,
                     logits_processor: LogitsProcessor | None, *,
                     busy: Callable[[], AbstractContextManager[Any]]) -> Iterator[str]:
        """The request; ``busy()`` marks each stretch of computing (none spans a ``yield``)."""
        spec, add_special_tokens, store_prefix = opts.spec, opts.add_special_tokens, opts.store_prefix
        history_tokens, turn_end = opts.history_tokens, opts.turn_end
        generated: list[int] = []
        with busy():
            prepared = self.prompt_chunks(prompt, add_special_tokens)
            chat = history_tokens is not None
            if history_tokens is not None and history_tokens > prepared[1]:
                raise ValueError(f"history_tokens ({history_tokens}) is longer than the prompt ({prepared[1]} tokens)")
            check_vocab(list(turn_end), self._vocab, "turn_end")
            canonical = chat and self.chat_canonical()
            if canonical:
                pre, cache, to_store = self._chat_prefill(prepared, spec, params.max_new_tokens, history_tokens or 0,
                                                          store_prefix, turn_end)
            else:
                pre, plan, cache = self._prefill(prompt, spec, params.max_new_tokens, add_special_tokens, t0,
                                                 prepared)
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.driver.device).manual_seed(params.seed)
            # The processor may mask in place: it gets a copy, so the result's first_logits stay the model's own.
            first = pre.last_logits if logits_processor is None else pre.last_logits.clone()
            token = process_and_sample(logits_processor, generated, first, params, generator)  # None: stopped
            ttft = time.perf_counter() - t0
            # after the first token: not on the TTFT path
            if canonical:
                for key, block in to_store:
                    self.store.put(key, block)
            else:
                self._store_prefix(plan, cache, spec, store_prefix)

        # None: the planned forward decodes. Built per call (0.7 ms on SmolLM2), so it sees the model as it is now
        # (a reader adapter attached since the last call sends decode back to the planned forward).
        lean = None if cache.hf is not None else lean_decoder(self.driver, attend=ops.decode_attend(self.driver.device))
        capacity = cache.keys[0].shape[2]
        all_ids = torch.empty(capacity, dtype=torch.long, device=self.driver.device)
        all_ids[: len(pre.token_ids)] = torch.tensor(pre.token_ids)
        text = TextStream(self.tokenizer, params.stop)
        pos = len(pre.token_ids)
        finish = "length"
        while True:
            if token is None:  # the logits processor ended the generation
                finish = "stop"
                break
            generated.append(token)
            piece, reason = next_piece(text, token, eos=self._eos, generated=len(generated),
                                       limit=params.max_new_tokens, full=pos >= capacity)
            if piece:
                yield piece
            if reason is not None:
                finish = reason
                break
            all_ids[pos] = token
            with busy():
                if cache.hf is not None:
                    logits = self.driver.hf_step(cache, token)
                elif lean is not None:
                    logits = lean.step(all_ids[pos:pos + 1], pos, cache)
                else:
                    logits = decode_step(self.driver, all_ids, pos, cache)
                token = process_and_sample(logits_processor, generated, logits.float(), params, generator)
            pos += 1
        yield text.flush()
        if holder is not None:
            stats = pre.stats.as_dict() | {"ttft_s": ttft, "finish_reason": finish}
            holder["result"] = GenerationResult(
                text=text.text, token_ids=generated, prompt_token_ids=pre.token_ids, ttft_s=ttft,
                total_s=time.perf_counter() - t0, reuse_ratio=pre.stats.reuse_ratio, finish_reason=finish,
                stats=stats, first_logits=pre.last_logits)
        if chat and self._chat_backfills(store_prefix):  # the next turn's history: prompt, answer, turn end
            answer = self.turn_answer(generated, text.text, turn_end)
            self._backfill.submit(conversation_job(prepared[0], prepared[2], answer, self.spans,
                                                   canonical=canonical, turn_end=turn_end if canonical else ()))
        elif not chat and self._backfills(store_prefix, pre.token_ids):
            self._backfill.submit(conversation_job(prepared[0], plan.chunks, generated, self.spans))

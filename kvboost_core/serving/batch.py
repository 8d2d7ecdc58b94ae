"""Batched decode over several requests' caches (iteration-level / continuous batching).

Each request is prefilled on its own (with reuse and repair, see ``engine._prefill``); its assembled KV is then
copied once into a row of a shared ``(rows, H_kv, T, D)`` buffer per layer and the request decodes with the
others, one token per request per step, until it leaves. Requests have different lengths: row ``i`` attends to
slots ``[0, pos_i]`` only, so padding is never attended, and a request's logits do not depend on its
neighbours, to the last bit (see "Batch invariance" below).

Design choices, and why:

- One copy per request at admission: document KV from the store is already copied into each request's
  assembled cache by ``place`` (it is re-rotated per request, so it cannot be shared as is); the batch buffer
  then holds it for the request's lifetime and the prefill buffer is freed. (``serving.paged_batch`` holds it in
  pages of a shared pool instead, where requests over the same documents at the same positions share them.)
- Active rows are kept contiguous (``0..n-1``): a leaving request's row is filled by the last row, so every
  step reads ``buf[:n, :, :L]``, a view, never a gather.
- The buffer grows (doubling, re-allocated and copied) when the longest active request outgrows it: memory
  follows the longest active request's current length, not its token limit or the model's context.
- Batch invariance: a request's tokens must not depend on who shares its steps. Torch's CPU kernels pick
  their summation order by the shape of the whole call, so during a step every plain ``nn.Linear`` of the
  decoder (and the LM head) runs on fixed tiles of ``ROW_TILE`` rows, and attention runs once per row on the
  row's own keys ``[0, pos_i]`` (the fused attention kernel splits its work differently when the batch is
  small for the thread count: at 2 threads a row alone got other bits than in a batch). Why and what was measured:
  kvboost_core/serving/invariant.py. Checked end to end in tests/test_server_determinism.py (a request alone vs
  after others vs in a batch, bitwise, at 1 and 2 threads). Quantized linear subclasses are left as they are
  (not covered). ``deterministic=False`` turns both off for raw speed: one batched call per linear and per
  attention, so a row's last bits (and, rarely, a greedy token) may then depend on its neighbours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvboost_core.call_options import CallOptions, call_options
from kvboost_core.kernels import ops
from kvboost_core.model import attention
from kvboost_core.model.driver import ModelDriver
from kvboost_core.model.lean import lean_decoder
from kvboost_core.results import PrefillResult
from kvboost_core.serving.backfill import BackfillJob, conversation_job
from kvboost_core.serving.invariant import row_tiled, rowwise_attention
from kvboost_core.stages import EngineStages

_HEADROOM = 512  # slots allocated past a joining request's prompt before the buffers must grow


@dataclass(slots=True, eq=False)
class BatchSlot:
    """A request's place in the batch: ``row`` changes when other requests leave; ``length`` is the number of
    valid slots (the next token is written at ``length``)."""

    row: int
    length: int
    capacity: int  # the request never holds more than this many slots (prompt + max new tokens)
    active: bool = True


@dataclass(slots=True)
class Prefilled:
    """A prompt prefilled for the batch: its result (ids, first logits, stats) and the canonical prefix chunks
    to store."""

    result: PrefillResult
    _engine: EngineStages
    _to_store: list

    def store_prefix(self) -> None:
        """Store the prompt's computed canonical chunks (after the first token: not on the TTFT path)."""
        for key, block in self._to_store:
            self._engine.store.put(key, block)
        self._to_store = []


class PrefillTask:
    """A prefill in steps, for a scheduler that interleaves it with decode steps: :meth:`advance` computes
    about ``budget`` more prompt-head tokens, :meth:`finish` the rest. Splitting never changes the result.
    ``turn``: the prompt's (segments, tokens, chunks) when it is a chat turn (see :meth:`turn_job`)."""

    def __init__(self, engine: EngineStages, job: Any, turn: Any = None, turn_end: Sequence[int] = ()) -> None:
        self._engine, self._job, self._turn, self._turn_end = engine, job, turn, tuple(turn_end)

    @property
    def is_turn(self) -> bool:
        """A chat turn: its history was read exactly, and :meth:`turn_job` gives the next turn's backfill."""
        return self._turn is not None

    def turn_job(self, generated: Sequence[int], text: str, turn_end: Sequence[int]) -> BackfillJob:
        """The backfill that stores this turn's prompt and answer as the next turn's history reads it: canonical
        chunks cut after every message, as the in-process chat call's backfill cuts them (so both read the same
        entries). ``turn_end`` must be the one the prefill cut the history with (``start_prefill``'s)."""
        if self._turn is None:
            raise RuntimeError("turn_job: this prefill is not a chat turn (start_prefill without history_tokens)")
        if tuple(turn_end) != self._turn_end:
            raise ValueError(f"turn_end {tuple(turn_end)!r} differs from the prefill's {self._turn_end!r}: the "
                             "backfill would chunk the history apart from the next turn's read")
        segs, _, chunks = self._turn
        answer = self._engine.turn_answer(generated, text, turn_end)
        return conversation_job(segs, chunks, answer, self._engine.spans, canonical=True, turn_end=turn_end)

    @property
    def n_prompt(self) -> int:
        return int(self._job.n_prompt)

    @property
    def done(self) -> bool:
        return bool(self._job.done)

    def advance(self, budget: int | None = None) -> bool:
        return bool(self._job.advance(budget))

    def finish(self) -> Prefilled:
        pre = self._job.finish()
        self._job = _Finished(pre.result.stats.prompt_tokens)  # drops the prefill's buffers
        return Prefilled(pre.result, self._engine, pre.to_store)


@dataclass(frozen=True, slots=True)
class _Finished:
    """A finished prefill's job, as :class:`PrefillTask` still answers for it (its buffers are released: a
    scheduler may keep the task for :meth:`PrefillTask.turn_job` while the request decodes)."""

    n_prompt: int
    done: bool = True

    def advance(self, budget: int | None = None) -> bool:
        raise RuntimeError("PrefillTask.advance: the prefill is finished")

    def finish(self) -> Any:
        raise RuntimeError("PrefillTask.finish: the prefill is finished already")


def start_prefill(engine: EngineStages, prompt: Any, options: CallOptions | None = None, **kw: Any) -> PrefillTask:
    """``engine``'s prefill (content lookup, placement, repair) of ``prompt`` through
    :class:`kvboost_core.serving.canonical.CanonicalJob`: the result depends on the prompt and the warmed documents
    only, never on earlier requests. Sized to the prompt alone: the batch copies the KV into its buffers.

    ``history_tokens=h`` makes it a chat turn, by the rule of :mod:`kvboost_core.engine.exact_history`: the prompt's
    first ``h`` tokens (up to the end of its last assistant message) are never re-placed; their KV is the exact
    canonical prefill, read from the store where a backfill (:meth:`PrefillTask.turn_job`) put it. On an engine
    whose chat calls cannot take the canonical path (a reader or block adapter) it is an ordinary prefill.

    The call's options come as one checked :class:`~kvboost_core.call_options.CallOptions` (``options``) or as
    the engine's per-call keywords (``kw``: ``repair``, ``store_prefix``, ``history_tokens``...), checked here
    into one; not both."""
    from kvboost_core.serving.canonical import CanonicalJob

    if options is not None and kw:
        raise TypeError(f"start_prefill takes options or keywords, not both (got {', '.join(sorted(kw))})")
    opts = options if options is not None else call_options(engine.config, engine.driver.num_layers, kw)
    spec, add_special_tokens, history_tokens = opts.spec, opts.add_special_tokens, opts.history_tokens
    build = bool(engine.config.store_prefix if opts.store_prefix is None else opts.store_prefix)
    if history_tokens is None or not engine.chat_canonical():
        return PrefillTask(engine, CanonicalJob(engine, prompt, spec, add_special_tokens, build_blocks=build))
    prepared = engine.prompt_chunks(prompt, add_special_tokens)
    if history_tokens > prepared[1]:
        raise ValueError(f"history_tokens ({history_tokens}) is longer than the prompt ({prepared[1]} tokens)")
    job = CanonicalJob(engine, None, spec, None, build_blocks=build,
                       prepared=engine.split_at(prepared, history_tokens, opts.turn_end),
                       exact_before=history_tokens)
    return PrefillTask(engine, job, prepared, opts.turn_end)


def prefill(engine: EngineStages, prompt: Any, options: CallOptions | None = None, **kw: Any) -> Prefilled:
    """:func:`start_prefill` run to the end at once."""
    return start_prefill(engine, prompt, options, **kw).finish()


class _BatchCache:
    """Duck-typed HF cache for one batched step: writes each row's new K/V at its own position and returns the
    buffers up to the longest row (shorter rows are masked)."""

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor,
                 positions: torch.Tensor, length: int) -> None:
        self.keys, self.values = keys, values
        self.rows, self.positions, self.length = rows, positions, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.rows.numel()
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # (n, H, 1, D) -> buf[row_i, :, pos_i]; two advanced indices around a slice index as (n, H, D)
        k_buf[self.rows, :, self.positions] = key_states[:, :, 0].to(k_buf.dtype)
        v_buf[self.rows, :, self.positions] = value_states[:, :, 0].to(v_buf.dtype)
        return k_buf[:n, :, : self.length], v_buf[:n, :, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class DecodeBatch:
    """What the scheduler holds its decoding requests in: up to ``max_batch`` slots, one token each per
    :meth:`step`. :class:`BatchedDecoder` keeps their KV in dense rows,
    ``kvboost_core.serving.paged_batch.PagedBatchedDecoder`` in pages of a shared pool. The rules they share
    live here: the arguments, the slots and a step's bookkeeping."""

    def __init__(self, driver: ModelDriver, max_batch: int, deterministic: bool) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
        self.driver, self.max_batch, self.deterministic = driver, max_batch, deterministic
        self._slots: list[BatchSlot] = []
        heads = [driver.model.get_output_embeddings()]
        # the layers a deterministic step runs on fixed row tiles (serving.invariant.row_tiled)
        self._linears = [m for m in [*driver.inner.layers.modules(), *heads] if type(m) is torch.nn.Linear]

    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def free(self) -> int:
        return self.max_batch - len(self._slots)

    def _check_step(self, tokens: dict[BatchSlot, int]) -> None:
        if len(tokens) != len(self._slots) or any(s not in tokens for s in self._slots):
            raise ValueError("step needs exactly one token for every active slot")
        for s in self._slots:
            if s.length >= s.capacity:
                raise RuntimeError(f"a request reached its capacity of {s.capacity} slots; it must leave first")

    def _advance(self, logits: torch.Tensor) -> dict[BatchSlot, torch.Tensor]:
        result = {}
        for i, s in enumerate(self._slots):
            s.length += 1
            result[s] = logits[i]
        return result


class BatchedDecoder(DecodeBatch):
    """Holds the KV of up to ``max_batch`` decoding requests and runs one token for each of them per step.
    ``deterministic`` (default): a request's logits do not depend on its neighbours, to the last bit."""

    def __init__(self, driver: ModelDriver, max_batch: int, *, deterministic: bool = True) -> None:
        if not driver.layerwise:
            raise ValueError("batched decode needs a layer-wise model driver (a Llama-like RoPE family); this "
                             "model runs through HF's own forward (prefix-only reuse)")
        if driver.reader is not None:
            # a step would run every row on the base weights while the engine gates reader rows: refuse
            raise ValueError("batched decode does not run reader adapters (reader_adapter); serve this engine "
                             "without one or generate through KVEngine.generate")
        super().__init__(driver, max_batch, deterministic)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._capacity = 0
        # A Llama-shaped model steps through the lean decoder (kvboost_core.model.lean), each row's attention its
        # own call (the native decode kernel on the CPU); anything else through the HF layers below.
        self._lean = lean_decoder(driver, attend=ops.decode_attend(driver.device))

    # ------------------------------------------------------------------ membership
    @property
    def nbytes(self) -> int:
        """Bytes held by the batch buffers (all rows, allocated capacity)."""
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def used_bytes(self) -> int:
        """Bytes of the slots requests actually hold (their current lengths)."""
        if not self._keys:
            return 0
        per_slot = 2 * self.driver.num_layers * self.driver.num_kv_heads * self.driver.head_dim
        return per_slot * self._keys[0].element_size() * sum(s.length for s in self._slots)

    @torch.inference_mode()  # the buffers are inference tensors (allocated in step): write them in the same mode
    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int, capacity: int) -> BatchSlot:
        """Copy a prefilled request's KV (per layer ``(1, H, >=length, D)``) into a free row."""
        if not self.free:
            raise RuntimeError("the batch is full; wait for a request to leave")
        if length < 1 or capacity < length:
            raise ValueError(f"need 1 <= length <= capacity, got length={length}, capacity={capacity}")
        # room for the request's first tokens now; growth past it re-allocates (rare: a zero-filled copy)
        self._ensure(min(capacity, length + _HEADROOM), len(self._slots) + 1)
        row = len(self._slots)
        for layer in range(self.driver.num_layers):
            self._keys[layer][row, :, :length] = keys[layer][0, :, :length]
            self._values[layer][row, :, :length] = values[layer][0, :, :length]
        slot = BatchSlot(row, length, capacity)
        self._slots.append(slot)
        return slot

    @torch.inference_mode()
    def remove(self, slot: BatchSlot, *, scrub: bool = False) -> None:
        """Free ``slot``'s row; the last row moves into it so active rows stay contiguous. ``scrub``: zero the
        row first, for a request whose KV may hold NaN/inf (its logits were bad): masked slots of a shorter row
        that later sits there would still see it (0 * NaN), when attention spans the batch's longest row."""
        if not slot.active:
            return
        slot.active = False
        if scrub:
            for buf in (*self._keys, *self._values):
                buf[slot.row].zero_()  # (H, capacity, D)
        last = self._slots.pop()
        if last is not slot:
            n = last.length
            for buf in (*self._keys, *self._values):
                buf[slot.row, :, :n] = buf[last.row, :, :n]
            last.row = slot.row
            self._slots[slot.row] = last
        if not self._slots:
            self._keys, self._values, self._capacity = [], [], 0  # idle: give the memory back

    def reset(self) -> None:
        """Drop every request and the buffers (after a failed step, whose state is unknown)."""
        for s in self._slots:
            s.active = False
        self._slots, self._keys, self._values, self._capacity = [], [], [], 0

    def _ensure(self, capacity: int, rows: int = 0) -> None:
        """Buffers with at least ``capacity`` slots and ``rows`` rows (both grown by doubling: one request on a
        batch of 8 holds one row, not eight)."""
        have_rows = self._keys[0].shape[0] if self._keys else 0
        rows = max(rows, len(self._slots))
        if capacity <= self._capacity and rows <= have_rows and self._keys:
            return
        a = self.driver
        # doubling, bounded by the largest capacity a request may reach: amortized O(1) copies per token
        most = max([s.capacity for s in self._slots] + [capacity])
        new_cap = max(capacity, min(2 * self._capacity, most)) if capacity > self._capacity else self._capacity
        new_rows = max(rows, min(2 * have_rows, self.max_batch)) if rows > have_rows else have_rows
        shape = (new_rows, a.num_kv_heads, new_cap, a.head_dim)
        # zeros, not empty: padded slots are masked, but 0 * NaN garbage would still poison the weighted sum
        keys = [torch.zeros(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        values = [torch.zeros(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)]
        n, old = len(self._slots), self._capacity
        for new, cur in zip((*keys, *values), (*self._keys, *self._values)):
            new[:n, :, :old] = cur[:n]
        self._keys, self._values, self._capacity = keys, values, new_cap

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(self, tokens: dict[BatchSlot, int]) -> dict[BatchSlot, torch.Tensor]:
        """Run one token for every active slot (``tokens[slot]`` is written at ``slot.length``); returns each
        slot's next-token logits (vocab,) in fp32. Every active slot must be given a token."""
        self._check_step(tokens)
        a = self.driver
        n = len(self._slots)
        dev = a.device
        lengths = [s.length + 1 for s in self._slots]  # each row attends to its prompt, tokens and this token
        length = max(lengths)
        self._ensure(length)
        if self._lean is not None:
            with row_tiled(self._linears) if self.deterministic else contextlib.nullcontext():
                logits = self._lean.step_rows(torch.tensor([tokens[s] for s in self._slots], device=dev),
                                              [s.length for s in self._slots], self._keys, self._values).float()
            return self._advance(logits)
        ids = torch.tensor([tokens[s] for s in self._slots], device=dev).view(n, 1)
        pos = torch.tensor([s.length for s in self._slots], device=dev)
        hidden = a.inner.embed_tokens(ids)  # (n, 1, hidden)
        cos_sin = a.inner.rotary_emb(hidden, position_ids=pos.view(n, 1))
        cache = _BatchCache(self._keys, self._values, torch.arange(n, device=dev), pos, length)
        masks = self._masks(pos, length)
        with self._invariant(lengths):
            for layer in range(a.num_layers):
                out = a.inner.layers[layer](hidden, attention_mask=masks[a.windows[layer]],
                                            position_embeddings=cos_sin, position_ids=pos.view(n, 1), cache=cache,
                                            use_cache=True)
                hidden = out[0] if isinstance(out, tuple) else out
            logits = a.logits(hidden)[:, -1].float()  # (n, vocab)
        return self._advance(logits)

    @contextlib.contextmanager
    def _invariant(self, lengths: list[int]) -> Iterator[None]:
        """The batch-invariant kernels for a step whose rows attend to ``lengths`` keys (nothing when not
        ``deterministic``)."""
        if not self.deterministic:
            yield
            return
        with row_tiled(self._linears), rowwise_attention(self.driver.model.config, lengths):
            yield

    def _masks(self, pos: torch.Tensor, length: int) -> dict[int | None, torch.Tensor]:
        """Row i sees keys [0, pos_i] (and > pos_i - window): its own prompt and tokens, never padding. Additive
        float masks built once per step (0 / -inf under SDPA, as SDPA itself would convert a bool mask in every
        layer; 0 / finfo.min under eager, as the model's own masks)."""
        a = self.driver
        impl = attention.base_impl(a.model.config)
        k_pos = torch.arange(length, device=pos.device)
        out: dict[int | None, torch.Tensor] = {}
        for window in set(a.windows):
            allowed = attention.visible(pos, k_pos, window).view(pos.numel(), 1, 1, length)  # (n, 1, 1, T)
            out[window] = attention.additive(allowed, impl, a.dtype)
        return out

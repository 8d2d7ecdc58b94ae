"""Document warming shared with decoding: a ``POST /v1/documents`` becomes a :class:`WarmJob` that the
scheduler advances between decode steps, about ``budget_tokens`` document tokens per iteration, so running
streams wait for one slice between two tokens rather than for the whole warm.

Why: the whole request used to run as one task on the engine thread; 6 documents (967 tokens) stalled every
running stream for 115 s. ``KVEngine.warm`` computes a document in one forward pass, so the job runs the warm
as a :class:`kvboost_core.model.slices.SlicedCall`: on its own thread, only while the engine thread waits for it, and
pausing between two layers once the budget is spent (a layer over ``n`` tokens of an ``L``-layer model counts
``n / L``). The forward itself is unchanged, so the stored KV is bit for bit what an in-process warm stores,
and a slice is as short as one layer of one document. Request limits (documents, bytes) are checked by the
route.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvboost_core.model import slices
from kvboost_core.model.slices import SlicedCall
from kvboost_rag.app.server.protocol import APIError


@dataclass(frozen=True, slots=True)
class WarmTotals:
    documents: int
    warmed: int
    already_warm: int
    tokens: int
    bytes: int
    seconds: float


@dataclass(slots=True, eq=False)
class WarmJob:
    rag: Any  # KVBoostRAG of the request's namespace
    texts: list[str]  # as sent (duplicates included); each distinct non-empty text is warmed once
    budget_tokens: int  # document tokens (token-layers / layers) computed per scheduler iteration
    setup: Callable[[], None] | None = None  # run first on the warm's thread: the engine thread's torch threads
    future: Future = field(default_factory=Future)
    pos: int = 0  # the document being warmed (index into the distinct texts)
    steps: int = 0  # scheduler iterations this job has run in (tests read it)
    warmed: int = 0
    already: int = 0
    tokens: int = 0
    nbytes: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _todo: list[str] = field(default_factory=list)
    _call: SlicedCall | None = None

    def __post_init__(self) -> None:
        if isinstance(self.budget_tokens, bool) or not isinstance(self.budget_tokens, int) or self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be an int >= 1, got {self.budget_tokens!r}")
        self._todo = [t for t in dict.fromkeys(self.texts) if t]

    @property
    def done(self) -> bool:
        return self.pos >= len(self._todo)

    def step(self, seconds: float | None = None) -> None:
        """Warm for about the token budget, or ``seconds`` when given (one layer at least); resolve the future
        when the last is warm. Raises what the warm raised (the scheduler hands it to :meth:`fail`)."""
        self.steps += 1
        if self.future.done():  # cancelled by its caller: nothing more to warm
            self.close()
            return
        if self._call is None:
            self._call = SlicedCall(self._warm_all, setup=self.setup, name="kvboost-warm")
        if self._call.step(self.budget_tokens, seconds):
            self._call.result()  # raises the warm's error, if any
            self.future.set_result(self.totals())

    def close(self) -> None:
        """Stop the warm where it paused (a cancelled request, a server shutting down)."""
        self.pos = len(self._todo)
        if self._call is not None:
            self._call.close()

    def _warm_all(self) -> None:
        """On the warm's thread: each distinct document in turn (pausing between layers)."""
        while not self.done:
            rep = self.rag.warm_documents([self._todo[self.pos]], progress=False)
            self.warmed += rep.warmed
            self.already += rep.already_warm
            self.tokens += rep.tokens
            self.nbytes += rep.bytes
            self.pos += 1
            slices.checkpoint()  # the next document starts in a new slice once this one's budget is spent

    def fail(self, exc: BaseException) -> None:
        """A document the engine refused (over the context: the client's 400), or a broken engine (500)."""
        if self.future.done():
            return
        if isinstance(exc, ValueError):  # the engine's own checks of the document (e.g. the context length)
            index = self.texts.index(self._todo[self.pos]) if self.pos < len(self._todo) else None
            where = f"documents[{index}]" if index is not None else "documents"
            self.future.set_exception(APIError(400, f"{where}: {exc}", param="documents",
                                               code="context_length_exceeded" if "context" in str(exc) else None))
        else:
            self.future.set_exception(APIError(500, "the engine failed while warming", type="server_error"))

    def totals(self) -> WarmTotals:
        return WarmTotals(len(self.texts), self.warmed, self.already, self.tokens, self.nbytes,
                          time.perf_counter() - self.t0)

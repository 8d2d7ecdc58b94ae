"""Document warming shared with decoding: a ``POST /v1/documents`` becomes a :class:`WarmJob` that the
scheduler advances between decode steps, about ``budget_tokens`` document tokens per iteration (one document
at least), so running streams wait for one piece between two tokens rather than for the whole warm.

Why: the whole request used to run as one task on the engine thread; 6 documents (967 tokens) stalled every
running stream for 115 s. The unit of work is one document (``KVEngine.warm`` computes a document in one
forward pass), so a single document longer than the budget still runs whole: the gap a stream sees is bounded
by the largest document, not by the request. Request limits (documents, bytes) are checked by the route.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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
    budget_tokens: int  # document tokens computed per scheduler iteration (one document at least)
    future: Future = field(default_factory=Future)
    pos: int = 0
    steps: int = 0  # scheduler iterations this job has run in (tests read it)
    warmed: int = 0
    already: int = 0
    tokens: int = 0
    nbytes: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _todo: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.budget_tokens, bool) or not isinstance(self.budget_tokens, int) or self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be an int >= 1, got {self.budget_tokens!r}")
        self._todo = [t for t in dict.fromkeys(self.texts) if t]

    @property
    def done(self) -> bool:
        return self.pos >= len(self._todo)

    def step(self) -> None:
        """Warm the next documents, up to the token budget; resolve the future when the last is warm."""
        self.steps += 1
        if self.future.done():  # cancelled by its caller: nothing more to warm
            self.pos = len(self._todo)
            return
        spent = 0
        while not self.done and spent < self.budget_tokens:
            text = self._todo[self.pos]
            rep = self.rag.warm_documents([text], progress=False)
            self.pos += 1
            self.warmed += rep.warmed
            self.already += rep.already_warm
            self.tokens += rep.tokens
            self.nbytes += rep.bytes
            spent += rep.tokens
        if self.done:
            self.future.set_result(self.totals())

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

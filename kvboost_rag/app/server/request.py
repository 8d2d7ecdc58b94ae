"""A server request as the scheduler holds it (:class:`GenRequest`), and the events it emits to its HTTP handler
(:class:`Started`, :class:`Finished`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_core import CacheCounts
from kvboost_core.decode import SamplingParams, TextStream
from kvboost_core.serving.batch import BatchSlot
from kvboost_rag.app.server.protocol import APIError

log = logging.getLogger("kvboost_rag.app.server")


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    counts: CacheCounts  # cached (exact) and approximate reuse, as usage and /metrics report them
    ttft_s: float  # from submission (queue wait included) to the first token


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "eos", "stop" or "length"
    completion_tokens: int
    text: str


@dataclass(slots=True, eq=False)
class GenRequest:
    rag: Any  # KVBoostRAG of the request's namespace
    params: SamplingParams
    emit: Callable[[str, Any], None]
    prompt: str | None = None  # a completion prompt, or
    messages: list[dict[str, str]] | None = None  # chat messages, rendered with the model's chat template
    fill_context: bool = False  # no token limit given: generate up to the end of the context
    ignore_eos: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # set by the scheduler
    slot: BatchSlot | None = None
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    next_token: int = -1
    task: Any = None  # its PrefillTask: a chat turn's gives the backfill of its prompt and answer
    turn_end: tuple[int, ...] = ()  # what the chat template writes after an answer

    def check_limits(self, n_prompt: int) -> None:
        """APIError 400 when the prompt and the requested tokens do not fit the model's context."""
        ctx = self.rag.engine.driver.max_context
        if ctx and n_prompt + self.params.max_new_tokens > ctx:
            param = "messages" if n_prompt >= ctx else "max_tokens"
            raise APIError(400, f"this model's context is {ctx} tokens; the prompt has {n_prompt} tokens and "
                                f"{self.params.max_new_tokens} new tokens were requested ({n_prompt} + "
                                f"{self.params.max_new_tokens} > {ctx}); shorten the prompt or lower max_tokens",
                           param=param, code="context_length_exceeded")

    def fail_prefill(self, exc: Exception) -> None:
        """The error a failed prefill gives: an APIError as it is, the engine's own checks (context length, empty
        prompt: ValueError) as the client's 400, anything else a 500 (logged without the prompt)."""
        if isinstance(exc, APIError):
            self.emit("error", exc)
        elif isinstance(exc, ValueError):
            self.emit("error", APIError(400, str(exc), param="messages"))
        else:
            log.error("prefill failed: %s", type(exc).__name__)  # never the prompt
            self.emit("error", APIError(500, "the engine failed on this request", type="server_error"))

    def fail_logits(self, exc: Exception) -> None:
        """Its logits cannot be sampled from: the 500 a failing engine gives, naming why (the engine's own words:
        NaN or every token masked; never the prompt)."""
        log.error("request failed: %s", exc)
        self.emit("error", APIError(500, f"the engine failed on this request: {exc}", type="server_error"))


class QueueFull(Exception):
    pass

"""A server request as the scheduler holds it (:class:`GenRequest`), and the events it emits to its HTTP handler
(:class:`Started`, :class:`Finished`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_core import CacheCounts
from kvboost_core.decode import SamplingParams, TextStream
from kvboost_core.serving.batch import BatchSlot


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


class QueueFull(Exception):
    pass

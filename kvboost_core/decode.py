"""Sampling, stop strings, incremental detokenization, and the logits-processor hook of generation."""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch

_MAX_SEED = 2**63 - 1

# ``(generated_ids, logits) -> logits``: called before each token is sampled. ``generated_ids`` are the ids
# sampled so far in this generation (a copy; empty before the first token), ``logits`` the next-token logits,
# float32 of shape (V,). It returns the logits to sample from (shape (V,)); changing them in place and
# returning them is fine (it runs under torch.inference_mode). To end the generation before the next token it raises :class:`StopGeneration`.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


class StopGeneration(Exception):
    """Raised by a logits processor to end the generation before the next token is sampled; the result's
    ``finish_reason`` is then "stop" (as for a stop string). Not StopIteration: inside a generator that
    becomes a RuntimeError (PEP 479)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def create(cls, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               stop: str | Sequence[str] | None = None, seed: int | None = None) -> SamplingParams:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int >= 1, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float >= 0, got {type(temperature).__name__}")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0 (0 means greedy), got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a float in (0, 1], got {type(top_p).__name__}")
        if not 0 < top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be None or an int, got {type(seed).__name__} {seed!r}")
            if not 0 <= seed <= _MAX_SEED:  # torch.Generator.manual_seed takes 64 bits
                raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed!r}")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, Sequence) and not isinstance(stop, (bytes, bytearray)):
            stops = tuple(stop)
        else:
            raise TypeError(f"stop must be None, a str or a list of str, got {type(stop).__name__}")
        if not all(isinstance(s, str) and s for s in stops):
            raise TypeError("stop must be a non-empty str or a list of non-empty str")
        return cls(max_new_tokens, float(temperature), float(top_p), stops, seed)


class BadLogits(RuntimeError):
    """The next-token logits cannot be sampled from: NaN (a broken model or processor), or every token masked.
    Raised instead of a crash inside ``torch.multinomial`` or a silent token 0."""


def check_logits(logits: torch.Tensor, source: str = "the model") -> None:
    """Raise :class:`BadLogits` when ``logits`` (V,) hold a NaN or no token is allowed (all -inf)."""
    if bool(torch.isnan(logits).any()):
        raise BadLogits(f"{source} produced NaN logits; cannot choose the next token")
    if not bool((logits > -math.inf).any()):
        raise BadLogits(f"every token is masked (all logits from {source} are -inf); cannot choose the next token")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           source: str = "the model") -> int:
    """Greedy at temperature 0 (no division by zero); otherwise temperature + nucleus sampling. NaN logits or
    all -inf raise :class:`BadLogits` (``source`` names who produced them), at any temperature.

    Any temperature > 0 works: logits are shifted by their max before the division, so a tiny temperature
    cannot overflow and tends to greedy (uniform over tied maxima); +inf logits (forced tokens) are sampled
    uniformly among themselves. Any top_p in (0, 1] keeps at least the top token."""
    check_logits(logits, source)
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    x = logits.float()  # (V,)
    forced = torch.isposinf(x)
    if bool(forced.any()):  # +inf - +inf would be NaN: a forced token wins, ties share the mass
        x = torch.where(forced, 0.0, -math.inf)
    # (x - max) <= 0, so dividing by any positive temperature gives a value in [-inf, 0]: no overflow to +inf.
    # A temperature below float32's range becomes 0 in the division: the maxima are set to 0 (not 0/0 = NaN).
    top = x.max()
    scaled = torch.where(x == top, 0.0, (x - top) / params.temperature)  # (V,) in [-inf, 0]
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # (V,)
        # Keep the smallest set whose mass reaches top_p. The top token is always kept: a top_p below float32's
        # smallest value (1e-300) compares as 0 against the tensor and would otherwise drop every token.
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p  # (V,) bool
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def check_logits_processor(processor: object) -> None:
    if processor is not None and not callable(processor):
        raise TypeError(f"logits_processor must be None or a callable (generated_ids, logits) -> logits, got "
                        f"{type(processor).__name__}")


def process_and_sample(processor: LogitsProcessor | None, generated: list[int], logits: torch.Tensor,
                       params: SamplingParams, generator: torch.Generator | None) -> int | None:
    """The next token: ``logits`` (V,) through ``processor`` (when given), then :func:`sample`. None when
    the processor raised :class:`StopGeneration`."""
    if processor is not None:
        check_logits(logits)  # the model's own NaN is reported as the model's, not the processor's
        shape = tuple(logits.shape)
        try:
            with torch.inference_mode():  # the logits are inference tensors: in-place masking needs the mode
                logits = processor(list(generated), logits)
        except StopGeneration:
            return None
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits_processor must return a torch.Tensor of logits, got {type(logits).__name__}")
        if tuple(logits.shape) != shape:  # a wider tensor would sample an id past the vocabulary
            raise ValueError(f"logits_processor must return logits of shape {shape} (the vocabulary), got "
                             f"{tuple(logits.shape)}")
        if not logits.is_floating_point():
            logits = logits.float()
        return sample(logits, params, generator, source="the logits_processor")
    return sample(logits, params, generator)


class TextStream:
    """Turns generated ids into text pieces, holding back what might still become a stop string or an
    incomplete multi-byte character, and cutting the text at the first stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self._tok = tokenizer
        self._stops = stops
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        for s in self._stops:
            at = text.find(s)
            if at != -1:
                self.stopped = True
                text = text[:at]
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):
                safe = len(text) - 1  # an incomplete UTF-8 sequence: wait for the next token
            for s in self._stops:  # hold back a tail that is a prefix of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        safe = min(safe, len(text) - k)
                        break
        piece = text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return piece

    def flush(self) -> str:
        piece = self.text[self._emitted:]
        self._emitted = len(self.text)
        return piece


def next_piece(stream: TextStream, token: int, *, eos: Container[int], generated: int, limit: int,
               full: bool = False, ignore_eos: bool = False) -> tuple[str, str | None]:
    """The one stop rule of a generation, after ``token`` is its ``generated``-th token: (the text piece it
    adds, the finish reason or None to go on). ``"eos"`` (an end-of-sequence token, not added to the text,
    unless ``ignore_eos``), ``"stop"`` (the text reached a stop string), ``"length"`` (``limit`` tokens, or
    ``full``: no room left in the cache)."""
    if not ignore_eos and token in eos:
        return "", "eos"
    piece = stream.push(token)
    if stream.stopped:
        return piece, "stop"
    if generated >= limit or full:
        return piece, "length"
    return piece, None

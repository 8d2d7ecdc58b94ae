"""Prompts as segments, and their tokenization.

Each segment is tokenized on its own and the ids are concatenated, so a document's ids are the same in
every prompt it appears in. That is what makes chunk keys stable across prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvboost_core.keys import CacheKey


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of a prompt: ``text`` or ``token_ids`` (exactly one).

    ``cacheable=True`` marks a document whose KV may be stored and reused at any position.
    ``source_ids``/``source_offset`` (advanced, used by the RAG layer) say that this segment's tokens are a
    run of a warmed document's tokens: token ``i`` of the segment corresponds to ``source_ids[i + source_offset]``.
    The engine reuses the document's cached KV at every position where the ids are equal and computes the rest.
    """

    text: str | None = None
    token_ids: Sequence[int] | None = None
    cacheable: bool = False
    source_ids: Sequence[int] | None = None
    source_offset: int = 0

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a Segment needs exactly one of text= or token_ids=")
        if self.text is not None:
            if not isinstance(self.text, str):
                raise TypeError(f"Segment.text must be a str, got {type(self.text).__name__}")
            check_utf8(self.text, "Segment.text")
        if self.token_ids is not None:
            if isinstance(self.token_ids, (str, bytes)):
                raise TypeError("Segment.token_ids must be a sequence of ints; pass text= for a string")
            ids = tuple(self.token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise TypeError("Segment.token_ids must hold non-negative ints")
            object.__setattr__(self, "token_ids", ids)
        if self.source_ids is not None:
            object.__setattr__(self, "source_ids", tuple(int(t) for t in self.source_ids))


Prompt = str | Segment | Sequence[str | Segment]


def check_utf8(text: str, name: str) -> None:
    """A str that cannot be encoded (a lone surrogate, e.g. from a bad decode) is a caller error, raised here
    rather than as a tokenizer exception deep inside a request."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: {e.reason} at index {e.start} "
                         f"({text[e.start:e.end]!r}); decode your input with errors='replace'") from None


def check_vocab(token_ids: Sequence[int], vocab_size: int, name: str = "Segment.token_ids") -> None:
    """Every id must index the model's embedding table (an out-of-range id fails deep in the model)."""
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary of {vocab_size}")


@dataclass(frozen=True, slots=True)
class TokenizedSegment:
    token_ids: tuple[int, ...]
    start: int  # position of the first token in the prompt
    cacheable: bool
    source_ids: tuple[int, ...] | None = None
    source_offset: int = 0
    is_lead: bool = False  # the special tokens (BOS) the engine put in front

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def normalize_prompt(prompt: Any) -> list[Segment]:
    """Accept a str, a Segment, or a sequence of them; raise TypeError/ValueError that say what to pass."""
    if isinstance(prompt, str):
        segs = [Segment(text=prompt)]
    elif isinstance(prompt, Segment):
        segs = [prompt]
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        segs = []
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                segs.append(Segment(text=item))
            elif isinstance(item, Segment):
                segs.append(item)
            else:
                raise TypeError(f"prompt item {i} is a {type(item).__name__}; pass str or kvboost_core.Segment")
    else:
        raise TypeError(f"prompt must be a str, a Segment or a list of them, got {type(prompt).__name__}")
    if not segs or all((s.text == "" if s.text is not None else len(s.token_ids or ()) == 0) for s in segs):
        raise ValueError("the prompt is empty; pass at least one non-empty str or Segment")
    return segs


def lead_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens the tokenizer puts *in front* of a text (BOS for Llama, nothing for Qwen)."""
    probe = "kvboost"
    with_special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for cut in range(len(with_special) + 1):
        if with_special[cut:cut + len(plain)] == plain:
            return tuple(with_special[:cut])
    return ()


_SENTINEL = "\u2063kvboost-doc\u2063"


def chat_head_text(tokenizer: Any) -> str | None:
    """The text a chat template puts before the first user message's content (its system turn, when the template
    adds a default one, and the user header), or None without a chat template. Documents retrieved into a chat
    are read behind this head, so warming them behind it computes their KV in the context they are used in."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = str(tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=False))
    cut = text.find(_SENTINEL)
    return text[:cut] if cut > 0 else None


def tokenize_segments(tokenizer: Any, segments: list[Segment], lead: Sequence[int]) -> list[TokenizedSegment]:
    """Tokenize each segment on its own (no special tokens), with ``lead`` as a segment of its own in front."""
    out: list[TokenizedSegment] = []
    pos = 0
    if lead:
        out.append(TokenizedSegment(tuple(lead), 0, cacheable=False, is_lead=True))
        pos = len(lead)
    for seg in segments:
        if seg.token_ids is not None:
            ids = tuple(seg.token_ids)
        else:
            ids = tuple(tokenizer(seg.text, add_special_tokens=False)["input_ids"])
        if not ids:
            continue
        src = tuple(seg.source_ids) if seg.source_ids is not None else None
        out.append(TokenizedSegment(ids, pos, seg.cacheable, src, seg.source_offset))
        pos += len(ids)
    return out


__all__ = ["CacheKey", "Prompt", "Segment", "TokenizedSegment", "chat_head_text", "check_utf8", "check_vocab",
           "cut_messages", "lead_token_ids", "normalize_prompt", "tokenize_segments"]


def cut_messages(segments: Sequence[TokenizedSegment], end: int,
                 turn_end: Sequence[int] = ()) -> list[TokenizedSegment]:
    """``segments`` with every text segment cut at ``end`` (a chat's history end) and after every occurrence of
    ``turn_end`` (the ids a chat template writes after a message) that ends at or before ``end``. Documents and
    the lead are never cut. Text after ``end`` (the new turn) stays whole: a follow-up computes it in one forward,
    not one per message (measured on SmolLM2: 0.18 s against 0.24 s a follow-up turn).

    Why: a chat's history is chunked per message this way, so a message's chunks depend on its own ids and those
    before it, never on what follows. The backfill after turn n and the history read of every later turn then cut
    the same ids at the same places, and the backfill computes only what the turn added. Without ``turn_end``
    only ``end`` cuts (a later turn's history then re-cuts the last message's chunk)."""
    marker = tuple(turn_end)
    out: list[TokenizedSegment] = []
    for seg in segments:
        ids = seg.token_ids
        if seg.cacheable or seg.is_lead:
            out.append(seg)
            continue
        cuts = {end - seg.start} if 0 < end - seg.start < len(ids) else set()
        if marker:
            limit, n, first = min(len(ids), end - seg.start), len(marker), marker[0]
            i = 0
            while i + n <= limit:
                if ids[i] == first and ids[i:i + n] == marker:
                    cuts.add(i + n)
                    i += n
                else:
                    i += 1
        prev = 0
        for c in [*sorted(c for c in cuts if 0 < c < len(ids)), len(ids)]:
            src = seg.source_offset + prev if seg.source_ids is not None else seg.source_offset
            out.append(replace(seg, token_ids=ids[prev:c], start=seg.start + prev, source_offset=src))
            prev = c
    return out

"""The document registry: what was warmed, keyed by the exact rendered text, plus explicit-mode assembly."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvboost_core import Segment
from kvboost_rag.locate import DocIndex, DocSource


def doc_key(text: str) -> str:
    """Stable id of a document: xxh3-128 of its exact rendered text (UTF-8)."""
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class RegisteredDoc:
    """One warmed document as the registry holds it: its key, its exact text, and the ids its KV was computed
    for, with their character offsets when the tokenizer gives them (transparent mode needs them)."""

    key: str  # doc_key(text)
    text: str  # the exact rendered text that was warmed
    token_ids: tuple[int, ...]  # exactly the ids the engine warmed
    offsets: tuple[tuple[int, int], ...] | None  # character span of each id in ``text`` (None: slow tokenizer)

    @property
    def source(self) -> DocSource | None:
        return None if self.offsets is None else DocSource(self.token_ids, self.offsets)


class DocumentRegistry:
    """Registered documents and the transparent-mode index over them. Thread-safe."""

    def __init__(self) -> None:
        self._docs: dict[str, RegisteredDoc] = {}
        self._lock = threading.Lock()
        self.index = DocIndex()

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, key: object) -> bool:
        return key in self._docs

    def get(self, key: str) -> RegisteredDoc | None:
        return self._docs.get(key)

    def by_text(self, text: str) -> RegisteredDoc | None:
        return self._docs.get(doc_key(text))

    def register(self, text: str, token_ids: Sequence[int],
                 offsets: Sequence[tuple[int, int]] | None) -> RegisteredDoc:
        if offsets is not None and len(offsets) != len(token_ids):
            raise ValueError("offsets must have one (start, end) pair per token id")
        doc = RegisteredDoc(doc_key(text), text, tuple(int(t) for t in token_ids),
                            None if offsets is None else tuple((int(a), int(b)) for a, b in offsets))
        with self._lock:
            old = self._docs.get(doc.key)
            if old is not None and old.token_ids == doc.token_ids:
                return old
            self._docs[doc.key] = doc
        self.index.add(doc.key, text)
        return doc

    def sources(self, keys: Sequence[str]) -> dict[str, DocSource]:
        out: dict[str, DocSource] = {}
        for k in keys:
            doc = self._docs.get(k)
            if doc is not None and doc.source is not None:
                out[k] = doc.source
        return out


@dataclass(frozen=True, slots=True)
class Assembly:
    segments: list[Segment]
    doc_ranges: list[tuple[int, int]]  # token ranges of the documents in the prompt


def stable_order(docs: Sequence[RegisteredDoc], preserve_order: bool) -> list[RegisteredDoc]:
    """Drop duplicates; sort by key unless ``preserve_order``. A stable order makes the same set of
    documents the same prompt prefix whatever order a retriever returned them in: an exact hit."""
    seen: dict[str, RegisteredDoc] = {}
    for d in docs:
        seen.setdefault(d.key, d)
    unique = list(seen.values())
    return unique if preserve_order else sorted(unique, key=lambda d: d.key)


def assemble(docs: Sequence[RegisteredDoc], question: str, encode: Callable[[str], list[int]], *,
             lead: Sequence[int] = (), separator: str = "\n\n", preserve_order: bool = False) -> Assembly:
    """Explicit mode: ``lead`` (BOS), then each document as a cacheable segment (its warmed ids), each
    followed by ``separator`` as a segment of its own, then the question. All segments carry token ids, so
    positions (and the documents' token ranges) are known before the engine sees them."""
    segments: list[Segment] = []
    ranges: list[tuple[int, int]] = []
    pos = 0
    if lead:
        segments.append(Segment(token_ids=list(lead)))
        pos = len(lead)
    sep_ids = encode(separator) if separator else []
    for d in stable_order(docs, preserve_order):
        if not d.token_ids:
            continue
        segments.append(Segment(token_ids=d.token_ids, cacheable=True))
        ranges.append((pos, pos + len(d.token_ids)))
        pos += len(d.token_ids)
        if sep_ids:
            segments.append(Segment(token_ids=sep_ids))
            pos += len(sep_ids)
    q_ids = encode(question)
    if q_ids:
        segments.append(Segment(token_ids=q_ids))
    if not segments:
        raise ValueError("nothing to prompt with: pass a non-empty question or documents")
    return Assembly(segments, ranges)

"""Transparent mode: find registered documents inside a flat prompt string, then map them onto its tokens.

Finding is O(prompt length), independent of the corpus size: every registered document is indexed by the
hash of one fixed-width character window (its *anchor*); we hash every window of the prompt once
(vectorised), look the hashes up in a set, and confirm each hit with one direct string compare. Only
documents whose anchor hash occurs in the prompt are ever touched.

Anchors normally sit at the document's start; when documents share a header (LlamaIndex metadata lines,
"Source: ..." prefixes) a later window is chosen so that one prompt window does not fan out to every
document with that header.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvboost_core import Segment

WINDOW = 64  # anchor width for documents of at least this many characters
SHORT_WINDOW = 16  # anchor width for shorter documents
MIN_CHARS = SHORT_WINDOW  # shorter documents are not located (use explicit mode, kv_documents=[...])

_BASE = np.uint64(0x100000001B3)  # odd, so the polynomial hash mod 2**64 mixes every character


def _codes(text: str) -> np.ndarray:
    # UTF-32 gives one code unit per Python character, so array indices are str indices.
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.uint64)


def window_hashes(text: str, width: int) -> np.ndarray:
    """Polynomial hash (mod 2**64) of every ``width``-character window of ``text``: entry i covers
    ``text[i:i + width]``. O(len * width) vector work with a constant width, i.e. linear in the prompt."""
    codes = _codes(text)
    n = len(codes) - width + 1
    if n <= 0:
        return np.empty(0, dtype=np.uint64)
    acc = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            acc = acc * _BASE + codes[j:j + n]
    return acc


@dataclass(frozen=True, slots=True)
class Variant:
    """A text form of a registered document: ``text == doc_text[lead:lead + len(text)]``."""

    key: str
    text: str
    lead: int  # characters of the document before this variant (whitespace removed by .strip())
    anchor: int  # offset of the anchor window inside ``text``


@dataclass(frozen=True, slots=True)
class Match:
    key: str
    start: int  # prompt characters [start, end)
    end: int
    lead: int  # document character at ``start`` is ``lead``


class DocIndex:
    """Anchor-hash index of document variants. Thread-safe for concurrent ``add`` and ``find``."""

    def __init__(self) -> None:
        self._tables: dict[int, dict[int, list[Variant]]] = {WINDOW: {}, SHORT_WINDOW: {}}
        self._arrays: dict[int, np.ndarray | None] = {WINDOW: None, SHORT_WINDOW: None}
        self._lock = threading.Lock()
        self.confirmations = 0  # string compares done by find(), over its lifetime
        self.last_confirmations = 0  # ... by the latest find()

    def __len__(self) -> int:
        return sum(len(v) for t in self._tables.values() for v in t.values())

    def add(self, key: str, text: str) -> None:
        """Index ``text`` and, if different, its ``.strip()`` form (frameworks often strip documents)."""
        stripped = text.strip()
        forms = {(text, 0)}
        if stripped and stripped != text:
            forms.add((stripped, text.index(stripped)))
        for form, lead in forms:
            if len(form) >= MIN_CHARS:
                self._add_variant(key, form, lead)

    def _add_variant(self, key: str, text: str, lead: int) -> None:
        width = WINDOW if len(text) >= WINDOW else SHORT_WINDOW
        hashes = window_hashes(text, width)
        with self._lock:
            table = self._tables[width]
            if any(v.key == key and v.text == text for v in table.get(int(hashes[0]), ())):
                return  # registered already
            # The first window whose bucket is empty (else the least crowded one), stepping by half a window.
            offsets = range(0, len(hashes), max(width // 2, 1))
            anchor = min(offsets, key=lambda o: (len(table.get(int(hashes[o]), ())) > 0, o))
            table.setdefault(int(hashes[anchor]), []).append(Variant(key, text, lead, anchor))
            self._arrays[width] = None  # rebuilt lazily on the next find()

    def _hash_array(self, width: int) -> np.ndarray:
        arr = self._arrays[width]
        if arr is None:
            arr = self._arrays[width] = np.fromiter(self._tables[width].keys(), dtype=np.uint64)
        return arr

    def find(self, prompt: str) -> list[Match]:
        """Non-overlapping occurrences of registered documents in ``prompt``, in prompt order. At a given
        start the longest document wins (a document that contains another one is preferred)."""
        found: list[Match] = []
        confirmations = 0
        for width in (WINDOW, SHORT_WINDOW):
            with self._lock:
                table, keys = self._tables[width], self._hash_array(width)
            if not table or len(prompt) < width:
                continue
            hashes = window_hashes(prompt, width)
            for pos in np.flatnonzero(np.isin(hashes, keys)).tolist():
                for v in table.get(int(hashes[pos]), ()):
                    start = pos - v.anchor
                    if start < 0:
                        continue
                    confirmations += 1
                    if prompt.startswith(v.text, start):
                        found.append(Match(v.key, start, start + len(v.text), v.lead))
        self.last_confirmations = confirmations
        self.confirmations += confirmations
        return _non_overlapping(found)


def _non_overlapping(found: list[Match]) -> list[Match]:
    out: list[Match] = []
    for m in sorted(found, key=lambda m: (m.start, -(m.end - m.start))):
        if not out or m.start >= out[-1].end:
            out.append(m)
    return out


# ---------------------------------------------------------------------------------------------- alignment
@dataclass(frozen=True, slots=True)
class DocSource:
    """A registered document's own tokenization (as warmed) with character offsets."""

    token_ids: Sequence[int]
    offsets: Sequence[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Aligned:
    segments: list[Segment]
    doc_ranges: list[tuple[int, int]]  # prompt token ranges attributed to documents


def _doc_token_range(offsets: Sequence[tuple[int, int]], start: int, end: int, lo: int) -> tuple[int, int]:
    """Tokens [a, b) lying wholly inside characters [start, end); tokens straddling an edge stay outside
    (they are prefilled normally). Special tokens have empty (0, 0) offsets and never qualify."""
    a = lo
    while a < len(offsets) and (offsets[a][0] < start or offsets[a][1] <= offsets[a][0]):
        if offsets[a][0] >= end:
            return a, a
        a += 1
    b = a
    while b < len(offsets) and offsets[b][1] <= end and offsets[b][1] > offsets[b][0]:
        b += 1
    return a, b


def _shift_runs(ids: Sequence[int], offsets: Sequence[tuple[int, int]], a: int, b: int, char_delta: int,
                src: DocSource) -> list[tuple[int, int, int]]:
    """Split prompt tokens [a, b) into runs (start, end, source_offset). A token matches document token k
    when its document-relative offsets and its id equal token k's; the first match of a run fixes the
    shift ``k - (i - run_start)``. Tokens that match nothing ride along: the engine reuses KV only where
    ids are equal and computes the rest, so a wrong guess costs compute, never correctness."""
    by_span = {tuple(o): k for k, o in enumerate(src.offsets)}
    runs: list[tuple[int, int, int]] = []
    run_start, shift = a, None
    for i in range(a, b):
        s, e = offsets[i]
        k = by_span.get((s + char_delta, e + char_delta))
        if k is None or src.token_ids[k] != ids[i]:
            continue
        this = k - (i - run_start)
        if shift is None:
            shift = this
        elif this != shift:
            runs.append((run_start, i, shift))
            run_start, shift = i, k
    if shift is not None:
        runs.append((run_start, b, shift))
    return runs


def align(ids: Sequence[int], offsets: Sequence[tuple[int, int]], matches: Sequence[Match],
          sources: dict[str, DocSource]) -> Aligned:
    """Cut the prompt's own token ids into plain and document segments without changing a single id."""
    segments: list[Segment] = []
    doc_ranges: list[tuple[int, int]] = []
    cursor = 0
    for m in matches:
        src = sources.get(m.key)
        if src is None:
            continue
        a, b = _doc_token_range(offsets, m.start, m.end, cursor)
        runs = _shift_runs(ids, offsets, a, b, m.lead - m.start, src) if b > a else []
        if not runs:
            continue  # nothing lines up (e.g. a tokenizer that merges across the edges): prefill normally
        if runs[0][0] > cursor:
            segments.append(Segment(token_ids=ids[cursor:runs[0][0]]))
        for r0, r1, shift in runs:
            segments.append(Segment(token_ids=ids[r0:r1], cacheable=True, source_ids=src.token_ids,
                                    source_offset=shift))
        doc_ranges.append((runs[0][0], runs[-1][1]))
        cursor = runs[-1][1]
    if cursor < len(ids):
        segments.append(Segment(token_ids=ids[cursor:]))
    return Aligned(segments, doc_ranges)

"""Chunk boundaries within one segment, and the shared leading run of two id sequences.

Cuts fall every ``chunk_size`` tokens, each allowed to slide up to ``boundary_window`` tokens to the nearest
sentence or line end, so that a chunk tends to hold whole sentences. Chunking depends only on the segment's
own ids, so the same document is chunked the same way in every prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_ENDINGS = (".", "!", "?", "\n", ":", ";")


def boundary_predicate(tokenizer) -> Callable[[int], bool]:
    """A cached ``is_boundary(token_id)``: does the token's text end a sentence or a line?"""
    cache: dict[int, bool] = {}

    def is_boundary(tok: int) -> bool:
        hit = cache.get(tok)
        if hit is None:
            text = tokenizer.decode([tok])
            hit = cache[tok] = text.rstrip(" ").endswith(_ENDINGS) or text.endswith("\n")
        return hit

    return is_boundary


def chunk_spans(ids: Sequence[int], chunk_size: int, window: int,
                is_boundary: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
    """Half-open spans ``[(a, b), ...]`` covering ``ids``. A shorter tail stays a chunk of its own."""
    n = len(ids)
    spans: list[tuple[int, int]] = []
    start = 0
    while start < n:
        target = start + chunk_size
        if target >= n:
            spans.append((start, n))
            break
        cut = target
        if is_boundary is not None and window > 0:
            # Nearest sentence end to the target, preferring the earlier cut on ties; cut *after* it.
            for d in range(window + 1):
                for c in (target - d, target + d):
                    if start < c <= n and c - 1 >= start and is_boundary(ids[c - 1]):
                        cut = c
                        break
                else:
                    continue
                break
        spans.append((start, cut))
        start = cut
    return spans


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (a chunk's stored ids against the prompt's, a baseline's
    cached sequence against a new prompt)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""Warming documents: compute and store their KV once, and register them for transparent finding."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvboost_core import Segment
from kvboost_rag.documents import document_texts
from kvboost_rag.registry import DocumentRegistry, RegisteredDoc

# (text) -> (ids, offsets or None), the model tokenizer with add_special_tokens=False
Encoder = Callable[[str], tuple[list[int], list[tuple[int, int]] | None]]


@dataclass(frozen=True, slots=True)
class WarmReport:
    """What one ``warm_documents`` call did: documents computed now or found warm, and what they cost."""

    documents: int  # documents passed (duplicates included)
    warmed: int  # computed now
    already_warm: int  # found in the cache: cost a lookup
    tokens: int  # tokens computed now
    bytes: int  # bytes added to the store
    seconds: float  # wall time of the call


def _batches(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def resolve_progress(show_progress: bool | None, progress: bool | None = None) -> bool | None:
    """One progress option from the new name and the old one (``progress=``, kept as an alias).

    None means "auto": a bar on a terminal, nothing when stderr is not a TTY (logs, CI, notebooks' captured
    output)."""
    if show_progress is not None and progress is not None and bool(show_progress) != bool(progress):
        raise TypeError(f"show_progress={show_progress!r} and progress={progress!r} disagree; progress is the "
                        "old name of show_progress: pass one")
    value = show_progress if show_progress is not None else progress
    return None if value is None else bool(value)


def _progress(total: int, show: bool | None) -> Any:
    if show is False:
        return None
    from tqdm.auto import tqdm

    # disable=None is tqdm's own "not a TTY -> off"; disable=False forces the bar on.
    return tqdm(total=total, desc="kvboost warm", unit="doc", disable=None if show is None else False)


def warm_documents(engine: Any, registry: DocumentRegistry, encode: Encoder, docs: Any, *,
                   batch_size: int = 8, show_progress: bool | None = None,
                   progress: bool | None = None) -> WarmReport:
    """Warm ``docs`` (strs, LangChain Documents, LlamaIndex nodes) in batches and register them.

    Idempotent: a registered document is passed to the engine as its known ids (no re-tokenization) and the
    engine answers from the store with a lookup; one evicted since is simply computed again.
    ``show_progress`` (alias ``progress``): None shows a bar only on a terminal; True/False force it."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    show = resolve_progress(show_progress, progress)
    t0 = time.perf_counter()
    texts = document_texts(docs)
    unique = [t for t in dict.fromkeys(texts) if t]  # one warm per distinct non-empty text
    warmed = already = tokens = nbytes = 0
    bar = _progress(len(unique), show)
    try:
        for batch in _batches(unique, batch_size):
            known: list[RegisteredDoc | None] = [registry.by_text(t) for t in batch]
            items = [Segment(token_ids=k.token_ids) if k is not None else t for k, t in zip(known, batch, strict=True)]
            result = engine.warm(items)
            warmed += result.warmed
            already += result.already_warm
            tokens += result.tokens
            nbytes += result.bytes
            for text, reg, ids in zip(batch, known, result.doc_token_ids, strict=True):
                if reg is None:
                    _register(registry, encode, text, ids)
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    return WarmReport(documents=len(texts), warmed=warmed, already_warm=already, tokens=tokens, bytes=nbytes,
                      seconds=time.perf_counter() - t0)


def _register(registry: DocumentRegistry, encode: Encoder, text: str, warmed_ids: list[int]) -> None:
    ids, offsets = encode(text)
    if list(ids) != list(warmed_ids):
        offsets = None  # the tokenizers disagree: keep the document for explicit mode only
    registry.register(text, warmed_ids, offsets)

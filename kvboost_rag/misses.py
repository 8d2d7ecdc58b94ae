"""Noticing retrieved documents that were never warmed, so a miss is never silent.

A transparent prompt is flat text: KVBoostRAG finds *warmed* documents in it, but cannot tell an unwarmed
document from the rest of the prompt. What makes the miss detectable is knowing what was retrieved:

- the framework skins hook retrieval (LangChain: a callback handler added to every run; LlamaIndex: an
  instrumentation event handler on ``RetrievalEndEvent``) and call :func:`note_retrieved` with the texts as
  they are rendered into prompts;
- explicit mode (``kv_documents=[...]``) names the documents itself.

A retrieved text found verbatim in the prompt but absent from KVBoostRAG's registry is a miss. Prompts
built without a hooked retriever (hand-written prompts, custom retrievers that bypass callbacks) cannot be
checked: the count is then 0, not a claim that everything hit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

logger = logging.getLogger("kvboost")

_MAX_RECENT = 512  # retrieved texts remembered; a query retrieves a handful, so this spans many queries
_MIN_LEN = 16  # shorter "documents" would match by accident inside any prompt


class RecentlyRetrieved:
    """A bounded, thread-safe, insertion-ordered set of recently retrieved document texts."""

    def __init__(self, capacity: int = _MAX_RECENT) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, texts: Iterable[str]) -> None:
        with self._lock:
            for t in texts:
                if not isinstance(t, str) or len(t.strip()) < _MIN_LEN:
                    continue
                self._items[t] = None
                self._items.move_to_end(t)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


RECENT = RecentlyRetrieved()


def note_retrieved(texts: Iterable[str]) -> None:
    """Record documents a retriever just returned, rendered as they will appear in a prompt."""
    RECENT.add(texts)


def unwarmed_in_prompt(prompt: str, is_warm: Callable[[str], bool]) -> list[str]:
    """Recently retrieved texts that occur in ``prompt`` and for which ``is_warm(text)`` is False."""
    return [t for t in RECENT.snapshot() if t in prompt and not is_warm(t)]


class MissWarning:
    """One warning per ``interval_s`` per adapter, with the counts since the last one."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def report(self, missed: int, total: int, *, auto_warm: bool) -> bool:
        """Log the miss unless one was logged less than ``interval_s`` ago; True when logged."""
        if missed <= 0:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return False
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        hint = ("they are warmed now (auto_warm=True), so the next query reuses them" if auto_warm else
                "warm the texts the retriever returns (e.g. the split nodes, not the source documents), or "
                "pass auto_warm=True to warm them after each call")
        more = f" ({suppressed} similar prompts since the last warning)" if suppressed else ""
        logger.warning("kvboost: %d of %d retrieved documents in this prompt were not warmed; their KV is "
                       "computed in full: %s%s", missed, total, hint, more)
        return True

"""A chat call as a turn (:mod:`kvboost_core.engine.exact_history`), seen from the RAG layer: which messages are the
history, and what the chat template writes after an answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_MARK = "\x1fkvboost-answer\x1f"  # a probe answer no template rewrites


def history_messages(messages: Sequence[dict[str, Any]]) -> int:
    """How many leading messages are the history: up to and including the last assistant message (0: none)."""
    return max((i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"), default=0)


def turn_end_text(render_history: Callable[[list[dict[str, Any]]], str]) -> str:
    """What the chat template writes after an assistant message's text (``<|im_end|>\\n``), probed once by
    rendering a one-exchange history; "" when the template refuses the probe or rewrites the answer."""
    try:
        text = render_history([{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}])
    except Exception:  # noqa: BLE001 - a user template may raise anything (jinja, ValueError, ...)
        return ""
    cut = text.rfind(_MARK)
    return text[cut + len(_MARK):] if cut >= 0 else ""

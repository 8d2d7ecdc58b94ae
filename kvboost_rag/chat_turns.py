"""A chat call as a turn (:mod:`kvboost_core.engine.exact_history`), seen from the RAG layer: the messages checked,
which of them are the history, and what the chat template writes after an answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvboost_core.segments import check_utf8

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


def check_chat_messages(messages: Any) -> None:
    """Chat messages as chat templates take them (``[{"role", "content", ...}]``), checked before rendering, so
    a caller's mistake is an error naming the message instead of the tokenizer's bare TypeError later, or
    nothing at all. ``content`` is text: a lone surrogate is a ValueError, as the engine says of a prompt; ``None``
    is a TypeError (it rendered as an empty message), except on an assistant message carrying ``tool_calls``
    (OpenAI's shape). Other content (a list of parts) is left to the template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        content = m.get("content")
        if isinstance(content, str):
            check_utf8(content, f"messages[{i}].content")
        elif content is None and not (m.get("role") == "assistant" and m.get("tool_calls")):
            raise TypeError(f"messages[{i}] (role {m.get('role')!r}) has no content (None); give it text, \"\" "
                            "for an empty message")

"""Partial JSON: the value a growing JSON text stands for so far, for streaming structured output.

A constrained reply (:mod:`kvboost_rag.constrained`) is always a prefix of valid JSON, but a prefix rarely
parses: ``{"name":"Al`` needs its string and object closed. :func:`close_json_prefix` closes it at the last
point where that gives valid JSON: an open value string is kept (closed where it stands, so text streams in), a
key without its value, a dangling ``,`` or ``:`` and an unfinished ``true``/number are dropped (a number is kept
when its digits so far are a number: ``12`` of ``123`` shows as 12, as llama-index's partial parsing does).
"""

from __future__ import annotations

import json
from typing import Any

_CLOSE = {"{": "}", "[": "]"}
_SCALAR_START = frozenset("-0123456789tfn")


def _closers(stack: list[str]) -> str:
    return "".join(_CLOSE[c] for c in reversed(stack))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


_INVALID = object()


def close_json_prefix(text: str) -> str | None:
    """``text`` (a prefix of a JSON object or array) cut and closed into valid JSON, or None when nothing of a
    value has come yet (empty, whitespace, or not starting with ``{``/``[``)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    stack: list[str] = []  # open containers
    expect_key = False  # in an object, before a key (after "{" or ",")
    safe: tuple[int, list[str]] | None = None  # (end, open containers) of the last prefix that closes validly
    string_start = -1  # start of the open string, -1 outside strings
    string_is_key = False
    scalar_start = -1  # start of the number/literal being read, -1 outside one
    escaped = False
    for i, ch in enumerate(text):
        if string_start >= 0:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                string_start = -1
                if not string_is_key:
                    safe = (i + 1, list(stack))
            continue
        if scalar_start >= 0 and (ch in ",}] \t\r\n"):
            safe, scalar_start = (i, list(stack)), -1
        if scalar_start >= 0:
            continue
        if ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
            safe = (i + 1, list(stack))
        elif ch in "}]":
            if not stack:
                return None
            stack.pop()
            expect_key = False
            safe = (i + 1, list(stack))
        elif ch == '"':
            string_start, string_is_key = i, expect_key
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch in _SCALAR_START:
            scalar_start = i
        elif not stack and not ch.isspace():
            return None  # not a JSON object or array
    if safe is None:
        return None
    tail = _open_tail(text, stack, string_start, string_is_key, escaped, scalar_start)
    if tail is not None:
        return tail
    end, open_at = safe
    return text[:end] + _closers(open_at)


def _open_tail(text: str, stack: list[str], string_start: int, string_is_key: bool, escaped: bool,
               scalar_start: int) -> str | None:
    """The whole text closed, when it ends inside a value string or a number that is already valid."""
    if string_start >= 0 and not string_is_key:
        body = text[:-1] if escaped else text  # a lone backslash starts an escape not written yet
        if _loads(body + '"' + _closers(stack)) is _INVALID:  # a cut \uXXXX escape: drop it
            cut = body.rfind("\\u")
            if cut <= string_start:
                return None
            body = body[:cut]
        return body + '"' + _closers(stack)
    if scalar_start >= 0 and _loads(text[scalar_start:]) is not _INVALID:
        return text + _closers(stack)
    return None


def parse_partial(text: str) -> Any:
    """The value of :func:`close_json_prefix` (a dict or list), or None when there is none yet."""
    closed = close_json_prefix(text)
    if closed is None:
        return None
    value = _loads(closed)
    return None if value is _INVALID else value

"""Hermes/Qwen tool-call replies, parsed without any framework: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks (the convention chat templates with a ``tools`` section teach). The LangChain and the
LlamaIndex integrations wrap the result in their own types."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """One block: ``name``/``args`` when it is a valid call, else ``error`` (and ``body``, the raw text)."""

    body: str
    name: str | None = None
    args: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_call_blocks(text: str) -> tuple[str, list[ParsedCall]]:
    """(text outside the tool-call blocks, one ParsedCall per non-empty block, in order)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    out: list[ParsedCall] = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        if not body:
            continue
        try:
            data = json.loads(body)
            name = data["name"]
            args = data.get("arguments", data.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            out.append(ParsedCall(body=body, error=f"{type(exc).__name__}: {exc}"))
            continue
        out.append(ParsedCall(body=body, name=name, args=args))
    content = _CALL.sub("", text).strip() if out else text
    return content, out

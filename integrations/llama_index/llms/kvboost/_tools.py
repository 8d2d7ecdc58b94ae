"""LlamaIndex messages <-> chat-template dicts with tool calls, and ``<tool_call>`` replies -> ToolSelections
(parsing is :mod:`kvboost_rag.toolcalls`, shared with the LangChain integration)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse
from llama_index.core.llms.llm import ToolSelection

from kvboost_rag.toolcalls import parse_tool_call_blocks


def tool_chat_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: an assistant's earlier tool calls (ToolSelections in
    ``additional_kwargs["tool_calls"]``) and a tool result's ``tool_call_id``/``name`` included."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        d: dict[str, Any] = {"role": role, "content": m.content or ""}
        calls = m.additional_kwargs.get("tool_calls")
        if calls:
            d["tool_calls"] = [{"id": c.tool_id, "type": "function",
                                "function": {"name": c.tool_name, "arguments": c.tool_kwargs}}
                               if isinstance(c, ToolSelection) else c for c in calls]
        for key in ("tool_call_id", "name"):
            if m.additional_kwargs.get(key):
                d[key] = m.additional_kwargs[key]
        out.append(d)
    return out


def with_tool_calls(response: ChatResponse) -> ChatResponse:
    """The reply with its valid ``<tool_call>`` blocks moved to ``additional_kwargs["tool_calls"]``
    (ToolSelections) and malformed ones to ``additional_kwargs["invalid_tool_calls"]``."""
    content, blocks = parse_tool_call_blocks(response.message.content or "")
    calls = [ToolSelection(tool_id=f"call_{uuid.uuid4().hex[:24]}", tool_name=b.name, tool_kwargs=b.args)
             for b in blocks if b.error is None and b.name is not None and b.args is not None]
    invalid = [{"body": b.body, "error": b.error} for b in blocks if b.error is not None]
    # a new message, not model_copy: the content lives in the message's blocks
    msg = ChatMessage(role=response.message.role, content=content, additional_kwargs={
        **response.message.additional_kwargs, "tool_calls": calls, "invalid_tool_calls": invalid})
    return response.model_copy(update={"message": msg})

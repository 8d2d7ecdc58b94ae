"""LlamaIndex messages <-> chat-template dicts with tool calls, ``<tool_call>`` replies -> ToolSelections, which
calls are forced (``tool_required``/``tool_choice``) and streaming with tools (parsing is
:mod:`kvboost_rag.toolcalls`, shared with the LangChain integration)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse
from llama_index.core.llms.llm import ToolSelection

from kvboost_rag.toolcalls import first_call_only, parse_tool_call_blocks, tool_name

_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat call, whether a call is forced (of ``name``, or of any tool when None) and whether
    the reply may hold several calls (``parallel``: LlamaIndex's ``allow_parallel_tool_calls``)."""

    tools: list[dict[str, Any]]
    forced: bool = False
    name: str | None = None
    parallel: bool = False


def tool_request(tools: list[dict[str, Any]] | None, tool_choice: Any = None,
                 parallel: bool = False) -> ToolRequest | None:
    """None without tools. ``tool_choice``: None/"auto" (the model decides), "none" (tools not shown),
    "required"/"any"/True (a call of any tool), a tool's name or ``{"function": {"name": ...}}`` (that tool).
    ``parallel`` (False by default, as ``allow_parallel_tool_calls``): several calls kept, else the first."""
    if not isinstance(parallel, bool):
        raise TypeError(f"allow_parallel_tool_calls must be a bool, got {type(parallel).__name__}")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list of OpenAI tool schemas, got {type(tools).__name__}")
    if tool_choice == "none" or tool_choice is False:
        return None
    if tool_choice is None or tool_choice == "auto":
        return ToolRequest(tools, parallel=parallel)
    if tool_choice is True or tool_choice in ("required", "any"):
        return ToolRequest(tools, forced=True, parallel=parallel)
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    names = [tool_name(t) for t in tools]
    if name not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names none of the tools {names}")
    return ToolRequest(tools, forced=True, name=str(name), parallel=parallel)


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


def with_tool_calls(response: ChatResponse, parallel: bool = True) -> ChatResponse:
    """The reply with its valid ``<tool_call>`` blocks moved to ``additional_kwargs["tool_calls"]``
    (ToolSelections) and malformed ones to ``additional_kwargs["invalid_tool_calls"]``; without ``parallel``
    the first valid call alone (as llama-index's OpenAI ``force_single_tool_call``)."""
    content, blocks = parse_tool_call_blocks(response.message.content or "")
    calls = [ToolSelection(tool_id=f"call_{uuid.uuid4().hex[:24]}", tool_name=b.name, tool_kwargs=b.args)
             for b in blocks if b.error is None and b.name is not None and b.args is not None]
    invalid = [{"body": b.body, "error": b.error} for b in blocks if b.error is not None]
    if not parallel:
        calls, invalid = first_call_only(calls, invalid)
    # a new message, not model_copy: the content lives in the message's blocks
    msg = ChatMessage(role=response.message.role, content=content, additional_kwargs={
        **response.message.additional_kwargs, "tool_calls": calls, "invalid_tool_calls": invalid})
    return response.model_copy(update={"message": msg})


def _visible(text: str) -> str:
    """The part of a growing reply that is surely text: before the first ``<tool_call>``, and never a tail
    that may be the start of one, nor trailing whitespace (the parsed reply drops it before a call)."""
    i = text.find(_OPEN)
    if i >= 0:
        return text[:i].rstrip()
    for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(_OPEN[:k]):
            return text[:-k].rstrip()
    return text.rstrip()


def stream_with_tool_calls(pieces: Iterable[CompletionResponse], parallel: bool = True) -> Iterator[ChatResponse]:
    """Chat responses from a completion stream with tools: the text is streamed as it comes (up to the first
    ``<tool_call>``: call blocks are not text), and one last response carries the whole reply parsed, with
    its calls in ``additional_kwargs["tool_calls"]`` (as :func:`with_tool_calls`)."""
    text = shown = ""
    for piece in pieces:
        text += piece.delta or ""
        visible = _visible(text)
        if len(visible) > len(shown):
            delta, shown = visible[len(shown):], visible
            yield ChatResponse(message=ChatMessage(role="assistant", content=shown), delta=delta)
    final = with_tool_calls(ChatResponse(message=ChatMessage(role="assistant", content=text)), parallel)
    content = final.message.content or ""
    yield final.model_copy(update={"delta": content[len(shown):] if content.startswith(shown) else ""})

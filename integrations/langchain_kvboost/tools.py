"""Tool calling for ChatKVBoost: tools go to the chat template, tool calls come back parsed.

Local instruct models (Qwen2.5/3, Hermes, many Llama fine-tunes) are trained on the Hermes convention: the
tool schemas are rendered by the chat template (``apply_chat_template(..., tools=[...])``), and the model
answers ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A ``ToolMessage`` goes back as a
``{"role": "tool"}`` message, an earlier call as the assistant message's ``tool_calls``.

With ``tool_choice="auto"`` the model decides and writes freely: malformed JSON becomes
``invalid_tool_calls``. A forced choice ("any"/"required"/True or a tool's name) is decoded under a grammar
(:func:`kvboost_rag.constrained.generate_tool_call`), so the call parses. A template without a tools section
gets the tools in the system message (:func:`kvboost_rag.toolcalls.messages_with_tools`).

``parallel_tool_calls`` (bind_tools or a call keyword, as langchain-openai takes it): True lets a forced reply
hold 1..MAX_PARALLEL_CALLS (8) calls, the model choosing how many; False means one call, forced or free (a free
reply keeps its first). The default (None) is not OpenAI's (parallel allowed): it keeps the behaviour from before
parallel calls, one forced call and every call of a free reply, because SmolLM2-135M, forced with parallel calls
allowed, repeated the call on single-question prompts (two or more calls on 6 of 7 measured, e.g. Paris in
celsius then in fahrenheit; twice the reminder), which a tool with side effects would run twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.messages.tool import InvalidToolCall, ToolCall

from kvboost_rag.toolcalls import first_call_only, max_calls, parse_tool_call_blocks


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """(text outside the tool-call blocks, parsed calls, blocks that are not a valid call); without
    ``parallel``, the first valid call alone (:func:`kvboost_rag.toolcalls.first_call_only`)."""
    content, blocks = parse_tool_call_blocks(text)
    calls = [ToolCall(name=b.name, args=b.args, id=_call_id(), type="tool_call")
             for b in blocks if b.error is None and b.name is not None and b.args is not None]
    invalid = [InvalidToolCall(name=None, args=b.body, id=_call_id(), error=b.error, type="invalid_tool_call")
               for b in blocks if b.error is not None]
    if not parallel:
        calls, invalid = first_call_only(calls, invalid)
    return content, calls, invalid


def message_dict(m: BaseMessage, role: str, content: str) -> dict[str, Any]:
    """One LangChain message as the chat-template dict, tool calls and tool results included."""
    out: dict[str, Any] = {"role": role, "content": content}
    if isinstance(m, AIMessage) and m.tool_calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["name"], "arguments": c["args"]}} for c in m.tool_calls]
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def format_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """Tools (BaseTool, pydantic models, functions, OpenAI dicts) -> OpenAI function schemas, which HF chat
    templates accept as ``tools=``."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return [convert_to_openai_tool(t) for t in tools]


def tool_choice_names(tool_choice: Any, tools: list[dict[str, Any]]) -> str | None:
    """Validate ``tool_choice`` against the bound tools; the name of a forced tool, if one is forced."""
    if tool_choice is None or isinstance(tool_choice, bool) or tool_choice in ("auto", "none", "any", "required"):
        return None
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound: {names}")
    return str(name)


@dataclass(frozen=True)
class ToolPlan:
    """How a call with bound tools is made: ``forced`` (constrained to a call of ``name``, or of any of
    ``tools`` when ``name`` is None) or free generation, the reply parsed either way; ``parallel``: the
    call's ``parallel_tool_calls`` (see the module docstring)."""

    tools: list[dict[str, Any]]
    forced: bool
    name: str | None = None
    parallel: bool | None = None

    @property
    def calls(self) -> int:
        """How many calls a forced reply may hold: several only when parallel calls are asked for."""
        return max_calls(self.parallel is True)

    @property
    def keep_all(self) -> bool:
        """Whether every parsed call is kept (else the first alone): unless parallel calls are refused."""
        return self.parallel is not False


def check_parallel(parallel_tool_calls: Any) -> bool | None:
    """``parallel_tool_calls`` itself; TypeError unless it is a bool or None."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be a bool or None, got {type(parallel_tool_calls).__name__}")
    return parallel_tool_calls


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any,
              parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """None without tools (or with ``tool_choice="none"``/False); else the plan ``tool_choice`` and
    ``parallel_tool_calls`` call for."""
    parallel = check_parallel(parallel_tool_calls)
    if not tools or tool_choice in ("none", False):
        return None
    name = tool_choice_names(tool_choice, tools)
    forced = name is not None or tool_choice is True or tool_choice in ("any", "required")
    return ToolPlan(tools=tools, forced=forced, name=name, parallel=parallel)


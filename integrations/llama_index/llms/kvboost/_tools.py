"""LlamaIndex messages <-> chat-template dicts with tool calls, ``<tool_call>`` replies -> ToolSelections, which
calls are forced (``tool_required``/``tool_choice``) and streaming with tools (parsing is
:mod:`kvboost_rag.toolcalls`, shared with the LangChain integration)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, MessageRole
from llama_index.core.llms.llm import ToolSelection

from kvboost_rag.toolcalls import (
    CallTextStream,
    chat_inputs,
    first_call_only,
    parse_tool_call_blocks,
    tool_name,
)


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


def chat_history(rag: Any, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None,
                 messages_to_prompt: Any = None) -> str:
    """A chat call's history: the messages up to the last assistant message, rendered as the prompt is (by the
    chat template, or by ``messages_to_prompt`` when one is set); "" before the first answer. It is exact, and
    the reply is backfilled for the next turn (kvboost_core.engine.exact_history)."""
    if messages_to_prompt is not None:
        last = max((i for i, m in enumerate(messages) if m.role == MessageRole.ASSISTANT), default=-1)
        return str(messages_to_prompt(messages[: last + 1])) if last >= 0 else ""
    return str(rag.chat_history(*chat_inputs(rag.tokenizer, tool_chat_dicts(messages), tools)))


def tool_chat_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: an assistant's earlier tool calls (ToolSelections in
    ``additional_kwargs["tool_calls"]``) and a tool result's ``tool_call_id``/``name`` included."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        calls = m.additional_kwargs.get("tool_calls")
        # No text: "" for an assistant's tool calls, else None, which chat_prompt rejects naming the message (it
        # was rendered as an empty message).
        d: dict[str, Any] = {"role": role, "content": "" if m.content is None and calls else m.content}
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
    the first valid call alone (as llama-index's OpenAI ``force_single_tool_call``). A response reporting
    its call (``finish_reason``) says "tool_calls" when it holds calls, as OpenAI does."""
    content, blocks = parse_tool_call_blocks(response.message.content or "")
    calls = [ToolSelection(tool_id=f"call_{uuid.uuid4().hex[:24]}", tool_name=b.name, tool_kwargs=b.args)
             for b in blocks if b.error is None and b.name is not None and b.args is not None]
    invalid = [{"body": b.body, "error": b.error} for b in blocks if b.error is not None]
    if not parallel:
        calls, invalid = first_call_only(calls, invalid)
    # a new message, not model_copy: the content lives in the message's blocks
    msg = ChatMessage(role=response.message.role, content=content, additional_kwargs={
        **response.message.additional_kwargs, "tool_calls": calls, "invalid_tool_calls": invalid})
    update: dict[str, Any] = {"message": msg}
    if calls and "finish_reason" in response.additional_kwargs:
        update["additional_kwargs"] = {**response.additional_kwargs, "finish_reason": "tool_calls"}
    return response.model_copy(update=update)


def stream_with_tool_calls(pieces: Iterable[CompletionResponse], parallel: bool = True) -> Iterator[ChatResponse]:
    """Chat responses from a completion stream with tools: the text is streamed as it comes, holding back only
    what may be a ``<tool_call>`` block (:class:`kvboost_rag.toolcalls.CallTextStream`), and one last response
    carries the whole reply parsed, with its calls in ``additional_kwargs["tool_calls"]`` (as
    :func:`with_tool_calls`) and the call's report (from the stream's last response)."""
    split = CallTextStream()
    last: CompletionResponse | None = None
    for piece in pieces:
        last = piece
        delta = split.push(piece.delta or "")
        if delta:
            yield ChatResponse(message=ChatMessage(role="assistant", content=split.shown), delta=delta)
    final = with_tool_calls(ChatResponse(message=ChatMessage(role="assistant", content=split.text),
                                         raw=last.raw if last else None,
                                         additional_kwargs=dict(last.additional_kwargs) if last else {}), parallel)
    yield final.model_copy(update={"delta": split.rest(final.message.content or "")})


class ToolCalling:
    """KVBoostLLM's function calling (a mixin placed before llama-index's ``FunctionCallingLLM``): tools rendered
    by the chat template (or described in the system message), ``<tool_call>`` replies parsed."""

    _template_chat: bool

    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """Messages plus the tools as OpenAI schemas, which chat() hands to the chat template (``tools=``; a
        template without a tools section gets them in the system message). ``tool_required`` (or
        ``tool_choice`` "required"/a tool's name) constrains the reply to valid calls by grammar: 1..8 of them
        with ``allow_parallel_tool_calls``, else one (free replies keep their first call, as OpenAI's)."""
        if not self._template_chat:
            raise ValueError("function calling needs the tokenizer's chat template; this KVBoostLLM has "
                             "messages_to_prompt")
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role="user", content=user_msg) if isinstance(user_msg, str) else user_msg)
        schemas = [t.metadata.to_openai_tool() for t in tools]
        if tool_choice is None and tool_required:
            tool_choice = "required"
        req = tool_request(schemas, tool_choice, allow_parallel_tool_calls)  # a bad tool_choice fails here
        if req is not None and req.forced:  # decoded under a grammar: llguidance is checked now
            from kvboost_rag.constrained import require_grammar

            require_grammar("a forced tool call (tool_required / tool_choice)")
        return {"messages": messages, "tools": schemas, "tool_choice": tool_choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     allow_parallel_tool_calls: bool = True, **kwargs: Any) -> list[Any]:
        """The reply's ``<tool_call>`` blocks as ToolSelections (ValueError when there is none, if asked); the
        first alone with ``allow_parallel_tool_calls=False`` (a chat that disallowed them kept one already)."""
        calls = list(response.message.additional_kwargs.get("tool_calls") or [])
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call in the reply, got {response.message.content!r}")
        return calls if allow_parallel_tool_calls else calls[:1]

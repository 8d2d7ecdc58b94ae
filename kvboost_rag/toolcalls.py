"""Hermes/Qwen tool calls without any framework: replies parsed from ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks (the convention chat templates with a ``tools`` section teach), the JSON schema of a forced
call (the grammar of constrained decoding when ``tool_choice`` forces a tool; with parallel calls allowed,
the Lark grammar of 1..MAX_PARALLEL_CALLS such blocks), and the tools described in the system message for
templates that do not render tools. The LangChain and the LlamaIndex integrations wrap the
results in their own types."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvboost_rag.json_schema import closed_schema

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


# ---------------------------------------------------------------------------------------------------- streaming
_OPEN = "<tool_call>"


def surely_text(text: str) -> str:
    """The part of a growing reply that is surely text: before the first ``<tool_call>``, and never a tail
    that may be the start of one, nor trailing whitespace (the parsed reply drops it before a call). Always a
    prefix of ``text``, so what it returns for a longer reply extends what it returned before."""
    i = text.find(_OPEN)
    if i >= 0:
        return text[:i].rstrip()
    for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(_OPEN[:k]):
            return text[:-k].rstrip()
    return text.rstrip()


class CallTextStream:
    """A reply streamed while tools are bound with the model free to answer (tool_choice "auto"): text
    pieces are passed on as they come, holding back only what may be a ``<tool_call>`` block (see
    :func:`surely_text`); the whole reply is parsed at the end, and :meth:`rest` is what its parsed text adds
    to what was shown."""

    __slots__ = ("shown", "text")

    def __init__(self) -> None:
        self.text = ""  # the reply so far
        self.shown = ""  # the part of it passed on

    def push(self, piece: str) -> str:
        """Add a piece of the reply; the text to show now ("" when it may belong to a call)."""
        self.text += piece
        visible = surely_text(self.text)
        if len(visible) <= len(self.shown):
            return ""
        delta, self.shown = visible[len(self.shown):], visible
        return delta

    def rest(self, content: str) -> str:
        """What the parsed reply's text ``content`` adds to the text shown (its calls taken out)."""
        return content[len(self.shown):] if content.startswith(self.shown) else ""


# ---------------------------------------------------------------------------------------------------- forced calls
TOOL_CALL_START = "<tool_call>\n"  # a forced call's opening, written into the prompt; the grammar does the rest


def tool_name(tool: Any) -> str:
    """The name of an OpenAI-style tool schema (``{"type": "function", "function": {"name": ...}}``)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tools must be OpenAI function schemas with a name, got {tool!r}")
    return name


def _prefixed_refs(schema: Any, old: str, new: str) -> Any:
    if isinstance(schema, list):
        return [_prefixed_refs(s, old, new) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _prefixed_refs(v, old, new) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith(old):
        out["$ref"] = new + ref[len(old):]
    return out


def tool_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call ``{"name": ..., "arguments": ...}`` of the tool ``name`` (None: of any of
    ``tools``), each tool's arguments constrained by its own parameter schema. Local ``$defs``/``definitions``
    of the parameter schemas are moved to the root (prefixed by the tool's index) so their ``$ref``s resolve."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of OpenAI function schemas")
    names = [tool_name(t) for t in tools]
    if name is not None and name not in names:
        raise ValueError(f"tool {name!r} is not among the tools {names}")
    defs: dict[str, Any] = {}
    options = []
    for i, (tool, tname) in enumerate(zip(tools, names)):
        if name is not None and tname != name:
            continue
        params = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tool {tname!r}: parameters must be a JSON schema dict, got {params!r}")
        params = dict(params)
        for key in ("$defs", "definitions"):
            local = params.pop(key, None)
            if isinstance(local, dict):
                params = _prefixed_refs(params, f"#/{key}/", f"#/$defs/t{i}_")
                defs.update({f"t{i}_{k}": _prefixed_refs(v, f"#/{key}/", f"#/$defs/t{i}_")
                             for k, v in local.items()})
        options.append({"type": "object", "properties": {"name": {"const": tname}, "arguments": params},
                        "required": ["name", "arguments"]})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


# ---------------------------------------------------------------------------------------------------- parallel calls
MAX_PARALLEL_CALLS = 8  # most calls in one forced reply: a grammar bound, so a looping model cannot run on
TOOL_CALL_END = "\n</tool_call>"
# Between two blocks, as Qwen2.5's template writes an assistant's several calls (and messages_with_tools does).
CALL_SEPARATOR = "\n"


def max_calls(parallel: bool) -> int:
    """How many calls a forced reply may hold: MAX_PARALLEL_CALLS when parallel calls are allowed, else 1."""
    if not isinstance(parallel, bool):
        raise TypeError(f"parallel tool calls must be a bool, got {type(parallel).__name__}")
    return MAX_PARALLEL_CALLS if parallel else 1


def tool_calls_grammar(tools: list[dict[str, Any]], name: str | None = None,
                       calls: int = MAX_PARALLEL_CALLS) -> str:
    """The Lark grammar (llguidance) of 1..``calls`` forced calls after :data:`TOOL_CALL_START`: each a compact
    JSON call of :func:`tool_call_schema` (every block chooses its own tool), blocks joined by ``</tool_call>``,
    :data:`CALL_SEPARATOR` and ``<tool_call>``, the last one's ``</tool_call>`` optional. The model decides how
    many: after each closed block it may end (EOS) or open the next one; after ``calls`` blocks it must end."""
    if isinstance(calls, bool) or not isinstance(calls, int) or not 1 <= calls <= MAX_PARALLEL_CALLS:
        raise ValueError(f"calls must be an int in 1..{MAX_PARALLEL_CALLS}, got {calls!r}")
    schema = {**closed_schema(tool_call_schema(tools, name)), "x-guidance": {"whitespace_flexible": False}}
    between = json.dumps(TOOL_CALL_END + CALL_SEPARATOR + TOOL_CALL_START)
    return (f"start: call ({between} call){{0,{calls - 1}}} {json.dumps(TOOL_CALL_END)}?\n"
            f"call: %json {json.dumps(schema)}\n")


def complete_calls(text: str) -> tuple[str, int] | None:
    """For a forced reply of several blocks (after :data:`TOOL_CALL_START`) that the token budget cut short:
    (``text`` cut after its last complete call and closed, how many started blocks were dropped: 0 or 1),
    since the blocks before the cut one are whole calls worth keeping. None without one complete call."""
    decoder = json.JSONDecoder()
    between = TOOL_CALL_END + CALL_SEPARATOR + TOOL_CALL_START
    pos = kept = 0
    while True:
        try:
            kept = decoder.raw_decode(text, pos)[1]
        except ValueError:
            break
        if not text.startswith(between, kept):
            break
        pos = kept + len(between)
    if kept == 0:
        return None
    # what follows the last whole call is its (maybe cut) closing tag, or the start of a block that was cut
    return text[:kept] + TOOL_CALL_END, int(not TOOL_CALL_END.startswith(text[kept:]))


def first_call_only(calls: list[Any], invalid: list[Any]) -> tuple[list[Any], list[Any]]:
    """(calls, invalid) of a reply when parallel calls are not allowed: the first valid call alone (as OpenAI's
    ``parallel_tool_calls=False`` and llama-index's ``force_single_tool_call``); the malformed blocks are kept
    only when there is no valid call, so the caller still sees why."""
    return (calls[:1], []) if calls else ([], invalid)


# ---------------------------------------------------------------------------------------------------- templates
_TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template has a ``tools`` section (Qwen2.5/3, Hermes, Llama 3.1 ...)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def chat_inputs(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for ``KVBoostRAG.chat_prompt``: the tools go to a template that renders them, or
    into the system message (:func:`messages_with_tools`) of one that does not."""
    if tools and not template_renders_tools(tokenizer):
        return messages_with_tools(messages, tools), None
    return messages, tools


def messages_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For chat templates without a ``tools`` section: the messages with the tools described the way
    Qwen2.5's template does it (a Hermes ``# Tools`` block added to the system message, or a new first system
    message), earlier calls written as ``<tool_call>`` blocks in the assistant's text and tool results as user
    ``<tool_response>`` messages, so any template renders them."""
    block = _TOOLS_TEXT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if calls:
            text = "".join(f"\n<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>"
                           for c in calls)
            m["content"] = (str(m.get("content") or "") + text).lstrip("\n")
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _call_json(call: Any) -> dict[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": fn.get("name"), "arguments": args}

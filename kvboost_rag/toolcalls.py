"""Hermes/Qwen tool calls without any framework: replies parsed from ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks (the convention chat templates with a ``tools`` section teach), the JSON schema of a forced
call (the grammar of constrained decoding when ``tool_choice`` forces a tool), and the tools described in the
system message for templates that do not render tools. The LangChain and the LlamaIndex integrations wrap the
results in their own types."""

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

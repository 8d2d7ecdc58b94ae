"""kvboost_rag.toolcalls without a framework: the JSON schema of a forced call (its grammar), the tools
described in the system message for templates without a tools section, and forced calls decoded under that
grammar on a random tiny model (whose free output is noise, so every valid call is the grammar's doing)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_rag import KVBoostRAG  # noqa: E402
from kvboost_rag.constrained import generate_tool_call  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402
from kvboost_rag.toolcalls import (  # noqa: E402
    TOOL_CALL_START,
    chat_inputs,
    messages_with_tools,
    parse_tool_call_blocks,
    template_renders_tools,
    tool_call_schema,
)


def _tool(name: str, properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": properties, "required": required or list(properties), **extra}}}


# Finite argument spaces (enums, booleans): a random model cannot run out of budget inside a string.
SET_MODE = _tool("set_mode", {"mode": {"type": "string", "enum": ["eco", "fast", "off"]}, "loud": {"type": "boolean"}})
PICK = _tool("pick", {"item": {"$ref": "#/$defs/Item"}}, **{"$defs": {"Item": {"type": "string",
                                                                                "enum": ["a", "b"]}}})
NO_ARGS = _tool("ping", {})


def _valid(tools: list[dict], name: str, args: dict) -> bool:
    tool = next(t for t in tools if t["function"]["name"] == name)
    params = tool["function"]["parameters"]
    jsonschema.validate(args, {**params, "additionalProperties": False})
    return True


def test_schema_accepts_exactly_the_calls_of_the_tools():
    schema = tool_call_schema([SET_MODE, PICK, NO_ARGS])
    ok = [{"name": "set_mode", "arguments": {"mode": "eco", "loud": True}}, {"name": "pick", "arguments":
          {"item": "b"}}, {"name": "ping", "arguments": {}}]
    bad = [{"name": "set_mode", "arguments": {"mode": "slow", "loud": True}}, {"name": "nope", "arguments": {}},
           {"name": "pick", "arguments": {"item": "c"}}, {"name": "ping"}]
    for call in ok:
        jsonschema.validate(call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    assert list(schema["$defs"]) == ["t1_Item"]  # hoisted to the root under a prefixed name
    assert '"$ref": "#/$defs/t1_Item"' in json.dumps(schema)
    named = tool_call_schema([SET_MODE, PICK], "pick")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "set_mode", "arguments": {"mode": "eco", "loud": True}}, named)
    with pytest.raises(ValueError, match="not among"):
        tool_call_schema([SET_MODE], "pick")
    with pytest.raises(ValueError, match="non-empty"):
        tool_call_schema([])
    with pytest.raises(ValueError, match="name"):
        tool_call_schema([{"type": "function", "function": {}}])


def test_tools_go_to_the_system_message_when_the_template_has_no_tools_section():
    tok = tiny_model_and_tokenizer()[1]
    assert not template_renders_tools(tok)
    history = [{"role": "user", "content": "mode?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "set_mode", "arguments": {"mode": "eco", "loud": False}}}]},
               {"role": "tool", "content": "done", "tool_call_id": "c1"}]
    msgs, tools = chat_inputs(tok, history, [SET_MODE])
    assert tools is None and msgs[0]["role"] == "system" and '"name": "set_mode"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "set_mode", "arguments": {"mode": "eco", "loud": false}}' \
                                 "\n</tool_call>" and "tool_calls" not in msgs[2]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\ndone\n</tool_response>"}
    merged = messages_with_tools([{"role": "system", "content": "Be brief."}], [SET_MODE])
    assert len(merged) == 1 and merged[0]["content"].startswith("Be brief.\n\n# Tools")
    assert chat_inputs(tok, history, None) == (history, None)


@pytest.fixture(scope="module")
def rag():
    return KVBoostRAG(KVEngine(*tiny_model_and_tokenizer()))


@pytest.mark.parametrize("name", [None, "pick", "ping"])
def test_forced_calls_of_a_random_model_always_parse(rag, name):
    tools = [SET_MODE, PICK, NO_ARGS]
    prompt = rag.chat_prompt(*chat_inputs(rag.tokenizer, [{"role": "user", "content": "go"}], tools))
    seen = set()
    for seed in range(3):
        res, text = generate_tool_call(rag, prompt, tools, name, max_new_tokens=96, temperature=1.0, seed=seed)
        assert res.finish_reason == "stop" and text.startswith(TOOL_CALL_START)
        content, calls = parse_tool_call_blocks(text)
        assert content == "" and len(calls) == 1 and calls[0].error is None, text
        assert _valid(tools, calls[0].name, calls[0].args) and calls[0].name == (name or calls[0].name)
        seen.add(calls[0].name)
        free = rag.generate(prompt + TOOL_CALL_START, max_new_tokens=24, temperature=1.0, seed=seed).text
        assert not [b for b in parse_tool_call_blocks(TOOL_CALL_START + free)[1] if b.error is None]  # unforced
    assert name is not None or len(seen) >= 2  # the choice of tool is left to the model


def test_forced_call_rejects_bad_input(rag):
    with pytest.raises(TypeError, match="prompt"):
        generate_tool_call(rag, None, [SET_MODE])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not among"):
        generate_tool_call(rag, "x", [SET_MODE], "nope")

"""KVBoostLLM function calling: is_function_calling_model follows the chat template, tools are rendered by it,
Hermes/Qwen ``<tool_call>`` replies become ToolSelections, and a ``role="tool"`` result goes back through the
template (scripted replies: a random tiny model writes no tool calls)."""

from __future__ import annotations

import asyncio
import copy
from typing import Literal

import pytest

pytest.importorskip("llama_index.core")

from helpers import spy_generate  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_core.results import GenerationResult  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402
from kvboost_rag.toolcalls import parse_tool_call_blocks  # noqa: E402

# Qwen2.5's tool section and message rendering, reduced to what the test needs.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nReturn <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


WEATHER = FunctionTool.from_defaults(fn=get_weather)


def _llm(template: str | None) -> KVBoostLLM:
    model, shared = tiny_model_and_tokenizer()
    tok = copy.deepcopy(shared)  # the tiny tokenizer may be shared (cached): keep its template intact
    if template is not None:
        tok.chat_template = template
    return KVBoostLLM(engine=KVEngine(model, tok), max_new_tokens=4, is_chat_model=True)


def _script(llm: KVBoostLLM, replies: list[str]) -> list[str]:
    """Make llm.rag.generate answer ``replies`` in turn; returns the prompts it was given."""
    prompts: list[str] = []

    def generate(prompt, **kw):
        prompts.append(prompt)
        return GenerationResult(text=replies[len(prompts) - 1], token_ids=[5] * 3, prompt_token_ids=[1] * 10,
                                ttft_s=0.01, total_s=0.02, reuse_ratio=0.0, finish_reason="eos",
                                stats={"reuse_ratio": 0.0})

    object.__setattr__(llm.rag, "generate", generate)
    return prompts


PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Gemma-style: no system role, so tools cannot be described in a system message either.
NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                      "supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def test_is_function_calling_model_wherever_tools_render():
    """Issue 26: a template without a tools section takes them in the system message, so it is a function-calling
    model too (FunctionAgent and predict_and_call refused SmolLM2's); a template that renders neither is not,
    and the field overrides the probe either way."""
    assert _llm(TOOL_TEMPLATE).metadata.is_function_calling_model is True
    plain = _llm(PLAIN_TEMPLATE)
    assert plain.metadata.is_function_calling_model is True
    prompts = _script(plain, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'])
    resp = plain.chat_with_tools([WEATHER], user_msg="weather?")  # tools described in the system message
    assert prompts[0].startswith("system: # Tools\n") and '"name": "get_weather"' in prompts[0]
    assert plain.get_tool_calls_from_response(resp)[0].tool_kwargs == {"city": "Oslo"}
    assert plain.predict_and_call([WEATHER], user_msg="weather in Rome?").response == "sunny in Rome"
    no_system = _llm(NO_SYSTEM_TEMPLATE)
    assert no_system.metadata.is_function_calling_model is False
    model, tok = tiny_model_and_tokenizer()
    custom = KVBoostLLM(engine=KVEngine(model, tok), messages_to_prompt=lambda ms: "\n".join(str(m) for m in ms))
    assert custom.metadata.is_function_calling_model is False
    with pytest.raises(ValueError, match="template"):
        custom.chat_with_tools([WEATHER], user_msg="weather?")
    # the override, both ways
    forced_on = KVBoostLLM(engine=no_system.rag, is_function_calling_model=True)
    assert forced_on.metadata.is_function_calling_model is True
    assert KVBoostLLM(engine=plain.rag, is_function_calling_model=False).metadata.is_function_calling_model is False


def test_chat_with_tools_round_trip():
    llm = _llm(TOOL_TEMPLATE)
    prompts = _script(llm, ['Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                            '\n</tool_call>', "It is sunny in Paris."])
    resp = llm.chat_with_tools([WEATHER], user_msg="Weather in Paris?")
    assert '"name": "get_weather"' in prompts[0] and "<tools>" in prompts[0]  # rendered by the template
    calls = llm.get_tool_calls_from_response(resp)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].tool_id.startswith("call_")
    assert resp.message.content == "Checking."

    result = WEATHER.call(**calls[0].tool_kwargs)
    history = [ChatMessage(role="user", content="Weather in Paris?"), resp.message,
               ChatMessage(role="tool", content=str(result), additional_kwargs={"tool_call_id": calls[0].tool_id})]
    final = llm.chat_with_tools([WEATHER], chat_history=history)
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompts[1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompts[1]
    assert llm.get_tool_calls_from_response(final, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(final)
    assert final.message.content == "It is sunny in Paris."


def test_predict_and_call_and_malformed_call():
    llm = _llm(TOOL_TEMPLATE)
    _script(llm, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                  "<tool_call>{not json}</tool_call>"])
    out = llm.predict_and_call([WEATHER], user_msg="Weather in Oslo?")
    assert out.response == "sunny in Oslo"
    bad = llm.chat_with_tools([WEATHER], user_msg="again")
    assert llm.get_tool_calls_from_response(bad, error_on_no_tool_call=False) == []
    assert bad.message.additional_kwargs["invalid_tool_calls"][0]["body"] == "{not json}"


def test_parser_rejects_non_text():
    with pytest.raises(TypeError, match="text"):
        parse_tool_call_blocks(None)  # type: ignore[arg-type]
    assert parse_tool_call_blocks("no calls") == ("no calls", [])


def set_mode(mode: Literal["eco", "fast", "off"], loud: bool) -> str:
    """Set the device mode."""
    return mode


# real annotation objects: this module's `from __future__ import annotations` leaves strings LlamaIndex can't resolve
set_mode.__annotations__ = {"mode": Literal["eco", "fast", "off"], "loud": bool, "return": str}
MODE = FunctionTool.from_defaults(fn=set_mode)




@pytest.mark.parametrize("how", [{"tool_required": True}, {"tool_choice": "set_mode"}])
def test_tool_required_is_constrained_to_a_valid_call(how):
    # A random-weight model writes no call freely; tool_required/tool_choice make every reply a valid call.
    llm = _llm(TOOL_TEMPLATE)
    calls = spy_generate(llm)
    for seed in range(2):
        resp = llm.chat_with_tools([WEATHER, MODE], user_msg="set the mode", max_new_tokens=96, temperature=1.0,
                                   seed=seed, **how)
        assert calls[-1]["prompt"].endswith("<|im_start|>assistant\n<tool_call>\n")
        assert calls[-1]["logits_processor"] is not None
        sel = llm.get_tool_calls_from_response(resp)
        assert len(sel) == 1 and not resp.message.additional_kwargs["invalid_tool_calls"]
        if "tool_choice" in how:
            assert sel[0].tool_name == "set_mode"
        if sel[0].tool_name == "set_mode":
            assert sel[0].tool_kwargs["mode"] in ("eco", "fast", "off") and isinstance(sel[0].tool_kwargs["loud"], bool)
        else:
            assert list(sel[0].tool_kwargs) == ["city"]
    free = llm.chat_with_tools([WEATHER, MODE], user_msg="set the mode", max_new_tokens=16)
    assert "logits_processor" not in calls[-1] and llm.get_tool_calls_from_response(free, False) == []
    with pytest.raises(ValueError, match="names none of the tools"):
        llm.chat_with_tools([WEATHER], user_msg="x", tool_choice="nope")


def _script_stream(llm: KVBoostLLM, pieces: list[str]) -> None:
    def stream(prompt, **kw):
        yield from pieces

    object.__setattr__(llm.rag, "stream", stream)


def test_stream_chat_with_tools_streams_text_and_ends_with_the_calls():
    llm = _llm(TOOL_TEMPLATE)
    _script_stream(llm, ["Let me ", "check.", " <tool", '_call>\n{"name": "get_weather", ', '"arguments": ',
                         '{"city": "Rome"}}\n</tool_call>'])
    out = list(llm.stream_chat_with_tools([WEATHER], user_msg="Weather in Rome?"))
    assert "".join(r.delta for r in out) == "Let me check."  # the call block is not streamed as text
    assert all("<" not in r.message.content for r in out)
    calls = llm.get_tool_calls_from_response(out[-1])
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert out[-1].message.content == "Let me check." and not llm.get_tool_calls_from_response(out[0], False)
    _script_stream(llm, ["It is ", "sunny ", "<b>."])
    out = list(llm.stream_chat_with_tools([WEATHER], user_msg="Weather?"))
    assert "".join(r.delta for r in out) == "It is sunny <b>." and out[-1].message.content == "It is sunny <b>."
    assert llm.get_tool_calls_from_response(out[-1], error_on_no_tool_call=False) == []
    _script_stream(llm, [])
    out = list(llm.stream_chat_with_tools([WEATHER], user_msg="Weather?"))
    assert len(out) == 1 and out[0].message.content == ""  # an empty reply still ends the stream


def test_astream_chat_with_tools_and_forced_streaming():
    llm = _llm(TOOL_TEMPLATE)
    _script_stream(llm, ["Sure. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'])

    async def collect(gen_coro):
        return [r async for r in await gen_coro]

    out = asyncio.run(collect(llm.astream_chat_with_tools([WEATHER], user_msg="Weather in Oslo?")))
    assert out[-1].message.content == "Sure." and llm.get_tool_calls_from_response(out[-1])[0].tool_kwargs == \
        {"city": "Oslo"}
    forced = list(llm.stream_chat_with_tools([WEATHER, MODE], user_msg="mode?", tool_choice="set_mode",
                                             max_new_tokens=96))
    assert len(forced) == 1 and llm.get_tool_calls_from_response(forced[0])[0].tool_name == "set_mode"
    with pytest.raises(TypeError, match="bogus"):
        llm.stream_chat_with_tools([WEATHER], user_msg="x", bogus=1)


def test_function_agent_streams_and_runs_the_tool():
    """LlamaIndex's FunctionAgent drives astream_chat_with_tools: the call in the last streamed response is
    executed and its result goes back through the template."""
    from llama_index.core.agent.workflow import FunctionAgent

    llm = _llm(TOOL_TEMPLATE)
    turns = [["Checking. ", '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>'],
             ["It is sunny ", "in Paris."]]
    prompts: list[str] = []

    def stream(prompt, **kw):
        prompts.append(prompt)
        yield from turns[len(prompts) - 1]

    object.__setattr__(llm.rag, "stream", stream)
    agent = FunctionAgent(tools=[WEATHER], llm=llm, streaming=True)

    async def run():
        return await agent.run(user_msg="Weather in Paris?")

    result = asyncio.run(run())
    assert result.response.content == "It is sunny in Paris." and len(prompts) == 2
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompts[1]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompts[1]

"""ChatKVBoost tool calling: tools rendered by the chat template, Hermes/Qwen ``<tool_call>`` replies parsed
into AIMessage.tool_calls, and the ToolMessage round trip back through the template (scripted replies: a
random tiny model writes no tool calls)."""

from __future__ import annotations

import copy
from typing import Literal

import pytest

pytest.importorskip("langchain_core")

from helpers import spy_generate  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_kvboost import ChatKVBoost  # noqa: E402
from langchain_kvboost.tools import ToolPlan, format_tools, parse_tool_calls, tool_plan  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_core.results import GenerationResult  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402

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


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture
def chat():
    model, shared = tiny_model_and_tokenizer()
    tok = copy.deepcopy(shared)  # the tiny tokenizer may be shared (cached): keep its template intact
    tok.chat_template = TOOL_TEMPLATE
    return ChatKVBoost(engine=KVEngine(model, tok), max_tokens=4)


def _script(chat, replies: list[str]) -> list[str]:
    """Make chat.rag.generate answer ``replies`` in turn; returns the prompts it was given."""
    prompts: list[str] = []

    def generate(prompt, **kw):
        prompts.append(prompt)
        text = replies[len(prompts) - 1]
        return GenerationResult(text=text, token_ids=[5] * 3, prompt_token_ids=[1] * 10, ttft_s=0.01,
                                total_s=0.02, reuse_ratio=0.0, finish_reason="eos", stats={"reuse_ratio": 0.0})

    object.__setattr__(chat.rag, "generate", generate)
    return prompts


def test_tool_call_round_trip(chat):
    prompts = _script(chat, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                             "It is sunny in Paris."])
    bound = chat.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Paris?")
    ai = bound.invoke([question])
    assert '"name": "get_weather"' in prompts[0] and "<tools>" in prompts[0]  # tools went to the template
    assert ai.content == ""
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = get_weather.invoke(ai.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == ai.tool_calls[0]["id"]
    final = bound.invoke([question, ai, result])
    assert final.content == "It is sunny in Paris." and not final.tool_calls
    # the earlier call and its result went back through the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompts[1]
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompts[1]


@tool
def set_mode(mode: Literal["eco", "fast", "off"], loud: bool) -> str:
    """Set the device mode."""
    return mode




@pytest.mark.parametrize("choice", ["any", "set_mode"])
def test_forced_tool_choice_is_constrained_to_a_valid_call(chat, choice):
    # A random-weight model: without the grammar it never writes a call (checked below), with it always does.
    calls = spy_generate(chat)
    bound = chat.bind_tools([get_weather, set_mode], tool_choice=choice, max_tokens=96, temperature=1.0,
                            parallel_tool_calls=False)  # one call (parallel ones: test_parallel_tool_calls.py)
    for seed in range(2):
        ai = bound.invoke("set the mode", seed=seed)
        assert calls[-1]["prompt"].endswith("<|im_start|>assistant\n<tool_call>\n")
        assert calls[-1]["logits_processor"] is not None and not ai.invalid_tool_calls
        assert len(ai.tool_calls) == 1 and ai.content == ""
        call = ai.tool_calls[0]
        if choice not in ("any", "required", True):
            assert call["name"] == "set_mode"
        if call["name"] == "set_mode":
            assert call["args"]["mode"] in ("eco", "fast", "off") and isinstance(call["args"]["loud"], bool)
        else:
            assert list(call["args"]) == ["city"] and isinstance(call["args"]["city"], str)
    chunks = list(bound.stream("set the mode", seed=0))
    assert len(chunks) == 1 and chunks[0].tool_calls[0]["name"] == ai.tool_calls[0]["name"]
    free = chat.bind_tools([get_weather, set_mode], max_tokens=24).invoke("set the mode")
    assert not free.tool_calls and "logits_processor" not in calls[-1]  # auto: free generation


def test_tool_choice_spellings():
    tools = format_tools([get_weather, set_mode])
    assert [tool_plan(tools, c) for c in (None, "auto")] == [ToolPlan(tools, forced=False)] * 2
    assert [tool_plan(tools, c) for c in ("any", "required", True)] == [ToolPlan(tools, forced=True)] * 3
    named = ToolPlan(tools, forced=True, name="set_mode")
    assert tool_plan(tools, "set_mode") == tool_plan(tools, {"type": "function", "function": {"name": "set_mode"}}) \
        == named
    assert tool_plan(tools, "none") is None and tool_plan(None, "any") is None and tool_plan(tools, False) is None


def test_tool_choice_none_and_bad_names(chat):
    calls = spy_generate(chat)
    chat.bind_tools([get_weather], tool_choice="none").invoke("hi")
    assert "<tools>" not in calls[-1]["prompt"] and "logits_processor" not in calls[-1]
    for bad in ("nope", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(ValueError, match="names no bound tool"):
            chat.bind_tools([get_weather], tool_choice=bad)


def test_template_without_tools_gets_them_in_the_system_message():
    model, tok = tiny_model_and_tokenizer()  # its template renders role and content only
    plain = ChatKVBoost(engine=KVEngine(model, tok), max_tokens=4)
    calls = spy_generate(plain)
    plain.bind_tools([get_weather]).invoke([("system", "Be brief."), ("human", "weather?")])
    assert calls[-1]["prompt"].startswith('<|system|>\nBe brief.\n\n# Tools\n') and "get_weather" in calls[-1]["prompt"]


def _script_stream(chat, pieces: list[str], reason: str = "eos") -> list[str]:
    """Make chat.rag.stream yield ``pieces`` (then report a result, as the adapter does); returns the prompts."""
    prompts: list[str] = []

    def stream(prompt, on_result=None, **kw):
        prompts.append(prompt)
        yield from pieces
        if on_result is not None:
            stats = {"reuse_ratio": 0.5, "reused_exact": 4, "reused_approx": 3, "reused_repaired": 0,
                     "documents_not_warmed": 1, "finish_reason": reason}
            result = GenerationResult(text="".join(pieces), token_ids=[5] * 3, prompt_token_ids=[1] * 10,
                                      ttft_s=0.01, total_s=0.02, reuse_ratio=0.5, finish_reason=reason, stats=stats)
            on_result(result, stats)

    object.__setattr__(chat.rag, "stream", stream)
    return prompts


def _aggregate(chunks):
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    return full


def test_streaming_with_tools_gives_tool_call_chunks(chat):
    _script_stream(chat, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'])
    full = _aggregate(list(chat.bind_tools([get_weather]).stream("weather in Rome?")))
    assert full.tool_calls[0]["name"] == "get_weather" and full.tool_calls[0]["args"] == {"city": "Rome"}
    assert full.response_metadata["finish_reason"] == "tool_calls"


def test_streaming_with_tools_under_auto_streams_the_text(chat):
    """Issue 26: binding tools turned token streaming off (one chunk at the end). Under "auto" text streams as
    it comes; only what may be a call is held back, and the calls come parsed on the last chunk."""
    pieces = ["It is ", "sunny ", "<b>", " in Rome", "."]
    _script_stream(chat, pieces)
    chunks = list(chat.bind_tools([get_weather]).stream("weather in Rome?"))
    assert [c.content for c in chunks[:-1]] == ["It is", " sunny", " <b>", " in Rome", "."]
    full = _aggregate(chunks)
    assert full.content == "It is sunny <b> in Rome." and full.tool_calls == []
    assert full.response_metadata["finish_reason"] == "stop"
    _script_stream(chat, ["Let me ", "check.", " <tool", '_call>\n{"name": "get_weather", ',
                          '"arguments": {"city": "Rome"}}\n</tool_call>'])
    chunks = list(chat.bind_tools([get_weather]).stream("weather in Rome?"))
    assert [c.content for c in chunks[:-1]] == ["Let me", " check."]  # the call block is not text
    full = _aggregate(chunks)
    assert full.content == "Let me check." and full.tool_calls[0]["args"] == {"city": "Rome"}
    assert full.response_metadata["finish_reason"] == "tool_calls"


def test_parse_tool_calls_edge_cases():
    content, calls, invalid = parse_tool_calls("plain answer")
    assert (content, calls, invalid) == ("plain answer", [], [])
    content, calls, invalid = parse_tool_calls('Let me check. <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
                                               '</tool_call><tool_call>{not json}</tool_call>')
    assert content == "Let me check." and calls[0]["args"] == {"a": 1} and len(invalid) == 1
    assert isinstance(AIMessage(content="", invalid_tool_calls=invalid).invalid_tool_calls[0]["error"], str)

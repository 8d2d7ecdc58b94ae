"""KVBoostLLM function calling: is_function_calling_model follows the chat template, tools are rendered by it,
Hermes/Qwen ``<tool_call>`` replies become ToolSelections, and a ``role="tool"`` result goes back through the
template (scripted replies: a random tiny model writes no tool calls)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("llama_index.core")

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


def test_is_function_calling_model_follows_the_template():
    assert _llm(TOOL_TEMPLATE).metadata.is_function_calling_model is True
    plain = _llm("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert plain.metadata.is_function_calling_model is False
    with pytest.raises(ValueError, match="template"):
        plain.chat_with_tools([WEATHER], user_msg="weather?")


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

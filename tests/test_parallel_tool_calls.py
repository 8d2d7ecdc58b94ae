"""Parallel forced tool calls: the grammar of 1..MAX_PARALLEL_CALLS ``<tool_call>`` blocks (each block its own
tool and arguments), what survives a budget cut, and how LangChain's ``parallel_tool_calls`` and LlamaIndex's
``allow_parallel_tool_calls`` choose between several calls and one. Scripted replies check parsing; the random
tiny model (whose free output is noise) checks the grammar: every block it writes is a valid call, and a
model that never wants to stop makes exactly MAX_PARALLEL_CALLS calls, or one when parallel calls are off."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_core.results import GenerationResult  # noqa: E402
from kvboost_rag import KVBoostRAG  # noqa: E402
from kvboost_rag.constrained import generate_tool_call  # noqa: E402
from kvboost_rag.tiny import tiny_model_and_tokenizer  # noqa: E402
from kvboost_rag.toolcalls import (  # noqa: E402
    CALL_SEPARATOR,
    MAX_PARALLEL_CALLS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    chat_inputs,
    complete_calls,
    first_call_only,
    max_calls,
    parse_tool_call_blocks,
    tool_call_schema,
    tool_calls_grammar,
)


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


# Finite argument spaces: a random model cannot run out of budget inside a string.
SET_MODE = _tool("set_mode", {"mode": {"type": "string", "enum": ["eco", "fast", "off"]}, "loud": {"type": "boolean"}})
PING = _tool("ping", {})
TOOLS = [SET_MODE, PING]
BETWEEN = TOOL_CALL_END + CALL_SEPARATOR + TOOL_CALL_START


def _call(name: str = "ping", **args) -> str:
    return json.dumps({"name": name, "arguments": args}, separators=(",", ":"))


def _blocks(n: int, end: bool = True) -> str:
    """n calls as a forced reply writes them after TOOL_CALL_START (alternating tools)."""
    calls = [_call("set_mode", mode="eco", loud=True) if i % 2 else _call() for i in range(n)]
    return BETWEEN.join(calls) + (TOOL_CALL_END if end else "")


@pytest.fixture(scope="module")
def rag():
    return KVBoostRAG(KVEngine(*tiny_model_and_tokenizer()))


def _matcher(rag, lark: str):
    import llguidance

    from kvboost_rag.constrained import _ll_tokenizer

    return llguidance.LLMatcher(_ll_tokenizer(rag.tokenizer, int(rag.engine.model.config.vocab_size)),
                                llguidance.LLMatcher.grammar_from_lark(lark))


def _accepts(rag, lark: str, text: str) -> bool:
    m = _matcher(rag, lark)
    return bool(m.consume_tokens(rag.tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting())


# ---------------------------------------------------------------------------------------------------- the grammar
def test_grammar_takes_1_to_8_blocks_and_never_9(rag):
    lark = tool_calls_grammar(TOOLS)
    for n in (1, 2, 3, MAX_PARALLEL_CALLS):
        assert _accepts(rag, lark, _blocks(n)) and _accepts(rag, lark, _blocks(n, end=False)), n
    assert not _accepts(rag, lark, _blocks(MAX_PARALLEL_CALLS + 1))
    m = _matcher(rag, lark)
    assert m.consume_tokens(rag.tokenizer.encode(_blocks(MAX_PARALLEL_CALLS), add_special_tokens=False))
    assert m.is_stopped()  # after the 8th block only the end is left
    assert not _accepts(rag, tool_calls_grammar(TOOLS, calls=2), _blocks(3))
    assert not _accepts(rag, lark, _call("nope"))  # every block is a call of a given tool
    assert not _accepts(rag, tool_calls_grammar(TOOLS, "ping"), _blocks(2))  # a named tool, in every block
    assert not _accepts(rag, lark, '{"name": "ping", "arguments": {}}')  # compact JSON, as the schema path
    for bad in (0, MAX_PARALLEL_CALLS + 1, True, 2.0):
        with pytest.raises(ValueError, match="calls"):
            tool_calls_grammar(TOOLS, calls=bad)
    assert max_calls(True) == MAX_PARALLEL_CALLS and max_calls(False) == 1
    with pytest.raises(TypeError, match="parallel"):
        max_calls(None)  # type: ignore[arg-type]


def test_parser_returns_every_block():
    for n in (2, 3):
        content, calls = parse_tool_call_blocks(TOOL_CALL_START + _blocks(n))
        assert content == "" and [c.name for c in calls] == ["ping", "set_mode", "ping"][:n]
        assert all(c.error is None for c in calls)


def test_complete_calls_keeps_the_whole_blocks_before_a_cut():
    two = _blocks(2)
    assert complete_calls(two) == (two, 0)
    assert complete_calls(_blocks(2, end=False)) == (two, 0)
    assert complete_calls(two[:-4]) == (two, 0)  # a cut closing tag is no lost call
    assert complete_calls(two + BETWEEN + '{"name":"pi') == (two, 1)
    assert complete_calls(two + BETWEEN[:5]) == (two, 1)
    assert complete_calls('{"name":"set_mo') is None
    assert first_call_only(["a", "b"], ["x"]) == (["a"], []) and first_call_only([], ["x"]) == ([], ["x"])


# ---------------------------------------------------------------------------------------------------- decoding
def _never_stop(owner) -> None:
    """Make the model behind ``owner.generate`` never choose EOS (set before the grammar's mask): it then
    writes calls until the grammar ends the reply."""
    real = owner.generate
    eos = owner.tokenizer.eos_token_id

    def generate(prompt, **kw):
        proc = kw["logits_processor"]

        def no_eos(ids, logits):
            logits[..., eos] = float("-inf")
            return proc(ids, logits)

        return real(prompt, **{**kw, "logits_processor": no_eos})

    object.__setattr__(owner, "generate", generate)


def _prompt(rag) -> str:
    return rag.chat_prompt(*chat_inputs(rag.tokenizer, [{"role": "user", "content": "go"}], TOOLS))


def _check(text: str) -> list:
    content, calls = parse_tool_call_blocks(text)
    assert content == "" and calls and all(c.error is None for c in calls), text
    for c in calls:
        jsonschema.validate({"name": c.name, "arguments": c.args}, tool_call_schema(TOOLS))
    return calls


def test_random_model_writes_valid_blocks_and_decides_how_many(rag):
    counts = []
    for seed in range(6):
        res, text = generate_tool_call(rag, _prompt(rag), TOOLS, calls=MAX_PARALLEL_CALLS, max_new_tokens=400,
                                       temperature=1.0, seed=seed)
        assert res.finish_reason in ("eos", "stop") and text.startswith(TOOL_CALL_START)
        counts.append(len(_check(text)))
    assert max(counts) >= 2 and all(1 <= n <= MAX_PARALLEL_CALLS for n in counts), counts


def test_a_model_that_never_stops_gets_8_calls_or_1_when_parallel_is_off():
    rag = KVBoostRAG(KVEngine(*tiny_model_and_tokenizer()))
    _never_stop(rag)
    res, text = generate_tool_call(rag, _prompt(rag), [PING], calls=MAX_PARALLEL_CALLS, max_new_tokens=600)
    assert res.finish_reason == "stop" and len(_check(text)) == MAX_PARALLEL_CALLS
    res, text = generate_tool_call(rag, _prompt(rag), [PING], calls=1, max_new_tokens=600)
    assert res.finish_reason == "stop" and len(_check(text)) == 1
    # A budget that ends inside a later block: the whole blocks before it are kept, the cut one dropped.
    res, text = generate_tool_call(rag, _prompt(rag), [PING], calls=MAX_PARALLEL_CALLS, max_new_tokens=100)
    assert res.finish_reason == "stop" and res.stats["calls_dropped"] == 1 and 1 <= len(_check(text)) < 8


# ---------------------------------------------------------------------------------------------------- LangChain
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _engine() -> KVEngine:
    model, shared = tiny_model_and_tokenizer()
    tok = copy.deepcopy(shared)  # the tiny tokenizer may be shared (cached): keep its template intact
    tok.chat_template = TOOL_TEMPLATE
    return KVEngine(model, tok)


def _script(rag, replies: list[str]) -> list[dict]:
    """Make rag.generate answer ``replies`` in turn (forced replies: the text after TOOL_CALL_START)."""
    calls: list[dict] = []

    def generate(prompt, **kw):
        calls.append({"prompt": prompt, **kw})
        return GenerationResult(text=replies[len(calls) - 1], token_ids=[5] * 3, prompt_token_ids=[1] * 10,
                                ttft_s=0.01, total_s=0.02, reuse_ratio=0.0, finish_reason="eos",
                                stats={"reuse_ratio": 0.0})

    object.__setattr__(rag, "generate", generate)
    return calls


def test_langchain_parallel_tool_calls():
    pytest.importorskip("langchain_core")
    from langchain_kvboost import ChatKVBoost

    chat = ChatKVBoost(engine=_engine(), max_tokens=64)
    forced = [_blocks(2), _blocks(3), _blocks(3), _blocks(3)]
    seen = _script(chat.rag, forced + ["text " + TOOL_CALL_START + _blocks(3)] * 2)
    for n in (2, 3):
        ai = chat.bind_tools([SET_MODE, PING], tool_choice="any", parallel_tool_calls=True).invoke("go")
        assert [c["name"] for c in ai.tool_calls] == ["ping", "set_mode", "ping"][:n] and not ai.invalid_tool_calls
        assert len({c["id"] for c in ai.tool_calls}) == n
    one = chat.bind_tools([SET_MODE, PING], tool_choice="any", parallel_tool_calls=False).invoke("go")
    assert len(one.tool_calls) == 1
    assert len(chat.invoke("go", tools=[SET_MODE, PING], tool_choice="any", parallel_tool_calls=False).tool_calls) == 1
    assert seen[-1]["prompt"].endswith(TOOL_CALL_START)
    assert len(chat.bind_tools([SET_MODE, PING]).invoke("go").tool_calls) == 3  # default: free replies all parsed
    assert len(chat.bind_tools([SET_MODE, PING], parallel_tool_calls=False).invoke("go").tool_calls) == 1
    with pytest.raises(TypeError, match="parallel_tool_calls"):
        chat.bind_tools([PING], parallel_tool_calls="yes")


def test_langchain_forced_calls_on_the_random_model_and_structured_output_asks_for_one():
    pytest.importorskip("langchain_core")
    from langchain_kvboost import ChatKVBoost
    from pydantic import BaseModel

    chat = ChatKVBoost(engine=_engine(), max_tokens=600)
    _never_stop(chat.rag)
    assert len(chat.bind_tools([PING], tool_choice="any", parallel_tool_calls=True).invoke("go").tool_calls) \
        == MAX_PARALLEL_CALLS
    for parallel in (False, None):  # None (default): one forced call, as before parallel calls existed
        bound = chat.bind_tools([PING], tool_choice="any", parallel_tool_calls=parallel)
        assert len(bound.invoke("go").tool_calls) == 1

    class Ping(BaseModel):
        pass

    binding = chat.with_structured_output(Ping, method="function_calling").first  # type: ignore[attr-defined]
    assert binding.kwargs["parallel_tool_calls"] is False  # one object: one call, as langchain-openai asks


# ---------------------------------------------------------------------------------------------------- LlamaIndex
def _li_tools():
    pytest.importorskip("llama_index.core")
    from llama_index.core.tools import FunctionTool

    def ping() -> str:
        """Ping."""
        return "pong"

    def set_mode(mode: str, loud: bool) -> str:
        """Set the mode."""
        return mode

    set_mode.__annotations__ = {"mode": str, "loud": bool, "return": str}
    ping.__annotations__ = {"return": str}
    return [FunctionTool.from_defaults(fn=ping), FunctionTool.from_defaults(fn=set_mode)]


def test_llamaindex_allow_parallel_tool_calls():
    tools = _li_tools()
    from llama_index.llms.kvboost import KVBoostLLM

    llm = KVBoostLLM(engine=_engine(), max_new_tokens=64, is_chat_model=True)
    reply = "text " + TOOL_CALL_START + _blocks(3)
    _script(llm.rag, [_blocks(3), _blocks(3), _blocks(2), reply, reply, reply])
    resp = llm.chat_with_tools(tools, user_msg="go", tool_required=True, allow_parallel_tool_calls=True)
    assert [c.tool_name for c in llm.get_tool_calls_from_response(resp)] == ["ping", "set_mode", "ping"]
    assert len(llm.get_tool_calls_from_response(resp, allow_parallel_tool_calls=False)) == 1
    # default (llama-index's): one call, the first, as its OpenAI's force_single_tool_call
    assert len(llm.get_tool_calls_from_response(llm.chat_with_tools(tools, user_msg="go", tool_required=True))) == 1
    resp = asyncio.run(llm.achat_with_tools(tools, user_msg="go", tool_required=True, allow_parallel_tool_calls=True))
    assert len(llm.get_tool_calls_from_response(resp)) == 2
    free = llm.chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls=True)
    assert len(llm.get_tool_calls_from_response(free)) == 3
    assert len(llm.get_tool_calls_from_response(llm.chat_with_tools(tools, user_msg="go"))) == 1
    with pytest.raises(TypeError, match="allow_parallel_tool_calls"):
        llm.chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls="yes")
    pieces = ["text ", TOOL_CALL_START + _blocks(3)]
    object.__setattr__(llm.rag, "stream", lambda prompt, **kw: iter(pieces))
    for allow, n in ((True, 3), (False, 1)):
        out = list(llm.stream_chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls=allow))
        assert len(llm.get_tool_calls_from_response(out[-1])) == n

        async def collect(allow=allow):
            return [r async for r in await llm.astream_chat_with_tools(tools, user_msg="go",
                                                                        allow_parallel_tool_calls=allow)]

        assert len(llm.get_tool_calls_from_response(asyncio.run(collect())[-1])) == n


def test_llamaindex_forced_calls_on_the_random_model():
    tools = _li_tools()
    from llama_index.llms.kvboost import KVBoostLLM

    llm = KVBoostLLM(engine=_engine(), max_new_tokens=600, is_chat_model=True)
    _never_stop(llm.rag)
    for allow, n in ((True, MAX_PARALLEL_CALLS), (False, 1)):
        resp = llm.chat_with_tools(tools[:1], user_msg="go", tool_required=True, allow_parallel_tool_calls=allow)
        assert len(llm.get_tool_calls_from_response(resp)) == n
        assert not resp.message.additional_kwargs["invalid_tool_calls"]
    out = list(llm.stream_chat_with_tools(tools[:1], user_msg="go", tool_required=True,
                                          allow_parallel_tool_calls=True))
    assert len(out) == 1 and len(llm.get_tool_calls_from_response(out[0])) == MAX_PARALLEL_CALLS

"""What each LangChain / LlamaIndex reply reports of its own call (issue 26): finish_reason in OpenAI's words
("stop", "length", "tool_calls"; the engine's own reason kept apart), cached prompt tokens with exact and
approximate reuse told apart, the call's documents_not_warmed, and LlamaIndex responses carrying the same
figures (streams on their last response). Tiny random model: the figures are checked against the engine's own
stats, not against fixed numbers."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_kvboost import ChatKVBoost  # noqa: E402
from langchain_kvboost import KVBoostLLM as LCLLM  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM as LILLM  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402
from kvboost_core.results import GenerationResult  # noqa: E402
from kvboost_rag.rag import KVBoostRAG, StopOnTokens, openai_finish_reason, usage_counts  # noqa: E402
from kvboost_rag.tiny import synthetic_facts, tiny_model_and_tokenizer  # noqa: E402

DOCS = synthetic_facts(4)


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def rag():
    model, tok = tiny_model_and_tokenizer()
    rag = KVBoostRAG(KVEngine(model, copy.deepcopy(tok), chunk_size=16, boundary_window=4, sink_tokens=4))
    rag.warm_documents(DOCS, show_progress=False)
    return rag


def _result(reason: str, **stats) -> GenerationResult:
    return GenerationResult(text="x", token_ids=[5] * 3, prompt_token_ids=[1] * 10, ttft_s=0.01, total_s=0.02,
                            reuse_ratio=0.0, finish_reason=reason, stats={"finish_reason": reason, **stats})


def test_finish_reason_and_usage_mapping():
    assert [openai_finish_reason(_result(r)) for r in ("eos", "stop", "length")] == ["stop", "stop", "length"]
    assert openai_finish_reason(_result("eos"), tool_calls=True) == "tool_calls"
    assert openai_finish_reason(None) is None
    u = usage_counts(_result("eos", reused_exact=3, reused_block=1, reused_approx=3, reused_repaired=2))
    assert u == {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13, "cache_read": 4,  # block is exact
                 "cache_read_approximate": 5}


def test_langchain_reply_reports_its_own_call(rag):
    chat = ChatKVBoost(engine=rag, max_tokens=4)
    # documents placed in another order than warmed: re-placed KV, some of it kept without recompute
    prompt = "Documents:\n\n" + "\n\n".join([DOCS[2], DOCS[0]]) + "\n\nWho lives where?"
    msg = chat.invoke([HumanMessage(prompt)], repair="cacheblend", recompute_ratio=0.25)
    stats = rag.last_stats
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.response_metadata["kvboost"]["engine_finish_reason"] == stats["finish_reason"]
    assert msg.response_metadata["finish_reason"] == ("length" if stats["finish_reason"] == "length" else "stop")
    details = msg.usage_metadata["input_token_details"]
    assert details["cache_read"] == stats["reused_exact"] + stats["reused_block"]
    assert details["cache_read_approximate"] == stats["reused_approx"] + stats["reused_repaired"]
    assert details["cache_read_approximate"] > 0  # approximate reuse happened, and is not in cache_read
    assert msg.response_metadata["kvboost"]["documents_not_warmed"] == 0
    # the same conversation again: an exact prefix hit, counted as cache_read
    again = chat.invoke([HumanMessage(prompt)], repair="full")
    assert again.usage_metadata["input_token_details"]["cache_read"] == rag.last_stats["reused_exact"] > 0
    assert again.usage_metadata["input_token_details"]["cache_read_approximate"] == 0
    # a document named for the call but never warmed: this reply says so
    cold = chat.invoke([HumanMessage("Who?")], kv_documents=["A document nobody warmed, about nothing at all."])
    assert cold.response_metadata["kvboost"]["documents_not_warmed"] == 1
    # streamed: the last chunk carries the same report
    chunks = list(chat.stream([HumanMessage(prompt)]))
    assert chunks[-1].response_metadata["finish_reason"] in ("stop", "length")
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] == rag.last_stats["reused_exact"]
    # the completion LLM's generation_info too
    llm = LCLLM(engine=rag, max_tokens=3)
    gen = llm.generate([prompt]).generations[0][0].generation_info
    assert gen["finish_reason"] in ("stop", "length") and gen["engine_finish_reason"] in ("eos", "stop", "length")
    assert gen["documents_not_warmed"] == 0 and "reused_exact" in gen


def test_langchain_tool_reply_finishes_with_tool_calls(rag):
    chat = ChatKVBoost(engine=KVBoostRAG(rag.engine), max_tokens=4)  # its own adapter: generate is scripted
    for text, want in (('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                        "tool_calls"), ("no call", "stop")):
        object.__setattr__(chat.rag, "generate", lambda prompt, _t=text, **kw: GenerationResult(
            text=_t, token_ids=[5], prompt_token_ids=[1] * 4, ttft_s=0.0, total_s=0.0, reuse_ratio=0.0,
            finish_reason="eos", stats={"finish_reason": "eos"}))
        msg = chat.bind_tools([get_weather]).invoke("weather?")
        assert msg.response_metadata["finish_reason"] == want
        assert msg.response_metadata["kvboost"]["engine_finish_reason"] == "eos"


def test_llamaindex_responses_carry_the_call_stats(rag):
    llm = LILLM(engine=rag, max_new_tokens=4, is_chat_model=True)
    prompt = "Documents:\n\n" + "\n\n".join([DOCS[3], DOCS[1]]) + "\n\nWho lives where?"
    resp = llm.complete(prompt)
    stats = rag.last_stats
    kw = resp.additional_kwargs
    assert kw["prompt_tokens"] == stats["prompt_tokens"] and kw["completion_tokens"] == stats["output_tokens"]
    assert kw["cached_tokens"] == stats["reused_exact"] + stats["reused_block"]
    assert kw["cached_tokens_approximate"] == stats["reused_approx"] + stats["reused_repaired"]
    assert kw["finish_reason"] in ("stop", "length") and kw["kvboost"]["engine_finish_reason"] == stats["finish_reason"]
    assert kw["kvboost"]["documents_not_warmed"] == 0 and kw["kvboost"]["reuse_ratio"] == stats["reuse_ratio"]
    # streams: the last response (an empty delta) reports the call
    out = list(llm.stream_complete(prompt))
    assert out[-1].delta == "" and out[-1].additional_kwargs["kvboost"]["reuse_ratio"] == rag.last_stats["reuse_ratio"]
    assert out[-1].text == "".join(r.delta or "" for r in out)
    chat = llm.chat([ChatMessage(role="user", content=prompt)])
    assert chat.additional_kwargs["completion_tokens"] == rag.last_stats["output_tokens"]
    assert "kvboost" not in chat.message.additional_kwargs  # the report is not sent back with the history
    streamed = list(llm.stream_chat([ChatMessage(role="user", content=prompt)]))
    assert streamed[-1].additional_kwargs["prompt_tokens"] == rag.last_stats["prompt_tokens"]
    with_tools = list(llm.stream_chat_with_tools([_li_weather()], user_msg=prompt))
    assert with_tools[-1].additional_kwargs["kvboost"]["prompt_tokens"] == rag.last_stats["prompt_tokens"]


def _li_weather():
    from llama_index.core.tools import FunctionTool

    def weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    return FunctionTool.from_defaults(fn=weather)


def test_stop_on_tokens_ends_the_generation(rag):
    base = rag.generate("Who lives in the city?", max_new_tokens=6)
    assert len(base.token_ids) >= 3
    stop = base.token_ids[1]
    res = rag.generate("Who lives in the city?", max_new_tokens=6, logits_processor=StopOnTokens([stop]))
    assert res.token_ids == base.token_ids[: base.token_ids.index(stop) + 1]  # the stop token is kept, as HF
    assert res.finish_reason == "stop"

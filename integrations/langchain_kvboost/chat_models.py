"""ChatKVBoost: a LangChain chat model over kvboost_rag.KVBoostRAG.

Messages are rendered with the model's own chat template. Multi-turn history costs about the new message:
each call's prompt is stored under prefix keys by the engine, so the next turn (the same text plus the reply
and a new message) is an exact prefix hit up to where it differs. Warmed documents inside messages are
found and reused as in KVBoostLLM.

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
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import run_in_executor
from pydantic import Field

from kvboost_core.results import GenerationResult
from kvboost_rag.toolcalls import chat_inputs
from langchain_kvboost._base import KVBoostFields, aiter_in_thread
from langchain_kvboost.llms import _info
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


def _keeper(done: dict[str, Any]) -> Any:
    def keep(result: GenerationResult, stats: dict[str, Any]) -> None:
        done["result"], done["stats"] = result, stats

    return keep


class ChatKVBoost(KVBoostFields, BaseChatModel):
    """Chat model with KV reuse of conversation history and warmed documents.

    Example:
        ```python
        chat = ChatKVBoost.from_model_id("Qwen/Qwen2.5-0.5B-Instruct", max_tokens=128)
        chat.invoke([("system", "Be brief."), ("human", "Hi")])
        chat.last_stats["reused_exact"]
        ```
    """

    streaming: bool = Field(default=False, description="Stream by default when invoked (LangChain convention).")

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
        check_parallel(parallel_tool_calls)  # a bad value too
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
        llm = self.bind(response_format=fmt, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": fmt["schema"]})
        return structured_runnable(llm, schema, include_raw)

    def _structured(self, prompt: str, opts: dict[str, Any], fmt: dict[str, Any]) -> AIMessage:
        from kvboost_rag.constrained import generate_json

        # Through the engine like a plain call (warmed documents reused, repair options honoured); stop strings
        # are not applied to JSON.
        res = generate_json(self.rag, prompt, fmt.get("schema"), **opts)
        n_in, n_out = len(res.prompt_token_ids), len(res.token_ids)
        return AIMessage(content=res.text, usage_metadata=UsageMetadata(
            input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out),
            response_metadata=self._metadata(res.stats))

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
        prompt = self.rag.chat_prompt(*chat_inputs(self.rag.tokenizer, to_chat_dicts(messages),
                                                   tools if tool_choice != "none" else None))
        opts = self._call_options(stop, kwargs)
        opts["add_special_tokens"] = self.rag.chat_add_special_tokens(prompt)
        return prompt, opts, plan

    def _tool_reply(self, prompt: str, opts: dict[str, Any], plan: ToolPlan) -> tuple[GenerationResult, str]:
        """The reply to a prompt with tools: constrained to a valid call when one is forced, else free."""
        if plan.forced:
            from kvboost_rag.constrained import generate_tool_call

            return generate_tool_call(self.rag, prompt, plan.tools, plan.name, calls=plan.calls, **opts)
        result = self.rag.generate(prompt, **opts)
        return result, result.text

    def _message(self, text: str, plan: ToolPlan | None, result: GenerationResult | None,
                 stats: dict[str, Any]) -> AIMessage:
        if plan is None:
            return AIMessage(content=text, usage_metadata=self._usage(result), response_metadata=self._metadata(stats))
        content, calls, invalid = parse_tool_calls(text, plan.keep_all)
        return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid,
                         usage_metadata=self._usage(result), response_metadata=self._metadata(stats))

    @staticmethod
    def _usage(result: GenerationResult | None) -> UsageMetadata:
        n_in = len(result.prompt_token_ids) if result else 0
        n_out = len(result.token_ids) if result else 0
        return UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out)

    def _metadata(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {"model_name": self.model_name, "finish_reason": stats.get("finish_reason"),
                "kvboost": _info(stats)}

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
        message = self._message(text, plan, result, result.stats)
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": self.model_name})

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await run_in_executor(None, self._generate, messages, stop,
                                     run_manager.get_sync() if run_manager else None, **kwargs)

    def _tool_chunk(self, reply: tuple[GenerationResult, str], plan: ToolPlan) -> ChatGenerationChunk:
        result, text = reply
        msg = self._message(text, plan, result, result.stats)
        chunks = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i,
                   "type": "tool_call_chunk"} for i, c in enumerate(msg.tool_calls)]
        return ChatGenerationChunk(message=AIMessageChunk(
            content=msg.content, tool_call_chunks=chunks, usage_metadata=msg.usage_metadata,
            response_metadata=msg.response_metadata, chunk_position="last"))

    def _final_chunk(self, done: dict[str, Any]) -> ChatGenerationChunk:
        # Usage and model name go on the last chunk only, so aggregating chunks does not double count them.
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=self._usage(done.get("result")),
            response_metadata=self._metadata(done.get("stats", {})), chunk_position="last"))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        prompt, opts, plan = self._prepare(messages, stop, kwargs)
        if kwargs.get("response_format"):  # constrained JSON: one chunk
            msg = self._structured(prompt, opts, kwargs["response_format"])
            yield ChatGenerationChunk(message=AIMessageChunk(content=msg.content, usage_metadata=msg.usage_metadata,
                                                             response_metadata=msg.response_metadata,
                                                             chunk_position="last"))
            return
        if plan is not None:  # tool calls are parsed from the whole reply: one chunk
            yield self._tool_chunk(self._tool_reply(prompt, opts, plan), plan)
            return
        done: dict[str, Any] = {}
        for piece in self.rag.stream(prompt, on_result=_keeper(done), **opts):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._final_chunk(done)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        prompt, opts, plan = self._prepare(messages, stop, kwargs)
        if kwargs.get("response_format"):
            msg = await run_in_executor(None, self._structured, prompt, opts, kwargs["response_format"])
            yield ChatGenerationChunk(message=AIMessageChunk(content=msg.content, usage_metadata=msg.usage_metadata,
                                                             response_metadata=msg.response_metadata,
                                                             chunk_position="last"))
            return
        if plan is not None:
            yield self._tool_chunk(await run_in_executor(None, self._tool_reply, prompt, opts, plan), plan)
            return
        done: dict[str, Any] = {}
        async for piece in aiter_in_thread(lambda: self.rag.stream(prompt, on_result=_keeper(done), **opts)):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._final_chunk(done)

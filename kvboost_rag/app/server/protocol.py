"""OpenAI wire format: request models (validated), response bodies and the error shape.

Requests are pydantic models that ignore fields they do not know (clients send many optional ones) but reject,
naming the parameter, the known ones this server cannot honour (``n > 1``, ``logprobs``, tools, penalties).
Responses are plain dicts: they are built once per chunk on the hot path.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from kvboost_core import CacheCounts


class APIError(Exception):
    """An error the client gets as OpenAI's ``{"error": {...}}`` JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Parameters shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    n: int | None = None
    user: str | None = None
    # vLLM's extension (sent through the client's extra_body): keep decoding past EOS; for fixed-length
    # benchmarks and tests.
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if not all(stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.n not in (None, 1):
            raise ValueError("n: only n=1 is supported (one choice per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: penalties are not supported; omit it or send 0")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Only text parts: an image_url (or any other) part is the client's 400, not a 500 later."""
        for part in v if isinstance(v, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got a {part.get('type')!r} part")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self) -> ChatRequest:
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        if self.tools:
            raise ValueError("tools: tool calling is not supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_dicts(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("only one prompt per request is supported (send a string)")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self) -> CompletionRequest:
        for name in ("echo", "suffix", "logprobs"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only best_of=1 is supported")
        return self

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[str] = Field(min_length=1)


# ---------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, counts: CacheCounts) -> dict[str, Any]:
    """OpenAI's ``usage``. ``prompt_tokens_details.cached_tokens`` is exact reuse only (a prompt-prefix hit, or a
    block adapter's own prefill: a reply with them equals one without); ``cached_tokens_approximate`` (an
    extension field) is re-placed or repaired KV kept without recompute, never counted as cached. Both as
    :class:`kvboost_core.CacheCounts` defines them, the same counts ``ChatKVBoost`` and ``KVBoostLLM`` report."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": counts.cached,
                                      "cached_tokens_approximate": counts.approximate}}


def finish_reason(engine_reason: str) -> str:
    # the engine says "eos" or "stop" (a stop string) or "length"; OpenAI says "stop" for the first two
    return "length" if engine_reason == "length" else "stop"


def chat_body(rid: str, model: str, created: int, text: str, reason: str, use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason(reason)}], "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], reason: str | None,
               use: dict[str, Any] | None = None, *, choices: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason(reason) if reason else None}]
                            if choices else []}
    if use is not None:
        body["usage"] = use
    return body


def completion_body(rid: str, model: str, created: int, text: str, reason: str | None,
                    use: dict[str, Any] | None, *, chunk: bool = False, choices: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason(reason) if reason else None}]
                            if choices else []}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def now() -> int:
    return int(time.time())

"""FastAPI routes of the OpenAI-compatible server. Generation itself runs on the scheduler's engine thread;
handlers only validate, submit, and relay events (as SSE when ``stream`` is set).

A handler waits for the request's first event before it answers, so errors found at admission (prompt over
the context, engine failure) and a timeout while queued get a proper status and OpenAI's error JSON rather
than a 200 stream that breaks. Once streaming, a failure is sent as an ``error`` chunk (the OpenAI client raises
it) and a client disconnect cancels the request, which frees its batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvboost_core import SamplingParams
from kvboost_rag.app.server import catalogue
from kvboost_rag.app.server import protocol as P
from kvboost_rag.app.server.protocol import APIError
from kvboost_rag.app.server.scheduler import Finished, GenRequest, QueueFull, Started
from kvboost_rag.app.server.state import ServerState

log = logging.getLogger("kvboost_rag.app.server")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvboost-rag", docs_url=None, redoc_url=None)
    app.state.kv = state
    _install_errors(app, state)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.model_name, "running": state.scheduler.running,
                "queued": state.scheduler.queue_depth, "deterministic": state.scheduler.decoder.deterministic,
                "backfill": state.scheduler.backfills.totals.as_dict()}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if state.keyring.enabled:  # tenants: a key is needed, and a caller sees its own namespace only
            ns = state.namespace_of(request.headers.get("authorization"))
            body = state.metrics.render(state.scheduler, lambda: {k: v for k, v in state.store_stats().items()
                                                                  if k == ns})
        else:
            body = state.metrics.render(state.scheduler, state.store_stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvboost-rag"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.namespace_of(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:  # client.models.retrieve
        state.namespace_of(request.headers.get("authorization"))
        if model_id not in state.model_aliases:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found", type="not_found_error")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatRequest, request: Request) -> Response:
        rag = _rag(state, body.model, request)
        req = _request(state, rag, body, body.token_limit, fill_context=True, ignore_eos=body.ignore_eos)
        try:
            req.messages = body.chat_dicts()
        except ValueError as exc:  # e.g. a content part this server cannot read: the client's error
            raise APIError(400, str(exc), param="messages") from None
        await catalogue.sync(state, rag)
        return await _respond(state, req, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        rag = _rag(state, body.model, request)
        limit = body.token_limit if body.token_limit is not None else 16  # OpenAI's default for completions
        req = _request(state, rag, body, limit, fill_context=False, ignore_eos=body.ignore_eos)
        req.prompt = body.text
        await catalogue.sync(state, rag)
        return await _respond(state, req, body, request, chat=False)

    @app.post("/v1/documents")
    async def documents(body: P.DocumentsRequest, request: Request) -> dict[str, Any]:
        ns = state.namespace_of(request.headers.get("authorization"))
        _check_documents(state, body.documents)
        rag = state.rag(ns)
        # warmed piece by piece between decode steps (server.warmjob): running streams keep flowing
        rep = await asyncio.wrap_future(state.scheduler.warm(rag, body.documents).future)
        await catalogue.publish(state, rag, body.documents)
        state.metrics.requests.labels("/v1/documents", "200").inc()
        return {"object": "documents.warm", "namespace": ns, "documents": rep.documents, "warmed": rep.warmed,
                "already_warm": rep.already_warm, "tokens": rep.tokens, "bytes": rep.bytes,
                "seconds": round(rep.seconds, 4)}

    @app.get("/v1/documents/stats")
    async def document_stats(request: Request) -> dict[str, Any]:
        ns = state.namespace_of(request.headers.get("authorization"))
        rag = state.rag(ns)
        s = rag.engine.stats()
        return {"object": "documents.stats", "namespace": ns, "documents": len(rag.registry),
                "entries": s["entries"], "tokens": s["tokens"], "bytes": s["bytes"], "evictions": s["evictions"],
                "hits_exact": s["hits_exact"], "hits_content": s["hits_content"], "misses": s["misses"],
                "prefills": s["prefills"], "warmed_tokens": s["warmed_tokens"],
                **({"replica": state.replica} if state.replica is not None else {})}

    @app.on_event("shutdown")
    async def _shutdown() -> None:
        state.scheduler.shutdown()

    return app


# ---------------------------------------------------------------------------------------------- helpers
def _check_documents(state: ServerState, documents: list[str]) -> None:
    """The request limits of ``/v1/documents`` (--max-documents, --max-document-bytes): 413 over them."""
    if len(documents) > state.max_documents:
        raise APIError(413, f"documents: {len(documents)} documents in one request; at most {state.max_documents} "
                            "(--max-documents); send them in several requests", param="documents",
                       code="too_many_documents")
    size = sum(len(d.encode("utf-8", "surrogatepass")) for d in documents)
    if size > state.max_document_bytes:
        raise APIError(413, f"documents: {size} bytes of text in one request; at most {state.max_document_bytes} "
                            "(--max-document-bytes); send them in several requests", param="documents",
                       code="request_too_large")


def _rag(state: ServerState, model: str, request: Request) -> Any:
    ns = state.namespace_of(request.headers.get("authorization"))
    if model not in state.model_aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return state.rag(ns)


def _request(state: ServerState, rag: Any, body: P._Sampling, limit: int | None, *, fill_context: bool,
             ignore_eos: bool) -> GenRequest:
    temperature = state.default_temperature if body.temperature is None else body.temperature
    try:
        params = SamplingParams.create(limit or 1, temperature, 1.0 if body.top_p is None else body.top_p,
                                       body.stop, body.seed)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc)) from None
    req = GenRequest(rag=rag, params=params, emit=_noop, ignore_eos=ignore_eos)
    req.fill_context = fill_context and limit is None
    return req


def _noop(kind: str, payload: Any) -> None:
    pass


async def _next(state: ServerState, q: asyncio.Queue, req: GenRequest, deadline: float,
                request: Request | None) -> tuple[str, Any]:
    loop = asyncio.get_running_loop()
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            state.scheduler.cancel(req)
            raise APIError(504, f"the request did not finish within {state.request_timeout:g} s",
                           type="timeout_error", code="timeout")
        try:
            return await asyncio.wait_for(q.get(), timeout=min(remaining, 0.25))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                state.scheduler.cancel(req)
                raise APIError(499, "the client closed the request", code="client_closed") from None


async def _respond(state: ServerState, req: GenRequest, body: P._Sampling, request: Request, *,
                   chat: bool) -> Response:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def emit(kind: str, payload: Any) -> None:  # called on the engine thread
        loop.call_soon_threadsafe(q.put_nowait, (kind, payload))

    req.emit = emit
    try:
        state.scheduler.submit(req)
    except QueueFull:
        raise APIError(429, "the server is at capacity (request queue full); retry shortly",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    deadline = loop.time() + state.request_timeout
    kind, first = await _next(state, q, req, deadline, request)
    if kind == "error":
        raise first
    assert isinstance(first, Started)
    rid, created, endpoint = P.new_id("chatcmpl" if chat else "cmpl"), P.now(), request.url.path
    if body.stream:
        gen = _sse(state, q, req, first, deadline, rid, created, chat, body.include_usage, endpoint)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    parts: list[str] = []
    while True:
        kind, payload = await _next(state, q, req, deadline, request)
        if kind == "text":
            parts.append(payload)
        elif kind == "error":
            raise payload
        elif kind == "done":
            break
    use = P.usage(first.prompt_tokens, payload.completion_tokens, first.counts)
    text = "".join(parts)
    out = (P.chat_body(rid, state.model_name, created, text, payload.reason, use) if chat else
           P.completion_body(rid, state.model_name, created, text, payload.reason, use))
    state.metrics.requests.labels(endpoint, "200").inc()
    return JSONResponse(out)


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(state: ServerState, q: asyncio.Queue, req: GenRequest, first: Started, deadline: float, rid: str,
               created: int, chat: bool, include_usage: bool, endpoint: str) -> AsyncIterator[str]:
    model = state.model_name
    status = "499"  # until the stream is sent to its end: a client that goes away is not a 200
    ended = None  # the status the stream ends with once [DONE] is out: 200, or the error it carried
    try:
        if chat:
            yield _sse_line(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
        while True:
            try:
                kind, payload = await _next(state, q, req, deadline, None)
            except APIError as exc:  # timed out mid-stream
                ended = str(exc.status)
                yield _sse_line(exc.body())
                break
            if kind == "text":
                yield _sse_line(P.chat_chunk(rid, model, created, {"content": payload}, None) if chat else
                                P.completion_body(rid, model, created, payload, None, None, chunk=True))
            elif kind == "error":
                ended = str(payload.status)
                yield _sse_line(payload.body())
                break
            elif kind == "done":
                assert isinstance(payload, Finished)
                ended = "200"
                yield _sse_line(P.chat_chunk(rid, model, created, {}, payload.reason) if chat else
                                P.completion_body(rid, model, created, "", payload.reason, None, chunk=True))
                if include_usage:
                    use = P.usage(first.prompt_tokens, payload.completion_tokens, first.counts)
                    yield _sse_line(P.chat_chunk(rid, model, created, {}, None, use, choices=False) if chat else
                                    P.completion_body(rid, model, created, "", None, use, chunk=True,
                                                      choices=False))
                break
        yield "data: [DONE]\n\n"
        status = ended or status
    finally:
        # a client that went away cancels the generator here: free the slot at the next decode step
        state.scheduler.cancel(req)
        state.metrics.requests.labels(endpoint, status).inc()


def _install_errors(app: FastAPI, state: ServerState) -> None:
    def reply(request: Request, err: APIError) -> JSONResponse:
        state.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return reply(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return reply(request, APIError(400, "the request body is not valid JSON"))
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        param = ".".join(loc) or None
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return reply(request, APIError(400, f"{param}: {msg}" if param and not msg.startswith(param) else msg,
                                       param=param or _param_in(msg)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s on %s", type(exc).__name__, request.url.path)  # no traceback, no body
        return reply(request, APIError(500, "internal server error", type="server_error"))


def _param_in(msg: str) -> str | None:
    head = msg.split(":", 1)[0]
    return head if head.isidentifier() else None

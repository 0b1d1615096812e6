"""The FastAPI application: routes, OpenAI-style errors, allowed Host names, optional API key, response counting,
engine lifespan."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.engine_loop import EngineLoop, shutting_down
from blockspec.server.hosts import LOOPBACK_HOSTS, HostCheck
from blockspec.server.metrics import CONTENT_TYPE, Metrics
from blockspec.server.prepare import ModelLimits, Prepared, prepare_chat, prepare_completion
from blockspec.server.protocol import (DEFAULT_MAX_REQUEST_BYTES, APIError, ChatCompletionRequest, CompletionRequest,
                                       SamplingRequest, parse_body, read_body)
from blockspec.server.runner import ServingState, run_request


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _Guard:
    """Outermost ASGI layer: checks the Host header (400 for a name not allowed) and the API key (401 for anything
    without it), and counts every response."""

    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None, hosts: HostCheck) -> None:
        self.app, self.metrics, self.api_key, self.hosts = app, metrics, api_key, hosts
        self.state: ServingState | None = None

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = dict(scope.get("headers") or []).get(b"authorization", b"").partition(b" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(path, message["status"])
            await send(message)

        refusal = self.hosts.refusal(scope.get("headers") or [])
        if refusal is not None:  # before the key: a rebinding page learns nothing, not even that a key is needed
            err = APIError(400, refusal, code="host_not_allowed")
            return await _error_response(err)(scope, receive, counting_send)
        if not self._authorized(scope):
            err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            response = _error_response(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)


def build_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_hosts: frozenset[str] = LOOPBACK_HOSTS) -> ASGIApp:
    """An ASGI app serving `engine` under `model_name`; the engine thread runs for the app's lifespan. Request bodies
    over `max_request_bytes` get 413; a Host header whose name is not in `allowed_hosts` ("*": any) gets 400. Its
    `.state` is the ServingState (engine loop, limits, metrics)."""
    fixed = engine.limits()
    limits = ModelLimits(model_name, fixed.tokenizer, fixed.vocab_size, fixed.max_model_len, fixed.kv_capacity,
                         fixed.max_draft_tokens + 1)
    metrics = Metrics(fixed.max_draft_tokens, fixed.num_kv_blocks)
    state = ServingState(EngineLoop(engine, metrics), limits, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine_loop.start(asyncio.get_running_loop())
        yield
        state.engine_loop.join()

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(err.status_code, str(err.detail), type_=kind))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:  # Starlette re-raises it for uvicorn to log
        metrics.count_error("request")
        return _error_response(APIError(500, "internal error; the server log has the traceback",
                                        type_="internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine_loop.closing:  # 503: load balancers stop sending requests here
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "blockspec", "max_model_len": limits.servable_len}]}

    async def prepared(request: Request, body: type[SamplingRequest],
                       prepare: Callable[[Any, ModelLimits], Prepared]) -> Prepared:
        if state.engine_loop.closing:  # before any work on the request
            raise shutting_down()
        raw = await read_body(request, max_request_bytes)
        # parsing and tokenizing a large prompt takes seconds: off the event loop, which serves everyone else
        return await asyncio.to_thread(lambda: prepare(parse_body(raw, body), limits))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run_request(state, await prepared(request, CompletionRequest, prepare_completion), request,
                                 chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run_request(state, await prepared(request, ChatCompletionRequest, prepare_chat), request,
                                 chat=True)

    # outermost, so that Host and key are checked before anything else and every response is counted, 500s included
    guard = _Guard(app, metrics, api_key, HostCheck(allowed_hosts))
    guard.state = state
    return guard

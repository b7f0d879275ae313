"""The FastAPI app: routes, OpenAI-shaped errors, readiness and metrics.

The app exists (and answers /health) before the engine does: launch.py boots in a background thread and calls
ServerState.set_ready on the event loop when it is done. Until then /ready, /startup and every /v1 route answer
503. Every error, including ones FastAPI or Starlette raise themselves (404, 405), has the OpenAI error shape."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from warmstart.server import chat, completions, responses, tokenize
from warmstart.server.auth import RequireKey
from warmstart.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from warmstart.server.options import ServerOptions
from warmstart.server.metrics import ROUTES, Metrics
from warmstart.server.protocol import APIError, not_ready
from warmstart.server.serving import ServingContext

log = logging.getLogger("warmstart.server")


class ServerState:
    """What the routes read: the served name and metrics always; the serving context once boot has finished."""

    def __init__(self, model_name: str, metrics: Metrics | None = None, options: ServerOptions | None = None):
        self.model_name = model_name
        self.options = options or ServerOptions()
        self.metrics = metrics or Metrics(model_name)
        self.serving: ServingContext | None = None
        self.created = 0

    def set_ready(self, serving: ServingContext) -> None:
        """Call on the event loop thread."""
        report = serving.booted.report
        self.metrics.record_boot(report, serving.booted.ledger.num_kv_blocks)
        self.created = int(time.time())
        self.serving = serving

    def require(self) -> ServingContext:
        if self.serving is None:
            raise not_ready()
        return self.serving


def create_app(state: ServerState, on_startup: Callable[[asyncio.AbstractEventLoop], None] | None = None,
               on_shutdown: Callable[[], None] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """on_startup runs when the server starts (before it listens) with the running loop; it must not block.
    on_shutdown runs after the last request has finished or been cancelled. Bodies over max_request_bytes are
    answered 413 before they are parsed."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_startup is not None:
            on_startup(asyncio.get_running_loop())
        try:
            yield
        finally:
            if on_shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    app = FastAPI(title="warmstart", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state
    # Starlette runs the last-added middleware first: count every request, then CORS, then the key check.
    if state.options.api_key:
        app.add_middleware(RequireKey, key=state.options.api_key, open_routes=state.options.open_routes)
    if state.options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.options.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    # Added last, so it runs first: an oversized body is refused before anything reads it.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(_CountRequests, metrics=state.metrics)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict:
        state.require()
        return {"status": "ready", "model": state.model_name}

    @app.get("/startup")
    async def startup() -> dict:
        serving = state.require()
        d = serving.booted.report.to_dict()
        # speculative decoding: the boot's settings plus the counters so far
        d["speculative"] = {**d.get("speculative", {}), **serving.booted.engine.spec_stats.to_dict()}
        return d

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(state.require(), state.created)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        serving = state.require()
        serving.check_model(model_id)
        return _model_card(serving, state.created)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create_chat_completion(state.require(), request)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create_completion(state.require(), request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create_response(state.require(), request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return tokenize.tokenize(state.require(), await request.body())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return tokenize.detokenize(state.require(), await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        return tokenize.tokenizer_info(state.require())

    @app.get("/version")
    async def version_route() -> dict:
        return tokenize.version()

    return app


def _model_card(serving: ServingContext, created: int) -> dict:
    return {"id": serving.model_name, "object": "model", "created": created, "owned_by": "warmstart",
            "root": str(serving.booted.model_dir), "max_model_len": serving.max_model_len}


def _error(status: int, message: str, type: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"Invalid request: {e.errors()[0].get('msg', e)}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, f"Internal server error: {type(e).__name__}: {e}", "server_error")


class _CountRequests:
    """Pure ASGI middleware (streaming-safe): counts every HTTP request by route and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            self.metrics.http_requests.labels(route=route, status=str(status)).inc()

"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`. This module wires the
app (state, lifespan, error handlers); the routes are in `routes`, the checks they share in `context`,
and the response bodies in `responses` and `formats`.

Routes: GET / (the chat page, `page`; not with web_page=False), GET /health, GET /metrics
(Prometheus text), GET /openapi.json and /docs, and, behind
the API key when one is set, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (both streamed as server-sent events with `"stream": true`), and
Anthropic's POST /v1/messages and /v1/messages/count_tokens (`anthropic`, errors in Anthropic's
shape), and OpenAI's Responses API, /v1/responses (`openai_responses`). Errors use
OpenAI's shape {"error": {message, type, param, code}}; whatever a client sends, a bad request is
a 4xx, never a 500, and its keep-alive connection serves on.

kvfold extension: `"return_token_ids": true` in a request adds `token_ids` (the generated ids)
to each choice, and to each streamed chunk's choice (the ids new in that chunk).
"""
from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import AsyncEngine, Engine
from ..chat.template import ChatTemplate
from .anthropic import add_anthropic_api
from .openai_responses import DEFAULT_STORE_BYTES, add_responses_api
from .context import ServerContext, server_context
from .openapi import build_openapi
from .page import add_chat_page
from .routes import router
from .schemas import ApiError

MAX_BODY_BYTES = 1 << 20  # 1 MiB


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               chat_template: ChatTemplate | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               web_page: bool = True, responses_store_bytes: int = DEFAULT_STORE_BYTES) -> FastAPI:
    """An app serving `engine` as `model_name`. Its step loop runs on a background thread
    started and stopped with the app (uvicorn's lifespan); `app.state.engine` is the AsyncEngine.
    `web_page`: serve the chat page at / (`kvfold serve --no-web-page` turns it off).
    `responses_store_bytes`: budget of the stored /v1/responses (`--responses-store-mib`)."""
    async_engine = AsyncEngine(engine)
    tokenizer = engine.tokenizer
    template = chat_template or (ChatTemplate(tokenizer) if tokenizer is not None else None)
    app = FastAPI(title="kvfold", description="OpenAI-compatible API over kvfold's engine", lifespan=_lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.engine = async_engine
    app.state.server = ServerContext(engine=engine, async_engine=async_engine, model_name=model_name,
                                     api_key=api_key, tokenizer=tokenizer, template=template,
                                     max_body_bytes=max_body_bytes, created=int(time.time()))
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    add_anthropic_api(app)  # POST /v1/messages and /v1/messages/count_tokens
    add_responses_api(app, responses_store_bytes)  # /v1/responses (openai_responses)
    if web_page:
        add_chat_page(app)
    app.openapi = lambda: build_openapi(app, app.state.server)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Run the engine's step loop while the app serves."""
    async_engine: AsyncEngine = app.state.engine
    async_engine.start()
    try:
        yield
    finally:
        async_engine.shutdown()
        async_engine.engine.flush_prefix_cache()  # with --cache-dir: every entry outlives the process


# ---- errors: every one in OpenAI's shape, and counted by status for /metrics ---------------------

def _error_response(request: Request, err: ApiError, headers=None) -> Response:
    server_context(request).http_errors[err.status] += 1
    # ASCII JSON: a lone surrogate echoed in a message must not fail the encoding of the error itself
    return Response(json.dumps(err.body(), ensure_ascii=True), status_code=err.status, headers=headers,
                    media_type="application/json")


async def _api_error(request: Request, exc: ApiError) -> Response:
    return _error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's own errors (an unknown route, a wrong method: its Allow header kept)."""
    err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return _error_response(request, err, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's check of path and query parameters (the routes parse their bodies themselves)."""
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return _error_response(request, ApiError(400, f"{param}: {first.get('msg', 'invalid')}", param=param))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _error_response(request, ApiError(500, f"internal error: {exc!r}", type="server_error"))

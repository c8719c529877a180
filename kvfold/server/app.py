"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`. This module wires the
app (state, lifespan, error handlers); the routes are in `routes`, the checks they share in `context`,
and the response bodies in `responses` and `formats`.

Routes: GET /health, GET /metrics (Prometheus text), and, behind the API key when one is set,
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both streamed as server-sent
events with `"stream": true`). Errors use OpenAI's shape {"error": {message, type, param, code}}.

kvfold extension: `"return_token_ids": true` in a request adds `token_ids` (the generated ids)
to each choice, and to each streamed chunk's choice (the ids new in that chunk).
"""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import AsyncEngine, Engine
from .chat_template import ChatTemplate
from .context import ServerContext, server_context
from .routes import router
from .schemas import ApiError

MAX_BODY_BYTES = 1 << 20  # 1 MiB


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               chat_template: ChatTemplate | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An app serving `engine` as `model_name`. Its step loop runs on a background thread
    started and stopped with the app (uvicorn's lifespan); `app.state.engine` is the AsyncEngine."""
    async_engine = AsyncEngine(engine)
    tokenizer = engine.tokenizer
    template = chat_template or (ChatTemplate(tokenizer) if tokenizer is not None else None)
    app = FastAPI(title="kvfold", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = async_engine
    app.state.server = ServerContext(engine=engine, async_engine=async_engine, model_name=model_name,
                                     api_key=api_key, tokenizer=tokenizer, template=template,
                                     max_body_bytes=max_body_bytes, created=int(time.time()))
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
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


# ---- errors: every one in OpenAI's shape, and counted by status for /metrics ---------------------

async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    server_context(request).http_errors[exc.status] += 1
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method)."""
    server_context(request).http_errors[exc.status_code] += 1
    err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    server_context(request).http_errors[500] += 1
    return JSONResponse(ApiError(500, f"internal error: {exc!r}", type="server_error").body(), status_code=500)

"""Anthropic's Messages API over the same engine path as /v1/chat/completions: POST /v1/messages
and POST /v1/messages/count_tokens, so that Anthropic clients (the anthropic SDKs, Claude Code
with ANTHROPIC_BASE_URL) talk to kvfold. The request is translated into a chat request
(`anthropic_translate`), runs exactly as chat completions run it (`routes.chat_sampling`,
`routes.chat_parser`), and its output comes back as Anthropic content blocks (`anthropic_format`).

- The API key (when the server has one) comes as `x-api-key` or as a bearer token.
  `anthropic-version` and `anthropic-beta` headers and a `?beta=true` query are accepted and change
  nothing.
- Errors have Anthropic's shape `{"type": "error", "error": {"type", "message"}}`: 400
  invalid_request_error, 401 authentication_error, 404 not_found_error (an unknown model), 413
  request_too_large, 529 overloaded_error (the queue is full), 500 api_error; a client's input is
  never a 5xx.
- `max_tokens` over what the context leaves after the prompt (Claude Code asks for 32000) is
  cut to what fits, and the reply then ends with stop_reason "max_tokens" there; a prompt that
  leaves no room at all is a 400 naming `messages`.
Both routes are in /openapi.json (`openapi.anthropic_generation`, `openapi.anthropic_count_tokens`),
with their request models and their errors in Anthropic's shape.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import openapi as doc
from .anthropic_format import MessageFormat, ThinkingSigner
from .anthropic_schemas import CountTokensRequest, MessagesRequest, check_block_types
from .anthropic_translate import render
from .context import ServerContext, server_context
from .responses import collect
from .routes import chat_parser, chat_sampling
from .schemas import ApiError, parse

OVERLOADED = 529  # Anthropic's status for "overloaded": its SDKs retry it
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", OVERLOADED: "overloaded_error"}

router = APIRouter()


def add_anthropic_api(app: FastAPI) -> None:
    """Serve the Messages API on `app`, signing thinking blocks with this server's key."""
    app.state.thinking_signer = ThinkingSigner.for_server()
    app.include_router(router)


@router.post("/v1/messages", **doc.anthropic_generation())
async def messages(request: Request) -> Response:
    return await _answer(request, _messages)


@router.post("/v1/messages/count_tokens", **doc.anthropic_count_tokens())
async def count_tokens(request: Request) -> Response:
    return await _answer(request, _count_tokens)


async def _messages(request: Request, ctx: ServerContext) -> Response:
    req = await _request(request, ctx, MessagesRequest)
    signer = request.app.state.thinking_signer
    prompt = render(ctx, req, signer)
    room = ctx.engine.max_seq_len - len(prompt.ids)
    if room < 1:
        raise ApiError(400, f"messages: the prompt is {len(prompt.ids)} tokens; this server's context holds "
                       f"{ctx.engine.max_seq_len} (prompt and reply together): shorten the conversation",
                       param="messages")
    # what Claude Code asks for (max_tokens 32000) may pass the context: generate what fits instead
    max_tokens = min(req.max_tokens, room)
    params = chat_sampling(ctx, prompt.chat, prompt.reasoning, max_tokens)
    streams = await ctx.start(prompt.ids, params, length_param="messages")
    fmt = MessageFormat(ctx.model_name, chat_parser(ctx, prompt.chat, prompt.reasoning), signer, ctx.tokenizer,
                        list(req.stop_sequences or ()), len(prompt.ids))
    if req.stream:
        return StreamingResponse(fmt.events(streams[0]), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    (outs,) = await collect(request, streams)
    if outs[-1].finish_reason == "error":
        raise ApiError(500, outs[-1].error or "generation failed", type="server_error")
    return JSONResponse(fmt.whole(outs))


async def _count_tokens(request: Request, ctx: ServerContext) -> Response:
    req = await _request(request, ctx, CountTokensRequest)
    prompt = render(ctx, req, request.app.state.thinking_signer)
    return JSONResponse({"input_tokens": len(prompt.ids)})


async def _request(request: Request, ctx: ServerContext, model: type) -> Any:
    """The checked request: the key, the body (JSON, within the limit), its blocks, its model."""
    check_key(ctx, request)
    body = await ctx.read_json(request)
    check_block_types(body)
    req = parse(model, body)
    ctx.check_model(req.model)
    return req


def check_key(ctx: ServerContext, request: Request) -> None:
    """401 unless the request carries the API key (when one is set): as `x-api-key`, which the
    anthropic SDKs send, or as a bearer token (theirs with an auth token, and OpenAI's)."""
    if ctx.api_key is None:
        return
    key = request.headers.get("x-api-key")
    if key is None:
        try:
            return ctx.check_auth(request)
        except ApiError as exc:
            if exc.message.startswith("missing"):
                raise ApiError(401, "missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'",
                               code="invalid_api_key") from None
            raise
    # constant-time comparison: the response time must not reveal how much of the key matched
    if not hmac.compare_digest(key.strip().encode(), ctx.api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


async def _answer(request: Request, handler: Callable[[Request, ServerContext], Awaitable[Response]]) -> Response:
    """The handler's response, or its error in Anthropic's shape (the app's handlers write OpenAI's)."""
    ctx = server_context(request)
    try:
        return await handler(request, ctx)
    except ApiError as exc:
        return error_response(ctx, exc)
    except Exception as exc:  # a bug, not the client's input: still an Anthropic-shaped 500
        return error_response(ctx, ApiError(500, f"internal error: {exc!r}", type="server_error"))


def error_response(ctx: ServerContext, err: ApiError) -> Response:
    status = OVERLOADED if err.status == 503 else err.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    ctx.http_errors[status] += 1
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    # ASCII JSON: a lone surrogate echoed in a message must not fail the encoding of the error itself
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, media_type="application/json")

"""The server's routes, on one `APIRouter` that `create_app` includes.

GET /health and GET /metrics are open; GET /v1/models, POST /v1/completions and
POST /v1/chat/completions need the API key when one is set. Each route reads what it shares with
the others (engine, served name, key) from the app's `ServerContext`.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import InvalidInputError
from . import metrics as prom
from .context import ServerContext, sampling, server_context
from .formats import ChatFormat, CompletionFormat
from .responses import respond
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest, parse

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    alive = server_context(request).async_engine.running
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = server_context(request)
    return PlainTextResponse(prom.render(ctx.async_engine.metrics(), ctx.http_errors), media_type=prom.CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    return JSONResponse({"object": "list", "data": [
        {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "kvfold",
         "max_model_len": ctx.engine.max_seq_len}]})


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    data = await ctx.read_json(request)
    req = parse(CompletionRequest, data)
    req.refuse_unsupported()
    ctx.check_model(req.model)
    ids = _prompt_ids(ctx, req.single_prompt())
    stream = await ctx.start(ids, sampling(req, req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS))
    return await respond(request, stream, req, CompletionFormat(ctx.model_name, bool(data.get("return_token_ids"))))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    data = await ctx.read_json(request)
    req = parse(ChatCompletionRequest, data)
    req.refuse_unsupported()
    ctx.check_model(req.model)
    ids = _chat_ids(ctx, req)
    # no max_tokens: whatever room the context leaves (at least 1, so a full context is a 400)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, ctx.engine.max_seq_len - len(ids))
    stream = await ctx.start(ids, sampling(req, max_tokens))
    return await respond(request, stream, req, ChatFormat(ctx.model_name, bool(data.get("return_token_ids"))))


def _prompt_ids(ctx: ServerContext, prompt: str | list[int]) -> list[int]:
    """A completion prompt as token ids: text is encoded after BOS (when the tokenizer has one),
    ids pass as they are."""
    if not isinstance(prompt, str):
        return list(prompt)
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
    try:
        ids = tokenizer.encode(prompt)
    except InvalidInputError as e:
        raise ApiError(400, str(e), param="prompt") from None
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def _chat_ids(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    """The chat messages rendered by the model's chat template; a template that refuses them is a 400."""
    if ctx.template is None:
        raise ApiError(400, "this model has no tokenizer, so no chat template", param="messages")
    try:
        return ctx.template.render([{"role": m.role, "content": m.text()} for m in req.messages])
    except ApiError:
        raise
    except Exception as exc:  # the checkpoint's template refused these messages
        raise ApiError(400, f"chat template: {exc}", param="messages") from None

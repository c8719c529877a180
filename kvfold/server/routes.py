"""The server's routes, on one `APIRouter` that `create_app` includes.

GET /health and GET /metrics are open; GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions, and vLLM's POST /tokenize and POST /detokenize need the API key when
one is set. Each route reads what it shares
with the others (engine, served name, key) from the app's `ServerContext`. The decorators'
`responses` and `openapi_extra` only document the routes (GET /openapi.json).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..chat.parsers import OutputParser
from ..engine import SamplingParams
from ..engine.async_engine import RequestStream
from ..errors import InvalidRequestError
from . import metrics as prom
from . import openapi as doc
from .context import ServerContext, sampling, server_context
from .formats import ChatFormat, CompletionFormat
from .responses import cancel_all, respond
from .schemas import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse,
                      tool_dicts)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.get("/health", responses={200: {"model": doc.Health}, 503: {"model": doc.Health}})
async def health(request: Request) -> Response:
    alive = server_context(request).async_engine.running
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {prom.CONTENT_TYPE: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    ctx = server_context(request)
    return PlainTextResponse(prom.render(ctx.async_engine.metrics(), ctx.http_errors), media_type=prom.CONTENT_TYPE)


def _model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "kvfold",
            "max_model_len": ctx.engine.max_seq_len}


@router.get("/v1/models", responses={200: {"model": doc.ModelList}, **doc.errors(401)})
async def models(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    return JSONResponse({"object": "list", "data": [_model_card(ctx)]})


@router.get("/v1/models/{model_id:path}", responses={200: {"model": doc.ModelCard}, **doc.errors(401, 404)})
async def model(request: Request, model_id: str) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    ctx.check_model(model_id)
    return JSONResponse(_model_card(ctx))


@router.post("/v1/completions", **doc.generation(CompletionRequest, doc.Completion))
async def completions(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    req = parse(CompletionRequest, await ctx.read_json(request))
    ctx.check_model(req.model)
    batch = req.prompts()
    ids = [(param, _prompt_ids(ctx, prompt, param)) for param, prompt in batch]
    echo_logprobs = req.logprobs if req.echo else None  # the prompt's logprobs, echoed with it
    params = sampling(req, req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, logprobs=req.logprobs,
                      prompt_logprobs=echo_logprobs)
    # too long for the context: a lone prompt that fits alone blames the max_tokens the client set,
    # any other its prompt (`_start_all`)
    lone = batch[0][0] == "prompt"
    streams = await _start_all(ctx, ids, params, "max_tokens" if req.max_tokens and lone else None)
    n = len(params)
    echo = [_echo_text(ctx, prompt) for _, prompt in batch for _ in range(n)] if req.echo else None
    fmt = CompletionFormat(ctx.model_name, req.return_token_ids, ctx.tokenizer, req.logprobs is not None, echo,
                           [p[0] for _, p in ids for _ in range(n)])
    return await respond(request, streams, req, fmt)


@router.post("/v1/chat/completions", **doc.generation(ChatCompletionRequest, doc.ChatCompletion))
async def chat_completions(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    req = parse(ChatCompletionRequest, await ctx.read_json(request))
    ctx.check_model(req.model)
    ids, reasoning = chat_ids(ctx, req)
    # no max_tokens: whatever room the context leaves (at least 1, so a full context is a 400)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, ctx.engine.max_seq_len - len(ids))
    # too long for the context: the token limit the client set, unless the messages alone fill it
    limit = "messages" if len(ids) >= ctx.engine.max_seq_len else \
        "max_completion_tokens" if req.max_completion_tokens else "max_tokens" if req.max_tokens else "messages"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = chat_sampling(ctx, req, reasoning, max_tokens, logprobs)
    streams = await ctx.start(ids, params, length_param=limit)
    fmt = ChatFormat(ctx.model_name, req.return_token_ids, ctx.tokenizer, logprobs is not None, len(params),
                     chat_parser(ctx, req, reasoning))
    return await respond(request, streams, req, fmt)


@router.post("/tokenize", openapi_extra=doc.body(TokenizeRequest), responses={200: {"model": doc.Tokens},
                                                                             **doc.errors(400, 401, 404, 413, 415)})
async def tokenize(request: Request) -> Response:
    """vLLM's route: the ids a completion prompt or chat messages would run as."""
    ctx = server_context(request)
    ctx.check_auth(request)
    req = parse(TokenizeRequest, await ctx.read_json(request))
    if req.model is not None:
        ctx.check_model(req.model)
    if req.messages is not None:
        ids, _ = chat_ids(ctx, req)
    elif req.add_special_tokens or ctx.tokenizer is None:  # (no tokenizer: _prompt_ids says so)
        ids = _prompt_ids(ctx, req.prompt, "prompt")
    else:
        ids = ctx.tokenizer.encode(req.prompt)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.engine.max_seq_len, "tokens": ids})


@router.post("/detokenize", openapi_extra=doc.body(DetokenizeRequest), responses={200: {"model": doc.Detokenized},
                                                                                 **doc.errors(400, 401, 404, 413,
                                                                                              415)})
async def detokenize(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    req = parse(DetokenizeRequest, await ctx.read_json(request))
    if req.model is not None:
        ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="tokens")
    bad = [t for t in req.tokens if not 0 <= t < ctx.engine.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {ctx.engine.vocab_size})", param="tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})


async def _start_all(ctx: ServerContext, batch: list[tuple[str, list[int]]], params,
                     length_param: str | None) -> list[RequestStream]:
    """The choices of every (param, ids) prompt, all handed to the engine at once (they queue
    together, so a batch may hold up to max_queue prompts); a refusal of one cancels the others.
    A prompt too long for the context blames `length_param`, else (or when it fills the context
    alone, so that no token limit could help) its own param."""
    queue = ctx.engine.scheduler.max_queue
    if len(batch) > max(1, queue):
        raise ApiError(400, f"a batch of {len(batch)} prompts is more than this server queues at once ({queue})",
                       param="prompt")
    fills = ctx.engine.max_seq_len
    started = await asyncio.gather(*(ctx.start(ids, params, param=param,
                                               length_param=param if len(ids) >= fills else length_param or param)
                                     for param, ids in batch), return_exceptions=True)
    streams = [s for group in started if isinstance(group, list) for s in group]
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        cancel_all(streams)
        raise failed[0]  # the first prompt's refusal, in batch order
    return streams


def _echo_text(ctx: ServerContext, prompt: str | list[int]) -> str:
    """The prompt as `echo` returns it: the text sent, or the decoding of the ids sent."""
    if isinstance(prompt, str):
        return prompt
    return ctx.tokenizer.decode(prompt) if ctx.tokenizer is not None else ""


def _prompt_ids(ctx: ServerContext, prompt: str | list[int], param: str) -> list[int]:
    """A completion prompt as token ids: text is encoded after BOS (when the tokenizer has one),
    ids pass as they are."""
    if not isinstance(prompt, str):
        return list(prompt)
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
    # (a lone surrogate never gets here: read_json refuses it for every field)
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)


def chat_sampling(ctx: ServerContext, req: ChatCompletionRequest, reasoning: bool, max_tokens: int,
                  logprobs: int | None = None) -> list[SamplingParams]:
    """The engine's parameters for a parsed chat request whose prompt opens a reasoning block or
    not (`chat_ids`); also what POST /v1/messages runs with (`kvfold.server.anthropic`)."""
    # structured output constrains the answer, after the reasoning (vLLM #41132: not the reasoning)
    after = ctx.tokenizer.encode("</think>") if reasoning else []
    return sampling(req, max_tokens, logprobs=logprobs, grammar_after=after, tool_family=ctx.template.family)


def chat_parser(ctx: ServerContext, req: ChatCompletionRequest, reasoning: bool) -> Callable[[], OutputParser]:
    """A factory of the parser that reads a chat choice back (reasoning, content, tool calls).
    Where "</think>" is one token, a caller that feeds the parser the ids with their text gets the
    reasoning ended by that token, the event structured output starts on (`chat_sampling`), not by
    the text "</think>" written in pieces. Under a forced tool choice the parser streams calls as
    they are written."""
    family, tools = ctx.template.family, tool_dicts(req.tools) if req.calls_tools else None
    end = ctx.tokenizer.encode("</think>") if ctx.tokenizer is not None else []
    end_token, decode = (end[0], ctx.tokenizer.decode) if len(end) == 1 else (None, None)
    # a call the grammar forces streams its arguments as they are written (docs/serving.md)
    forced = req.forced_tools() is not None
    return lambda: OutputParser(family, tools=tools, in_reasoning=reasoning, end_token=end_token, decode=decode,
                                forced=forced)


def chat_ids(ctx: ServerContext, req: ChatCompletionRequest | TokenizeRequest,
             raw: dict[str, list[int]] | None = None) -> tuple[list[int], bool]:
    """The chat messages rendered in the model's chat format, and whether the rendered prompt
    opens a reasoning block; messages the format cannot express, or a template that refuses
    them, are a 400. `raw`: placeholders in the messages' text standing for token ids
    (`ChatTemplate.prompt`)."""
    if ctx.template is None:
        raise ApiError(400, "this model has no tokenizer, so no chat template", param="messages")
    messages = [m.as_dict() for m in req.messages]
    tools = tool_dicts(req.tools)
    try:
        prompt = ctx.template.prompt(messages, tools, req.render_options(), raw)  # markers in contents stay text
        return prompt.ids, prompt.opens_reasoning
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.param or "messages") from None
    except Exception as exc:  # the checkpoint's template refused these messages
        raise ApiError(400, f"chat template: {exc}", param="messages") from None

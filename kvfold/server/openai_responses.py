"""OpenAI's Responses API over the same engine path as /v1/chat/completions: POST /v1/responses,
GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and GET
/v1/responses/{id}/input_items. The request is translated into a chat request
(`openai_responses_translate`), runs exactly as chat completions run it (`routes.chat_sampling`,
`routes.chat_parser`), and its output comes back as output items (`openai_responses_format`).
Errors have OpenAI's shape (the app's handlers); the API key is the other /v1 routes' bearer.

- `store` (default true) keeps the response in memory (`kvfold.engine.response_store`, bounded by
  `kvfold serve --responses-store-mib`, least recently used out): GET returns it, DELETE drops
  it, input_items lists its input items, and `previous_response_id` continues its conversation
  (its input and output items, then the new input; not its instructions). An unknown, deleted,
  evicted or unstored id is a 404 (code "previous_response_not_found" for previous_response_id,
  "not_found" for the routes with an id). Another model's response: the store is the server's
  own, so an id from a server of another model is unknown here (404 previous_response_not_found),
  a `model` field other than the served one is a 404 model_not_found before the id is looked up,
  and a stored record made by another model name (a store outliving its server) is a 404
  previous_response_not_found naming that model. A refused request stores nothing.
- Exact resumption: a stored response keeps the state its prefill left at its prompt's last block
  boundary (`kvfold.engine.checkpoint`); the next turn restores it and prefills the rest (that
  prompt's last partial block, the previous output, the new input), so its output is
  bit-identical to a cold run of the whole conversation (in batch-invariant mode, the default on
  the CPU). A snapshot that fails its checks is dropped from the store and the turn runs without
  it, still exact.
- `background: true` (store needed) answers at once with status "in_progress"; the generation runs
  on, GET polls it, POST .../cancel stops it (status "cancelled"). Only background responses can be
  cancelled; a finished one is returned as it is. Streaming a background response is refused.
- Streams are server-sent events, each `event:` named, `data` carrying its `sequence_number`:
  response.created, response.in_progress, the output events, then response.completed (or
  response.incomplete when max_output_tokens cut it, response.failed on an engine error).
- `include: ["reasoning.encrypted_content"]`: each reasoning item carries its token ids, signed
  with the key of the Messages API's thinking signatures (`openai_responses_format.seal`); sent
  back in `input`, such an item renders to exactly those ids (`openai_responses_translate`).
The routes are in /openapi.json, POST /v1/responses with its request model (`ResponsesRequest`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.checkpoint import Checkpoint
from ..engine.response_store import ResponseStore, StoredResponse
from . import openapi as doc
from .context import ServerContext, server_context
from .anthropic_format import ThinkingSigner
from .openai_responses_format import OutputWriter, response_object, seal, usage
from .openai_responses_schemas import ENCRYPTED, ResponsesRequest, items, new_id
from .openai_responses_translate import render, reworded
from .formats import sse_json
from .responses import collect
from .routes import chat_parser, chat_sampling
from .schemas import ApiError, parse

log = logging.getLogger("kvfold.server")
DEFAULT_STORE_BYTES = 512 << 20

router = APIRouter()


def add_responses_api(app: FastAPI, store_bytes: int = DEFAULT_STORE_BYTES) -> None:
    """Serve the Responses API on `app`, storing responses in up to `store_bytes`."""
    app.state.responses = ResponseStore(store_bytes)
    app.state.responses_background = set()  # running background tasks (a reference keeps each alive)
    if getattr(app.state, "thinking_signer", None) is None:  # the Messages API's key when it is served
        app.state.thinking_signer = ThinkingSigner.for_server()
    app.include_router(router)


class Turn:
    """One response being generated: its engine stream, its output so far, and its record."""

    def __init__(self, ctx: ServerContext, store: ResponseStore, req: ResponsesRequest, rec: StoredResponse,
                 prompt_tokens: int, parser, writer: OutputWriter, checkpoint: Checkpoint):
        self.ctx, self.store, self.req, self.rec = ctx, store, req, rec
        self.prompt_tokens, self.parser, self.writer, self.checkpoint = prompt_tokens, parser, writer, checkpoint
        self.created_at = int(time.time())
        self.stream = None
        self.task: asyncio.Task | None = None
        self.last = None
        self.status, self.error = "in_progress", None
        self._history = rec.history  # the conversation before this response's output

    def body(self) -> dict[str, Any]:
        done = self.status in ("completed", "incomplete", "cancelled")
        return response_object(self.req, self.rec.id, self.created_at, self.ctx.model_name, status=self.status,
                               output=self.writer.items, error=self.error,
                               usage=usage(self.last, self.prompt_tokens, self.writer.reasoning_tokens)
                               if self.status != "in_progress" else None,
                               completed_at=int(time.time()) if done else None)

    def feed(self, out) -> list[dict]:
        """The events of one engine output."""
        if out.finish_reason == "error":
            self.status, self.error = "failed", {"code": "server_error", "message": out.error or "generation failed"}
            return []
        self.last = out
        # with the ids: the reasoning ends on the </think> token, where structured output starts
        deltas = [self.parser.feed(out.new_text, out.new_token_ids)] + ([self.parser.finish()] if out.finished else [])
        return self.writer.add(out, deltas)

    def finish(self, status: str | None = None) -> list[dict]:
        """Close the output with `status` (default: from how the engine ended it), store the
        record, and return the closing events (the lifecycle event last)."""
        if status is None and self.status == "in_progress":
            cut = self.last is None or self.last.finish_reason == "length"
            status = "incomplete" if cut else "completed"
        self.status = status or self.status
        events = self.writer.close("completed" if self.status == "completed" else "incomplete")
        self._save()
        kind = {"completed": "completed", "incomplete": "incomplete", "failed": "failed"}.get(self.status)
        return events + ([{"type": f"response.{kind}", "response": self.body()}] if kind else [])

    def _save(self) -> None:
        ck, prev_id = self.checkpoint, self.req.previous_response_id
        if ck.refused is not None and prev_id is not None:  # never offered again; this turn ran without it
            log.warning("response %s: its stored snapshot was refused (%s) and dropped", prev_id, ck.refused)
            self.store.drop_checkpoint(prev_id)
        if not self.req.stores:
            return
        rec = self.rec
        rec.body, rec.running = self.body(), None
        rec.history = self._history + tuple(rec.input_items) + tuple(self.writer.items)
        rec.checkpoint = ck.taken if self.status in ("completed", "incomplete") else None
        self.store.put(rec)

    def cancel(self) -> None:
        """Stop a background response now: status "cancelled", stored as it stands."""
        if self.status == "in_progress":
            self.finish("cancelled")
        if self.stream is not None:
            self.stream.cancel()
        if self.task is not None:
            self.task.cancel()


async def _turn(request: Request, ctx: ServerContext, req: ResponsesRequest) -> Turn:
    """Render the request's conversation and start its generation."""
    store: ResponseStore = request.app.state.responses
    history, prev = (), None
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise ApiError(404, f"Previous response with id {req.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
        made_by = prev.body.get("model")
        if made_by != ctx.model_name:  # (a store outliving its server: another model's conversation)
            raise ApiError(404, f"Previous response with id {req.previous_response_id!r} not found: it was made "
                           f"by model {made_by!r}; this server serves {ctx.model_name!r}",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.running is not None:
            raise ApiError(400, f"previous response {req.previous_response_id!r} is still in progress",
                           param="previous_response_id")
        history = prev.history
    if req.input is None or req.input == []:
        raise ApiError(400, "input: required (the message or items to respond to)", param="input")
    new = items(req.input)
    paths = [("previous_response_id", it) for it in history] + \
        [("input" if isinstance(req.input, str) else f"input.{i}", it) for i, it in enumerate(new)]
    signer: ThinkingSigner = request.app.state.thinking_signer
    chat, ids, reasoning = render(ctx, req, paths, signer)
    max_tokens = chat.max_completion_tokens or max(1, ctx.engine.max_seq_len - len(ids))
    params = chat_sampling(ctx, chat, reasoning, max_tokens, req.logprobs)
    ck = Checkpoint(*prev.checkpoint, capture=req.stores) if prev is not None and prev.checkpoint \
        else Checkpoint(capture=req.stores)
    rec = StoredResponse(new_id("resp"), {}, new, history)
    sealer = (lambda out_ids: seal(signer, ctx.model_name, out_ids)) if ENCRYPTED in (req.include or ()) else None
    turn = Turn(ctx, store, req, rec, len(ids), chat_parser(ctx, chat, reasoning)(),
                OutputWriter(ctx.tokenizer, req.logprobs is not None, reasoning, req.split_name, sealer), ck)
    # too long for the context: max_output_tokens when the client set it, unless the input alone fills it
    limit = "max_output_tokens" if req.max_output_tokens and len(ids) < ctx.engine.max_seq_len else "input"
    with reworded():
        (turn.stream,) = await ctx.start(ids, params, length_param=limit, checkpoint=ck)
    return turn


@router.post("/v1/responses", **doc.responses_create())
async def create_response(request: Request) -> Response:
    ctx = server_context(request)
    ctx.check_auth(request)
    req = parse(ResponsesRequest, await ctx.read_json(request))
    ctx.check_model(req.model)
    turn = await _turn(request, ctx, req)
    if req.background:
        return _in_background(request, turn)
    if req.stream:
        return StreamingResponse(_events(turn), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    (outs,) = await collect(request, [turn.stream])
    for out in outs:
        turn.feed(out)
    turn.finish()
    if turn.status == "failed":
        raise ApiError(500, turn.error["message"], type="server_error")
    return JSONResponse(turn.body())


def _in_background(request: Request, turn: Turn) -> Response:
    """Answer at once (status in_progress) and generate on in a task; the record is stored now."""
    tasks: set = request.app.state.responses_background

    async def run() -> None:
        try:
            async for out in turn.stream:
                turn.feed(out)
            if turn.status in ("in_progress", "failed"):
                turn.finish()
        except asyncio.CancelledError:  # cancelled (cancel() stored it) or the server stops
            if turn.status == "in_progress":
                turn.finish("cancelled")
        finally:
            turn.stream.cancel()
    turn.rec.body, turn.rec.running = turn.body(), turn
    turn.store.put(turn.rec)
    turn.task = asyncio.get_running_loop().create_task(run())
    tasks.add(turn.task)
    turn.task.add_done_callback(tasks.discard)
    return JSONResponse(turn.rec.body)


def _sse(event: dict[str, Any], numbers: itertools.count) -> str:
    event["sequence_number"] = next(numbers)
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n"


async def _events(turn: Turn) -> AsyncIterator[str]:
    """The stream's events; the engine request is cancelled if the client goes away."""
    numbers = itertools.count()
    try:  # Starlette cancels this generator when the client disconnects: `finally` cancels the request
        for kind in ("created", "in_progress"):
            yield _sse({"type": f"response.{kind}", "response": turn.body()}, numbers)
        async for out in turn.stream:
            for event in turn.feed(out):
                yield _sse(event, numbers)
            if turn.status == "failed":
                break
        for event in turn.finish():
            yield _sse(event, numbers)
    finally:
        turn.stream.cancel()


def _stored(request: Request, rid: str) -> StoredResponse:
    ctx = server_context(request)
    ctx.check_auth(request)
    rec = request.app.state.responses.get(rid)
    if rec is None:
        raise ApiError(404, f"No response found with id {rid!r}.", param="response_id", code="not_found")
    return rec


@router.get("/v1/responses/{response_id}", **doc.responses_by_id(doc.ResponseObject))
async def retrieve_response(request: Request, response_id: str) -> Response:
    rec = _stored(request, response_id)
    if request.query_params.get("stream", "false").lower() == "true":
        raise ApiError(400, "stream=true (replaying a response's events) is not supported by kvfold", param="stream",
                       code="unsupported_parameter")
    return JSONResponse(rec.running.body() if rec.running is not None else rec.body)


@router.delete("/v1/responses/{response_id}", **doc.responses_by_id(doc.ResponseDeleted))
async def delete_response(request: Request, response_id: str) -> Response:
    rec = _stored(request, response_id)
    if rec.running is not None:
        rec.running.cancel()
    request.app.state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", **doc.responses_by_id(doc.ResponseObject))
async def cancel_response(request: Request, response_id: str) -> Response:
    rec = _stored(request, response_id)
    if not rec.body.get("background"):
        raise ApiError(400, "only responses created with background: true can be cancelled", param="response_id")
    if rec.running is not None:
        rec.running.cancel()
    return JSONResponse(rec.body)


@router.get("/v1/responses/{response_id}/input_items", **doc.responses_by_id(doc.InputItemList))
async def input_items(request: Request, response_id: str) -> Response:
    rec = _stored(request, response_id)
    q = request.query_params
    order, after = q.get("order", "desc"), q.get("after")
    limit = q.get("limit", "20")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ApiError(400, f"limit must be an integer in [1, 100], got {limit!r}", param="limit")
    data = list(rec.input_items) if order == "asc" else list(reversed(rec.input_items))
    if after is not None:
        at = next((i for i, it in enumerate(data) if it["id"] == after), None)
        if at is None:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        data = data[at + 1:]
    page = data[:int(limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(data) > len(page)})

"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

Routes: GET /health, GET /metrics (Prometheus text), and, behind the API key when one is set,
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both streamed as server-sent
events with `"stream": true`). Errors use OpenAI's shape {"error": {message, type, param, code}}.

kvfold extension: `"return_token_ids": true` in a request adds `token_ids` (the generated ids)
to each choice, and to each streamed chunk's choice (the ids new in that chunk).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import AsyncEngine, Engine, RequestOutput, SamplingParams
from ..engine.async_engine import RequestStream
from ..errors import InvalidRequestError, QueueFullError, RequestTooLongError
from . import metrics as prom
from .chat_template import ChatTemplate
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest, parse

MAX_BODY_BYTES = 1 << 20  # 1 MiB
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None,
               chat_template: ChatTemplate | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An app serving `engine` as `model_name`. Its step loop runs on a background thread
    started and stopped with the app (uvicorn's lifespan); `app.state.engine` is the AsyncEngine."""
    async_engine = AsyncEngine(engine)
    tokenizer = engine.tokenizer
    template = chat_template or (ChatTemplate(tokenizer) if tokenizer is not None else None)
    http_errors: Counter[int] = Counter()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="kvfold", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = async_engine

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        http_errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        http_errors[exc.status_code] += 1
        err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        http_errors[500] += 1
        return JSONResponse(ApiError(500, f"internal error: {exc!r}", type="server_error").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        # constant-time comparison: the response time must not reveal how much of the key matched
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        """The body as JSON, refusing (413) anything over max_body_bytes without reading it all."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise ApiError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        try:
            return json.loads(body)
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def sampling(req, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                              stop=tuple(req.stop or ()))

    async def start(ids: list[int], params: SamplingParams) -> RequestStream:
        try:
            return await async_engine.add_request(ids, params)
        except RequestTooLongError as exc:
            raise ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc)) from None
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_error", code="queue_full") from None

    # ---- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        alive = async_engine.running
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(prom.render(async_engine.metrics(), http_errors), media_type=prom.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "kvfold",
             "max_model_len": engine.max_seq_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        data = await read_json(request)
        req = parse(CompletionRequest, data)
        req.refuse_unsupported()
        check_model(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        params = sampling(req, req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS)
        stream = await start(ids, params)
        return await respond(request, stream, req, _CompletionFormat(model_name, bool(data.get("return_token_ids"))))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        data = await read_json(request)
        req = parse(ChatCompletionRequest, data)
        req.refuse_unsupported()
        check_model(req.model)
        if template is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template", param="messages")
        try:
            ids = template.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except ApiError:
            raise
        except Exception as exc:  # the checkpoint's template refused these messages
            raise ApiError(400, f"chat template: {exc}", param="messages") from None
        # no max_tokens: whatever room the context leaves (at least 1, so a full context is a 400)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, engine.max_seq_len - len(ids))
        stream = await start(ids, sampling(req, max_tokens))
        return await respond(request, stream, req, _ChatFormat(model_name, bool(data.get("return_token_ids"))))

    async def respond(request: Request, stream: RequestStream, req, fmt: "_Format") -> Response:
        if req.stream:
            return StreamingResponse(sse(stream, fmt, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await collect(request, stream)
        last = outs[-1]
        if last.finish_reason == "error":
            raise ApiError(500, last.error or "generation failed", type="server_error")
        return JSONResponse(fmt.whole(outs))

    async def collect(request: Request, stream: RequestStream) -> list[RequestOutput]:
        """All outputs of a non-streamed request; a client that hangs up cancels it."""
        async def drain() -> list[RequestOutput]:
            return [out async for out in stream]
        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    raise ApiError(499, "client disconnected")
        finally:
            stream.cancel()  # no-op once finished

    async def sse(stream: RequestStream, fmt: "_Format", include_usage: bool) -> AsyncIterator[str]:
        # Cancelled by Starlette when the client disconnects; `finally` then cancels the request.
        try:
            first = fmt.first_chunk()
            if first is not None:
                yield _event(first)
            last = None
            async for out in stream:
                last = out
                if out.finish_reason == "error":
                    yield _event(ApiError(500, out.error or "generation failed", type="server_error").body())
                    break
                if out.new_text or out.new_token_ids or out.finished:
                    yield _event(fmt.chunk(out))
            if include_usage and last is not None:
                yield _event(fmt.usage_chunk(last))
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()

    return app


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


class _Format:
    """Builds the JSON bodies of one response kind."""
    object_whole = object_chunk = prefix = ""

    def __init__(self, model_name: str, token_ids: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.token_ids = token_ids

    def _envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def first_chunk(self) -> dict | None:
        return None

    def usage_chunk(self, last: RequestOutput) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], _usage(last))

    def _choice(self, out_choice: dict, ids: list[int]) -> dict:
        if self.token_ids:
            out_choice["token_ids"] = ids
        return out_choice


class _CompletionFormat(_Format):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        choice = {"index": 0, "text": out.new_text, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._envelope(self.object_chunk, [self._choice(choice, out.new_token_ids)])

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        ids = [t for o in outs for t in o.new_token_ids]
        choice = {"index": 0, "text": "".join(o.new_text for o in outs), "logprobs": None,
                  "finish_reason": outs[-1].finish_reason}
        return self._envelope(self.object_whole, [self._choice(choice, ids)], _usage(outs[-1]))


class _ChatFormat(_Format):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def first_chunk(self) -> dict | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.object_chunk, [choice])

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        delta = {"content": out.new_text} if out.new_text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._envelope(self.object_chunk, [self._choice(choice, out.new_token_ids)])

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        ids = [t for o in outs for t in o.new_token_ids]
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
                  "logprobs": None, "finish_reason": outs[-1].finish_reason}
        return self._envelope(self.object_whole, [self._choice(choice, ids)], _usage(outs[-1]))

"""Turning a running request into an HTTP response: one JSON body, or server-sent events
(`"stream": true`). Either way a client that goes away cancels its request in the engine.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import RequestOutput
from ..engine.async_engine import RequestStream
from .formats import ResponseFormat
from .schemas import ApiError


async def respond(request: Request, stream: RequestStream, req, fmt: ResponseFormat) -> Response:
    """The response to a started request: streamed when `req.stream`, else whole once it finishes."""
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


async def sse(stream: RequestStream, fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed response, ending with `data: [DONE]` (after an error event, if one)."""
    # Cancelled by Starlette when the client disconnects; `finally` then cancels the request.
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield event(first)
        last = None
        async for out in stream:
            last = out
            if out.finish_reason == "error":
                yield event(ApiError(500, out.error or "generation failed", type="server_error").body())
                break
            if out.new_text or out.new_token_ids or out.finished:
                yield event(fmt.chunk(out))
        if include_usage and last is not None:
            yield event(fmt.usage_chunk(last))
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()


def event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

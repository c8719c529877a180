"""Turning running requests into an HTTP response: one JSON body, or server-sent events
(`"stream": true`). A response covers one request per choice (a batch of completion prompts runs
as one engine request per prompt); a client that goes away cancels them all in the engine.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import RequestOutput
from ..engine.async_engine import RequestStream
from .formats import ResponseFormat, sse_json
from .schemas import ApiError


async def respond(request: Request, streams: list[RequestStream], req, fmt: ResponseFormat) -> Response:
    """The response to started requests (choice i is streams[i]): streamed when `req.stream`,
    else whole once all finish."""
    if req.stream:
        return StreamingResponse(sse(streams, fmt, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    outs = await collect(request, streams)
    for choice in outs:
        if choice[-1].finish_reason == "error":
            raise ApiError(500, choice[-1].error or "generation failed", type="server_error")
    return JSONResponse(fmt.whole(outs))


async def collect(request: Request, streams: list[RequestStream]) -> list[list[RequestOutput]]:
    """All outputs of non-streamed requests, per request; a client that hangs up cancels them."""
    async def drain(stream: RequestStream) -> list[RequestOutput]:
        return [out async for out in stream]
    task = asyncio.gather(*(drain(s) for s in streams))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected")
    finally:
        cancel_all(streams)  # no-op for finished ones


def cancel_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.cancel()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of all streams as they come, each with its stream's index; ends when all finish."""
    if len(streams) == 1:  # the common case: no pump task and second queue between engine and socket
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            queue.put_nowait((i, out))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def sse(streams: list[RequestStream], fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed response, ending with `data: [DONE]` (after an error event, if one)."""
    # Cancelled by Starlette when the client disconnects; `finally` then cancels the requests.
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield event(first)
        lasts: dict[int, RequestOutput] = {}
        failed = False
        async with aclosing(merged(streams)) as outs:
            async for i, out in outs:
                if out.finish_reason == "error":
                    yield event(ApiError(500, out.error or "generation failed", type="server_error").body())
                    failed = True
                    break
                lasts[i] = out
                chunk = fmt.chunk(out, i) if out.new_text or out.new_token_ids or out.finished else None
                if chunk is not None:  # None: nothing to say yet (text held back, no ids asked for)
                    yield event(chunk)
        if include_usage and not failed:
            yield event(fmt.usage_chunk([lasts[i] for i in range(len(streams))]))
        yield "data: [DONE]\n\n"
    finally:
        cancel_all(streams)


def event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {sse_json(obj)}\n\n"

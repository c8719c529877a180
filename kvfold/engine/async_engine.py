"""`AsyncEngine`: the engine's step loop on a background thread, fed from asyncio code.

Only the worker thread ever touches the `Engine`: adds and cancels from the event loop go into
an inbox the worker applies between steps, so a cancel can never free a state in the middle of
a forward. Outputs go back through one asyncio queue per request; metrics are published by the
worker between steps as a plain dict, so readers on other threads never see a half-updated
engine: after any step that finished a request (before its last output goes out, so a client
that has its answer reads the counts that include it), after adds and cancels, when the engine
goes idle, and otherwise at most every METRICS_PERIOD_S while requests stream (building the dict
costs a few per cent of a small model's decode step).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from ..errors import EngineError
from .engine import Engine
from .sequence import RequestOutput, SamplingParams

log = logging.getLogger("kvfold.engine")

METRICS_PERIOD_S = 0.05


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._metrics = engine.metrics()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvfold-engine", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """True while the step loop is alive."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _submit(self, op: Callable[[], None]) -> None:
        with self._cv:
            if self._stop:
                raise EngineError("the engine is shutting down")
            self._inbox.append(op)
            self._cv.notify()

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(self, prompt_ids: Seq[int], params: SamplingParams) -> "RequestStream":
        """Queue a request; returns the stream of its outputs. Engine refusals
        (InvalidRequestError, RequestTooLongError, QueueFullError) raise here."""
        (stream,) = await self.add_choices(prompt_ids, [params])
        return stream

    async def add_choices(self, prompt_ids: Seq[int], params: Seq[SamplingParams],
                          checkpoint: Any = None) -> list["RequestStream"]:
        """`Engine.add_choices`: one stream per choice, all sharing one prefill (from `checkpoint`,
        engine/checkpoint.py, when it applies)."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in params]
        added: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

        def add() -> None:
            if not added.set_running_or_notify_cancel():
                return  # the caller gave up before the worker got here: add nothing
            try:
                rids = self.engine.add_choices(prompt_ids, list(params), checkpoint=checkpoint)
            except Exception as exc:
                added.set_exception(exc)
                return
            for rid, queue in zip(rids, queues):
                self._streams[rid] = (loop, queue)  # registered before any step can produce output
            added.set_result(rids)

        self._submit(add)
        try:
            rids = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # caller gone while the worker was adding them: cancel once added
            def cleanup(f: concurrent.futures.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    for rid in f.result():
                        self.cancel(rid)
            added.add_done_callback(cleanup)
            raise
        return [RequestStream(self, rid, q) for rid, q in zip(rids, queues)]

    async def generate(self, prompt_ids: Seq[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate; leaving the loop early cancels the request."""
        stream = await self.add_request(prompt_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()

    def cancel(self, request_id: str) -> None:
        """Cancel a request (from any thread); its state is freed before the next step."""
        def op() -> None:
            self._streams.pop(request_id, None)
            self.engine.cancel(request_id)
        try:
            self._submit(op)
        except EngineError:  # shutting down: every request is being freed anyway
            pass

    def metrics(self) -> dict[str, float]:
        return self._metrics

    # ---- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        # a placed model's virtual-device test mode (layers/virtual_devices.py) is thread-local:
        # this thread runs the model, so it enters the mode too
        virtual = getattr(getattr(self.engine.model, "devices", None), "virtual", None)
        with virtual if virtual is not None else contextlib.nullcontext():
            self._loop()

    def _loop(self) -> None:
        published = time.monotonic()
        while True:
            beat = getattr(self.engine, "heartbeat_s", None)  # tensor parallel: step at least this often
            with self._cv:
                while not self._stop and not self._inbox and not self.engine.has_unfinished():
                    if not self._cv.wait(timeout=beat) and beat is not None:
                        break  # an empty step, so the follower ranks hear from rank 0 (engine/replicas.py)
                if self._stop:
                    break
                ops, self._inbox = self._inbox, []
            for op in ops:
                op()
            try:
                outputs = self.engine.step() if self.engine.has_unfinished() or beat is not None else []
            except Exception as exc:  # a bug, not a request's fault: end every request, keep serving
                log.exception("engine step failed")
                outputs = self._fail_all(f"engine step failed: {exc!r}")
            now = time.monotonic()
            if any(out.finished for out in outputs) or ops or now - published >= METRICS_PERIOD_S \
                    or not self.engine.has_unfinished():
                self._metrics = self.engine.metrics()  # before the outputs: a finished client sees it
                published = now
            self._dispatch(outputs)
        # shutting down: apply what is still in the inbox, then end every request and free its state
        with self._cv:
            ops, self._inbox = self._inbox, []
        for op in ops:
            op()
        outputs = self._fail_all("the server is shutting down")
        stop = getattr(self.engine, "stop_followers", None)
        if stop is not None:
            stop()
        self._metrics = self.engine.metrics()
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.pop(out.request_id, None) if out.finished else \
                self._streams.get(out.request_id)
            if target is not None:
                loop, queue = target
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                except RuntimeError:  # that event loop is closed: nobody is listening
                    pass

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error output (their states are freed)."""
        outs = [RequestOutput(rid, [], "", True, "error", 0, 0, 0, message) for rid in self._streams]
        self.engine.cancel_all()
        return outs


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished one."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out: RequestOutput = await self._queue.get()
        self.finished = out.finished
        return out

    def cancel(self) -> None:
        """Stop the request unless it already finished (idempotent): call it when the reader goes away."""
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.request_id)

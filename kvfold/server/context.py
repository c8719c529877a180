"""What every route of one app shares: the engine, the served name, the API key, the body limit,
and the checks each request goes through before it reaches the engine.

`create_app` builds one `ServerContext` and keeps it as `app.state.server`; routes and error
handlers find it with `server_context(request)`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..decoding.grammar import TOOL_CALL_FORMATS, GrammarSpec, compile_grammar
from ..decoding.sampling import SEED_RANGE
from ..engine import AsyncEngine, Engine, SamplingParams
from ..engine.async_engine import RequestStream
from ..errors import InvalidRequestError, QueueFullError, RequestTooLongError
from ..chat.template import ChatTemplate
from .schemas import ApiError


@dataclass
class ServerContext:
    engine: Engine
    async_engine: AsyncEngine
    model_name: str
    api_key: str | None
    tokenizer: Any  # the engine's, or None: then prompts come as token ids and there is no chat template
    template: ChatTemplate | None
    max_body_bytes: int
    created: int  # when the app was built: the `created` of /v1/models
    http_errors: Counter[int] = field(default_factory=Counter)  # error responses by status, for /metrics

    def check_auth(self, request: Request) -> None:
        """401 unless the request carries the API key (when one is set) as a bearer token."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        # constant-time comparison: the response time must not reveal how much of the key matched
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def read_json(self, request: Request) -> Any:
        """The body as JSON: 415 unless it is declared JSON, 413 for anything over max_body_bytes
        (without reading it all), 400 for text that is not JSON (NaN and Infinity included) or
        holds a lone surrogate (no UTF-8 form: it could reach neither the tokenizer nor a reply)."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise ApiError(415, f"the request body must be application/json, not {media_type or 'undeclared'!r}",
                           code="unsupported_media_type")
        body = await self._read_body(request)
        try:
            data = json.loads(body, parse_constant=_no_constant)
        except RecursionError:  # the parser's stack, not the client's fault to know about: a 400
            raise ApiError(400, "the request body is nested too deeply to parse") from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {_ascii(exc)}") from None
        if _SURROGATE_ESCAPE.search(body):  # only a \u escape can write one
            path = _lone_surrogate_at(data)
            if path is not None:
                param = ".".join(path) or None
                raise ApiError(400, f"{param or 'the body'}: a lone surrogate (\\ud800-\\udfff) is not text",
                               param=param)
        return data

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        return bytes(body)

    def check_model(self, name: str) -> None:
        """404 for any model id but the one this server serves."""
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def start(self, ids: list[int], params: list[SamplingParams], param: str | None = None,
                    length_param: str = "max_tokens", checkpoint: Any = None) -> list[RequestStream]:
        """Submit a prompt's choices (one prefill), answering the engine's refusals as OpenAI errors
        (400, or 503 when full); `param` names the field an invalid request blames unless the
        engine names one (else the prompt's ids), `length_param` the one a request too long for
        the context does (the token limit the client set, else the prompt). `checkpoint`: the
        engine's `Checkpoint` (POST /v1/responses resumes a stored conversation from one)."""
        await self._compile(params)
        try:
            return await self.async_engine.add_choices(ids, params, checkpoint=checkpoint)
        except RequestTooLongError as exc:
            raise ApiError(400, str(exc), param=length_param, code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param=exc.param or param) from None
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_error", code="queue_full") from None


    async def _compile(self, params: list[SamplingParams]) -> None:
        """Compile the choices' grammar off the event loop and the engine's thread (a big schema
        takes a while), so the engine gets it ready; a bad one is a 400 before any work."""
        spec = params[0].grammar
        if not isinstance(spec, GrammarSpec):
            return
        if self.tokenizer is None:
            raise ApiError(400, "structured output needs a tokenizer; this model has none", param=spec.param)
        try:
            compiled = await asyncio.to_thread(compile_grammar, spec, self.tokenizer, self.engine.vocab_size)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param=exc.param or spec.param) from None
        for p in params:
            p.grammar = compiled


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _ascii(x: object) -> str:
    return str(x).encode("ascii", "backslashreplace").decode()


def _lone_surrogate_at(data: Any) -> list[str] | None:
    """The path of the first string (or key) in `data` with a lone surrogate, else None.
    Iterative: the body may nest as deep as the JSON parser allows."""
    stack = [([], data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _is_utf8(v):
                return path
        elif isinstance(v, dict):
            for k in v:
                if not _is_utf8(k):
                    return path + [_ascii(k)]
            stack += [(path + [k], x) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(path + [str(i)], x) for i, x in reversed(list(enumerate(v)))]
    return None


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def server_context(request: Request) -> ServerContext:
    """The context of the app serving `request`."""
    return request.app.state.server


def sampling(req, max_tokens: int, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
             grammar_after: list[int] | None = None, tool_family: str | None = None) -> list[SamplingParams]:
    """The engine's sampling parameters for a parsed completion or chat request: one per choice
    (`n`), choice i seeded with seed + i (wrapped into the 64-bit range), as vLLM derives them.
    An output constraint is left as its GrammarSpec (`ServerContext.compile` compiles it).
    `tool_family`: the chat format's tool syntax, for a tool_choice that forces a call."""
    base = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=tuple(req.stop or ()),
                stop_token_ids=req.stop_token_ids, ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, grammar=_grammar_spec(req, tool_family),
                grammar_after=tuple(grammar_after or ()), **req.shaping())
    return [SamplingParams(seed=derived_seed(req.seed, i), **base) for i in range(req.n or 1)]


def _grammar_spec(req, tool_family: str | None):
    """The request's output constraint as a GrammarSpec (None: none), a 400 naming its field if
    malformed: a structured output, or the tool call that tool_choice "required" or a named
    function forces (constrained decoding with xgrammar's structural tag of the family's syntax)."""
    structured = req.structured()
    forced = req.forced_tools()
    if forced is not None:
        if structured is not None:
            raise ApiError(400, f"tool_choice forces a tool call, so {structured[0]} cannot constrain the output too",
                           param=structured[0])
        if tool_family not in TOOL_CALL_FORMATS:
            raise ApiError(400, "this model's chat format has no tool-call syntax", param="tool_choice")
        tools, choice = forced
        return GrammarSpec("tool_calls", {"family": tool_family, "tools": tools, "tool_choice": choice,
                                          "parallel": req.parallel_tool_calls is not False}, param="tool_choice")
    return None if structured is None else structured[1]


def derived_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed`: seed + index, wrapped into
    torch's seed range [-2^63, 2^64)."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return (seed + index - lo) % (hi - lo) + lo

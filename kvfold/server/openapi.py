"""The OpenAPI document (GET /openapi.json, browsed at /docs).

The routes read their bodies themselves (the body limit, the content type and the API key come
before any parsing), so FastAPI cannot see the request models: each route names its model with
`body(...)`, and `build_openapi` adds the models' JSON schemas (the very ones requests are
validated against) to the document. The response models here only document the bodies that
`formats` and `ApiError` write; the tests check the server's answers against them.

Anthropic's Messages routes and OpenAI's Responses routes are documented too (their request
models from `anthropic_schemas` / `openai_responses_schemas`); the Messages routes answer errors
in Anthropic's shape (`AnthropicError`, `anthropic_errors`), the others in OpenAI's.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .anthropic_schemas import CountTokensRequest, MessagesRequest
from .context import ServerContext
from .openai_responses_schemas import _ITEMS, ResponsesRequest
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, MessagesRequest,
                  CountTokensRequest, ResponsesRequest)
INPUT_ITEMS = tuple(_ITEMS.values())  # what a Responses `input` list holds (validated one by one: `items`)
_REF = "#/components/schemas/{model}"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(_Doc):
    cached_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | None = None  # with "return_token_ids": true


class Completion(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunction(_Doc):
    name: str
    arguments: str


class CalledTool(_Doc):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # when the chat format separates reasoning
    tool_calls: list[CalledTool] | None = None


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]
    token_ids: list[int] | None = None


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Health(_Doc):
    status: str


class Tokens(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(_Doc):
    prompt: str


class _Open(BaseModel):
    """A documented body whose listed fields are checked, and which may carry more."""
    model_config = ConfigDict(extra="allow")


# ---- Anthropic's Messages API (anthropic.py) ------------------------------------------------------

class AnthropicErrorDetail(_Doc):
    type: str
    message: str


class AnthropicError(_Doc):
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(_Open):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(_Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class InputTokens(_Doc):
    input_tokens: int


# ---- OpenAI's Responses API (openai_responses.py) -------------------------------------------------

class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class InputItemList(_Doc):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


_ERRORS = {400: "Invalid or unsupported request", 401: "Missing or wrong API key", 404: "Unknown model",
           405: "Method not allowed", 413: "Body over the limit", 415: "Body not application/json",
           503: "Queue full", 529: "Queue full (Anthropic's overloaded_error)"}


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": AnthropicError, "description": _ERRORS[s]} for s in statuses}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` naming a route's JSON body (one of REQUEST_MODELS)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def generation(model: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """The decorator arguments documenting a generation route: its JSON body, and its answers
    (a JSON body, or server-sent events when the request says `"stream": true`)."""
    ok = {"model": response, "description": "The completion, or its chunks as server-sent events with stream",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {"openapi_extra": body(model), "responses": {200: ok, **errors(400, 401, 404, 413, 415, 503)}}


def anthropic_generation() -> dict[str, Any]:
    """The decorator arguments of POST /v1/messages (errors in Anthropic's shape, 529 overloaded)."""
    ok = {"model": AnthropicMessage, "description": "The message, or its events as server-sent events with stream",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {"openapi_extra": body(MessagesRequest),
            "responses": {200: ok, **anthropic_errors(400, 401, 404, 413, 415, 529)}}


def anthropic_count_tokens() -> dict[str, Any]:
    return {"openapi_extra": body(CountTokensRequest),
            "responses": {200: {"model": InputTokens}, **anthropic_errors(400, 401, 404, 413, 415)}}


def responses_create() -> dict[str, Any]:
    """POST /v1/responses: the response object, or its events with stream."""
    ok = {"model": ResponseObject, "description": "The response, or its events as server-sent events with stream",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {"openapi_extra": body(ResponsesRequest), "responses": {200: ok, **errors(400, 401, 404, 413, 415, 503)}}


def responses_by_id(model: type[BaseModel]) -> dict[str, Any]:
    """The routes of one stored response (an unknown id is a 404)."""
    return {"responses": {200: {"model": model}, **errors(400, 401, 404)}}


def build_openapi(app: FastAPI, ctx: ServerContext) -> dict[str, Any]:
    """The document of `app`, with the request models' schemas narrowed to this server: `model`
    the one id served (any other is a 404), token ids inside its vocabulary; when an API key is
    set the /v1 routes say they need it."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS + INPUT_ITEMS], ref_template=_REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for m in REQUEST_MODELS:
        optional = m in (TokenizeRequest, DetokenizeRequest)
        served = {"type": "string", "enum": [ctx.model_name], "description": "The model this server serves"}
        schemas[m.__name__]["properties"]["model"] = {"anyOf": [served, {"type": "null"}]} if optional else served
    _narrow_prompt(schemas["CompletionRequest"]["properties"]["prompt"], ctx.engine.vocab_size)
    _narrow_input(schemas["ResponsesRequest"])
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422s: kvfold answers 400
        schemas.pop(name, None)
    bearer = ctx.api_key is not None
    for path, ops in doc["paths"].items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            if bearer and path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
    if bearer:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = doc
    return doc


def _narrow_input(request: dict[str, Any]) -> None:
    """Responses `input`: a string or a non-empty list of the items kvfold reads; required (with
    previous_response_id too, there must be something new to respond to)."""
    item = {"anyOf": [{"$ref": _REF.format(model=m.__name__)} for m in INPUT_ITEMS]}
    request["properties"]["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": item, "minItems": 1}],
                                      "description": "The message (a string) or the items to respond to"}
    request["required"] = sorted({*request.get("required", ()), "input"})


def _narrow_prompt(prompt: dict[str, Any], vocab_size: int) -> None:
    """Token ids in [0, vocab_size), no empty id list (checked by the engine and `prompts()`)."""
    def narrow(s: dict[str, Any]) -> None:
        if s.get("type") == "integer":
            s.update(minimum=0, maximum=vocab_size - 1)
        elif s.get("type") == "array":
            if s["items"].get("type") != "string":
                s["minItems"] = 1
            narrow(s["items"])
    for member in prompt["anyOf"]:
        narrow(member)

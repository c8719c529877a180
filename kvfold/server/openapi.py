"""The OpenAPI document (GET /openapi.json, browsed at /docs).

The routes read their bodies themselves (the body limit, the content type and the API key come
before any parsing), so FastAPI cannot see the request models: each route names its model with
`body(...)`, and `build_openapi` adds the models' JSON schemas (the very ones requests are
validated against) to the document. The response models here only document the bodies that
`formats` and `ApiError` write; the tests check the server's answers against them.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .context import ServerContext
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
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


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


_ERRORS = {400: "Invalid or unsupported request", 401: "Missing or wrong API key", 404: "Unknown model",
           405: "Method not allowed", 413: "Body over the limit", 415: "Body not application/json",
           503: "Queue full"}


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


def build_openapi(app: FastAPI, ctx: ServerContext) -> dict[str, Any]:
    """The document of `app`, with the request models' schemas narrowed to this server: `model`
    the one id served (any other is a 404), token ids inside its vocabulary; when an API key is
    set the /v1 routes say they need it."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=_REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for m in REQUEST_MODELS:
        optional = m in (TokenizeRequest, DetokenizeRequest)
        served = {"type": "string", "enum": [ctx.model_name], "description": "The model this server serves"}
        schemas[m.__name__]["properties"]["model"] = {"anyOf": [served, {"type": "null"}]} if optional else served
    _narrow_prompt(schemas["CompletionRequest"]["properties"]["prompt"], ctx.engine.vocab_size)
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

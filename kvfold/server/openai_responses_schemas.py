"""Request bodies of OpenAI's Responses API (POST /v1/responses), as strict as the chat schemas
(`schemas._Strict`): a field OpenAI does not define is a 400 naming it, and a field kvfold cannot
honour is accepted only with the values that change nothing (the `_only` tables), never silently
dropped. Pure metadata is accepted and unused (`metadata`, `user`, `safety_identifier`,
`prompt_cache_key`, `client_metadata`, ...; docs/serving.md lists them).

`input` items are validated one by one (`items`), so an error names the item's path, and
normalized to one shape each, with an id (what GET .../input_items lists and what a later turn
renders): a message's content becomes a list of text parts, a function_call_output's output one
text.
"""
from __future__ import annotations

import secrets
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from .schemas import ApiError, _Strict, parse

MAX_TOP_LOGPROBS = 20
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# ---- input items ---------------------------------------------------------------------------------

class TextPart(_Strict):
    type: str
    text: str
    annotations: list[Any] | None = None  # output metadata sent back with an output: not model input
    logprobs: list[Any] | None = None  # the same
    _only: ClassVar[dict[str, tuple]] = {"type": ("input_text", "output_text")}  # images, files, audio: no


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # commentary / final_answer: a label of OpenAI's own models' output


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None  # a `namespace` tool's function: rendered as NAMESPACE.NAME
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(None, alias="async")
    _only: ClassVar[dict[str, tuple]] = {"async_": (None, False)}


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None  # the result goes by call_id: its name and namespace are labels
    caller: dict[str, Any] | None = None


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningPart(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    id: str | None = None
    encrypted_content: str | None = None  # kvfold's own (`openai_responses_format.seal`): checked when rendered
    status: str | None = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
          "reasoning": ReasoningItem}
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _text(parts: str | list[TextPart]) -> str:
    return parts if isinstance(parts, str) else "".join(p.text for p in parts)


def normalized(item: Any) -> dict[str, Any]:
    """One validated item in the shape kvfold stores, lists and renders."""
    kind = item.type
    out: dict[str, Any] = {"id": item.id or new_id(_PREFIX[kind]), "type": kind}
    if kind == "message":
        part = "output_text" if item.role == "assistant" else "input_text"
        content = [{"type": part, "text": item.content}] if isinstance(item.content, str) else \
            [{"type": p.type, "text": p.text} for p in item.content]
        out.update(role=item.role, content=content, status="completed")
    elif kind == "function_call":
        out.update(call_id=item.call_id, name=item.name, arguments=item.arguments, status="completed")
        if item.namespace is not None:
            out["namespace"] = item.namespace
    elif kind == "function_call_output":
        out.update(call_id=item.call_id, output=_text(item.output), status="completed")
    else:
        out.update(summary=[p.model_dump() for p in item.summary],
                   content=[p.model_dump() for p in item.content] if item.content is not None else None)
        if item.encrypted_content is not None:
            out["encrypted_content"] = item.encrypted_content
    return out


def items(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """`input` as normalized items: a string is one user message; each item validated on its own
    (a 400 names it: input.3.content, ...)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [normalized(MessageItem(role="user", content=value))]
    out = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            shown = f"{kind!r} items are" if isinstance(kind, str) else "this item is"
            raise ApiError(400, f"input.{i}: {shown} not supported by kvfold (message, function_call, "
                           "function_call_output and reasoning are)", param=f"input.{i}.type" if kind else f"input.{i}",
                           code="unsupported_parameter")
        out.append(normalized(prefixed(lambda: parse(model, raw), f"input.{i}")))
    return out


def prefixed(make, prefix: str):
    """`make()`, its ApiError's param (and the message naming it) put under `prefix`."""
    try:
        return make()
    except ApiError as exc:
        param = f"{prefix}.{exc.param}" if exc.param else prefix
        message = exc.message.replace(exc.param, param, 1) if exc.param and exc.param in exc.message \
            else f"{prefix}: {exc.message}"
        raise ApiError(exc.status, message, type=exc.type, param=param, code=exc.code) from None


# ---- tools, text, reasoning ----------------------------------------------------------------------

class FunctionTool(_Strict):
    type: str
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None  # would be model input kvfold's chat formats do not show
    _only: ClassVar[dict[str, tuple]] = {"type": ("function",), "allowed_callers": (None, ["direct"]),
                                         "defer_loading": (None, False), "output_schema": (None,)}

    def chat(self) -> dict[str, Any]:
        """The tool as /v1/chat/completions takes it."""
        fn = {k: v for k, v in (("name", self.name), ("description", self.description),
                                ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": fn}


class NamespaceTool(_Strict):
    """A group of function tools (Codex CLI sends its sub-agent tools as one): each is offered to
    the model as NAMESPACE.NAME, and a call of one comes back with `namespace` and its own name."""
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    tools: list[FunctionTool]


HOSTED_IGNORED = ("web_search",)  # hosted tools accepted and not offered to the model (docs/serving.md)


def flat_tools(tools: Any) -> Any:
    """`tools` with each `namespace` tool replaced by its functions, named NAMESPACE.NAME, and the
    hosted tools of HOSTED_IGNORED left out (kvfold runs none: the model is not told of them)."""
    if not isinstance(tools, list):
        return tools
    flat = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_IGNORED:
            continue
        if kind == "namespace":
            group = prefixed(lambda: parse(NamespaceTool, tool), f"tools.{i}")
            flat += [{**t.model_dump(exclude_none=True), "name": f"{group.name}.{t.name}"} for t in group.tools]
        else:
            flat.append(tool)
    return flat


class NamedFunction(_Strict):
    type: str
    name: str
    _only: ClassVar[dict[str, tuple]] = {"type": ("function",)}  # hosted tools, allowed_tools: no


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ApiError(400, "text.format: a json_schema format needs a name and a schema", param="text.format")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The format as chat's `response_format` (None: plain text)."""
        if self.type == "json_schema":
            spec = {"name": self.name, "schema": self.schema_,
                    **({"strict": self.strict} if self.strict is not None else {}),
                    **({"description": self.description} if self.description is not None else {})}
            return {"type": "json_schema", "json_schema": spec}
        return {"type": "json_object"} if self.type == "json_object" else None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # OpenAI's models write longer or shorter: only the default
    _only: ClassVar[dict[str, tuple]] = {"verbosity": (None, "medium")}


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # kvfold shows the reasoning, not a summary
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: str | None = None  # which turns' reasoning a later turn shows: the chat format decides
    mode: str | None = None
    _only: ClassVar[dict[str, tuple]] = {"context": (None, "auto"), "mode": (None, "standard")}


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # padding against length side channels: same text


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    background: bool | None = None
    background_options: dict[str, Any] | None = None  # when to finish a background response: scheduling
    metadata: dict[str, str] | None = None  # kept with the response, unused
    user: str | None = None  # metadata: accepted, unused
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # a cache hint: kvfold's prefix cache needs none
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None  # scheduling, not output: only the ordinary tiers
    max_tool_calls: int | None = None  # counts built-in tool calls, which kvfold has none of
    truncation: str | None = None  # "auto" would drop input items: refused
    conversation: Any = None  # the Conversations API: not implemented
    prompt: Any = None  # stored prompt templates: not implemented
    context_management: Any = None  # compaction rewrites the input: not implemented
    moderation: Any = None  # may block the output: refused
    image: Any = None
    access_programs: Any = None
    _only: ClassVar[dict[str, tuple]] = {
        "service_tier": (None, "auto", "default"), "truncation": (None, "disabled"), "conversation": (None,),
        "prompt": (None,), "context_management": (None,), "moderation": (None,), "image": (None,),
        "access_programs": (None,)}

    _namespaces: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="wrap")
    @classmethod
    def _flat_tools(cls, data: Any, handler):
        """`namespace` and ignored hosted tools out of `tools` (`flat_tools`); the namespaces kept."""
        if not (isinstance(data, dict) and isinstance(data.get("tools"), list)):
            return handler(data)
        req = handler({**data, "tools": flat_tools(data["tools"])})
        req._namespaces = {t["name"] for t in data["tools"] if isinstance(t, dict) and t.get("type") == "namespace"}
        return req

    def split_name(self, name: str) -> tuple[str | None, str]:
        """A called function's (namespace, name): NAMESPACE.NAME of a `namespace` tool's function."""
        ns, dot, inner = name.partition(".")
        return (ns, inner) if dot and ns in self._namespaces else (None, name)

    @model_validator(mode="after")
    def _check(self):
        bad = [i for i, x in enumerate(self.include or ()) if x not in INCLUDABLE]
        if bad:
            raise ApiError(400, f"include.{bad[0]}: {self.include[bad[0]]!r} is not one of {list(INCLUDABLE)}",
                           param=f"include.{bad[0]}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        if self.background and self.store is False:
            raise ApiError(400, "background: true needs store: true (the response is fetched later)",
                           param="background")
        if self.background and self.stream:
            raise ApiError(400, "background: true with stream: true is not supported by kvfold: poll GET "
                           "/v1/responses/{id} instead", param="background", code="unsupported_parameter")
        return self

    @property
    def stores(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    @property
    def logprobs(self) -> int | None:
        """The top_logprobs each output token carries (None: no logprobs)."""
        if LOGPROBS in (self.include or ()) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

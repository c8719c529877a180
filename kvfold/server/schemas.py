"""Request bodies of the OpenAI-compatible endpoints, and the OpenAI error shape.

As strict as OpenAI: no type coercion ("10" is not an int), and a field OpenAI does not define
is refused with a 400 naming it, except vLLM's sampling extensions, which kvfold implements as
vLLM defines them (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `structured_outputs` and the older `guided_*` fields). Every field OpenAI
defines is declared; those kvfold does not implement are accepted only with the values that
change nothing (`best_of` 1, `tools` null, ...: the `_only` tables) and refused otherwise, never
silently ignored. Pure metadata (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`,
...) is accepted and unused. The OpenAPI document (`kvfold.server.openapi`) is these models'
JSON schemas.
"""
from __future__ import annotations

import json
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..decoding.grammar import GrammarError, GrammarSpec
from ..decoding.sampling import SamplingArgumentError, check_sampling

MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_STOPS = 4  # OpenAI's limit
MAX_N = 128  # OpenAI's limit on choices per request
MAX_CHAT_LOGPROBS = 20  # OpenAI's top_logprobs range
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's logprobs range on /v1/completions


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _same(v: Any, accepted: Any) -> bool:
    # typed equality: False is not 0, but 0 is 0.0
    return v == accepted and (type(v) is type(accepted) or {type(v), type(accepted)} <= {int, float})


def _short(v: Any) -> str:
    """A value for a message: JSON, ASCII (no lone surrogate reaches a response), cut short."""
    try:
        text = json.dumps(v, ensure_ascii=True, default=str)
    except (RecursionError, ValueError):  # nested past the encoder's stack
        text = type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _accepted(values: tuple) -> str:
    return " or ".join(_short(a) for a in values if a is not None)


def _document_only(schema: dict[str, Any], cls: type["_Strict"]) -> None:
    """The JSON schema of an `_only` field lists exactly the values kvfold accepts."""
    for name, accepted in cls._only.items():
        if name in schema.get("properties", {}):
            shown = _accepted(accepted) or "null"
            schema["properties"][name] = {"enum": list(accepted), "default": accepted[0],
                                          "description": f"kvfold accepts only {shown}; any other value is a 400"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_document_only)
    _only: ClassVar[dict[str, tuple]] = {}  # field -> the values accepted (first: the default)

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, v: Any, info) -> Any:
        accepted = cls._only.get(info.field_name)
        if accepted is not None and not any(_same(v, a) for a in accepted):
            shown = _accepted(accepted)  # parse() writes the message, which needs the field's full path
            raise PydanticCustomError("unsupported_parameter", "{detail}",
                                      {"detail": f"={_short(v)} is not supported by kvfold (only {shown})" if shown
                                       else " is not supported by kvfold"})
        return v


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels; same text


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # (`json` is a BaseModel method)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(_Strict):
    model: str
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TEMPERATURE})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    seed: int | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra={"maxItems": MAX_STOPS})
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    presence_penalty: float | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: float | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None  # metadata: accepted, unused
    return_token_ids: bool = Field(False, description="kvfold extension: add the generated token ids to each choice")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: token ids that end the choice, "
                                             "besides the model's EOS ids")
    top_k: int | None = Field(None, description="vLLM extension: sample from the k most likely tokens (0 or -1: all)")
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1},
                                description="vLLM extension: drop tokens below min_p times the top probability")
    repetition_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0},
                                             description="vLLM extension: > 1 discourages tokens of the prompt and "
                                             "output")
    min_tokens: int | None = Field(None, json_schema_extra={"minimum": 0},
                                   description="vLLM extension: no stop before this many tokens")
    ignore_eos: bool | None = Field(None, description="vLLM extension: do not stop at the model's EOS ids")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: constrain the output")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older structured_outputs.grammar")
    _more_token_limits: ClassVar[tuple[str, ...]] = ()  # fields checked as max_tokens is

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else (v or [])

    @model_validator(mode="after")
    def _check_sampling(self):
        """Out-of-range sampling fields: a 400 naming the field (decoding's rules, OpenAI's limits)."""
        self.temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's defaults
        self.top_p = 1.0 if self.top_p is None else self.top_p
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        try:
            check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                           stop=self.stop, stop_ids=self.stop_token_ids, names={"stop_ids": "stop_token_ids"},
                           max_temperature=MAX_TEMPERATURE, max_stops=MAX_STOPS, **self.shaping())
            for name in self._more_token_limits:
                check_sampling(max_tokens=getattr(self, name), names={"max_tokens": name},
                               min_tokens=self.min_tokens or 0)
        except SamplingArgumentError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        return self

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with int keys: JSON keys are strings, each must spell a token id."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
        if bad:
            raise ApiError(400, f"logit_bias keys must be token ids, got {_short(bad[0])}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    def shaping(self) -> dict[str, Any]:
        """The arguments of `check_sampling` and `SamplingParams` that reshape the distribution."""
        return {"top_k": 0 if self.top_k is None else self.top_k, "min_p": self.min_p or 0.0,
                "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "logit_bias": self.token_bias(), "min_tokens": self.min_tokens or 0}

    def structured(self) -> tuple[str, GrammarSpec] | None:
        """(param, spec) of the one output constraint asked for, or None; a 400 when more than one
        is, or when the one is malformed (naming its field)."""
        found: list[tuple[str, Callable[[], GrammarSpec]]] = []
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json_schema", so.json_schema), ("regex", so.regex), ("choice", so.choice),
                                ("ebnf", so.grammar), ("json_object", True if so.json_object else None)):
                if value is not None:
                    found.append(("structured_outputs", lambda k=kind, v=value: GrammarSpec(
                        k, None if k == "json_object" else v, param="structured_outputs")))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "ebnf")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, lambda k=kind, v=value, n=name: GrammarSpec(k, v, param=n)))
        found += self._response_format()
        if len(found) > 1:
            raise ApiError(400, f"{found[1][0]}: one output constraint per request ({found[0][0]} is one already)",
                           param=found[1][0])
        if so is not None and not found:
            raise ApiError(400, "structured_outputs: give one of json, regex, choice, grammar or json_object",
                           param="structured_outputs")
        if not found:
            return None
        param, make = found[0]
        try:
            return param, make()
        except GrammarError as exc:
            raise ApiError(400, str(exc), param=param) from None

    def _response_format(self) -> list[tuple[str, Callable[[], GrammarSpec]]]:
        return []

    def forced_tools(self) -> tuple[list[dict[str, Any]], str] | None:
        """(tools, "required" | "forced") when tool_choice makes the model call one (chat only)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = list[int]


class CompletionRequest(_Request):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a token-id list, or a batch of either (n choices per prompt)")
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS})
    suffix: str | None = None
    _only: ClassVar[dict[str, tuple]] = {**_Request._only, "best_of": (None, 1), "suffix": (None, "")}

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                           param="logprobs")
        return self

    def prompts(self) -> list[tuple[str, str | list[int]]]:
        """The prompts, each a text or token ids, with the param that names it: one ("prompt"), or a
        batch, a list of texts or of id lists ("prompt.0", ...)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            batch = [(f"prompt.{i}", one) for i, one in enumerate(p)]
        else:
            batch = [("prompt", p)]
        for param, one in batch:
            if isinstance(one, list) and not one:
                raise ApiError(400, "prompt is an empty token list", param=param)
        return batch


class TextPart(_Strict):
    type: str
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a cache hint: accepted, unused
    _only: ClassVar[dict[str, tuple]] = {"type": ("text",)}  # images, audio, files: not supported


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name is model input, which kvfold's templates drop: refused
    refusal: str | None = None
    audio: Any = None
    tool_calls: list[ToolCall] | None = None
    function_call: Any = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="vLLM extension: an assistant turn's reasoning")
    _only: ClassVar[dict[str, tuple]] = {"role": ("system", "developer", "user", "assistant", "tool"),
                                         "name": (None,), "refusal": (None,), "audio": (None,),
                                         "function_call": (None,)}

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "tool_calls belong to assistant messages")
        if self.reasoning_content is not None and self.role != "assistant":
            raise PydanticCustomError("reasoning_role", "reasoning_content belongs to assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("tool_call_id_role", "a tool message, and only a tool message, needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat formats take it: content joined into one text."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Request tools as the chat formats, parsers and grammars take them (plain OpenAI dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


_NOT_IMPLEMENTED = ("functions", "function_call", "audio", "prediction", "web_search_options", "verbosity",
                    "moderation")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_CHAT_LOGPROBS})
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # deprecated by OpenAI for tools
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="DeepSeek-V4: none is chat mode (no reasoning); minimal, low, medium and high reason at "
        "its level high, xhigh and max at max (kvfold.chat.dsv4_encoding.reasoning_mode)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: options of the chat "
                                                        "format, e.g. {\"thinking\": true}")
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None  # may block the output: refused
    service_tier: str | None = None  # scheduling, not output: only the ordinary tiers
    store: bool | None = None  # kvfold stores nothing: only false
    metadata: dict[str, str] | None = None  # metadata of stored completions: accepted, unused
    safety_identifier: str | None = None  # metadata: accepted, unused
    prompt_cache_key: str | None = None  # a cache hint: kvfold's prefix cache needs none
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    _only: ClassVar[dict[str, tuple]] = {
        **_Request._only, **{name: (None,) for name in _NOT_IMPLEMENTED}, "modalities": (None, ["text"]),
        "service_tier": (None, "auto", "default"), "store": (None, False)}
    _more_token_limits: ClassVar[tuple[str, ...]] = ("max_completion_tokens",)

    @model_validator(mode="after")
    def _check_tools(self):
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice) and tc.function.name not in {t.function.name for t in self.tools or ()}:
            raise ApiError(400, f"tool_choice names {tc.function.name!r}, which is not in tools", param="tool_choice")
        if tc in ("required",) and not self.tools:
            raise ApiError(400, 'tool_choice "required" needs tools', param="tool_choice")
        if self.parallel_tool_calls is False and not (tc == "required" or isinstance(tc, NamedToolChoice)):
            # only a constrained call can be held to one: the model may write more, kvfold would drop them
            raise ApiError(400, "parallel_tool_calls: false is supported with tool_choice \"required\" or a named "
                           "function", param="parallel_tool_calls")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> tuple[list[dict[str, Any]], str] | None:
        """(tools, "required" | "forced") when tool_choice makes the model call one, else None."""
        tc = self.tool_choice
        if tc == "required":
            return tool_dicts(self.tools), "required"
        if isinstance(tc, NamedToolChoice):
            return tool_dicts([t for t in self.tools if t.function.name == tc.function.name]), "forced"
        return None

    def render_options(self) -> dict[str, Any]:
        """What the chat format takes beyond the messages: chat_template_kwargs, reasoning_effort,
        response_format."""
        options = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            options["reasoning_effort"] = self.reasoning_effort
        if self.response_format is not None and self.response_format != {"type": "text"}:
            options["response_format"] = self.response_format
        return options

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_CHAT_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in [0, {MAX_CHAT_LOGPROBS}], got {self.top_logprobs}",
                               param="top_logprobs")
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def _response_format(self) -> list[tuple[str, Callable[[], GrammarSpec]]]:
        rf = self.response_format
        if rf is None or rf == {"type": "text"}:
            return []
        return [("response_format", lambda: GrammarSpec.from_response_format(rf))]


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a completion prompt (BOS first with add_special_tokens, as
    /v1/completions does) or chat messages (rendered as /v1/chat/completions renders them)."""
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _only: ClassVar[dict[str, tuple]] = {"add_generation_prompt": (True,)}  # kvfold's templates always add it

    def render_options(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize: token ids back to text."""
    model: str | None = None
    tokens: TokenIds


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body; pydantic's first error becomes an OpenAI-shaped 400 naming the field
    (sampling fields out of range raise their ApiError from the model's own check)."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _api_error(exc.errors(include_url=False, include_input=False), data) from None


# what a field of a union takes, for a message better than its first member's complaint
_UNION_TYPES = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def _api_error(errors: list[dict[str, Any]], data: Any) -> ApiError:
    located = [(*_real_path(e, data), e) for e in errors]
    depth = max(len(path) for path, _, _ in located)
    deepest = [x for x in located if len(x[0]) == depth]
    path, union_at, err = deepest[0]  # the deepest: inside a union, the member that came closest
    if union_at is not None and len({tuple(e["loc"][:union_at + 1]) for _, _, e in deepest}) > 1:
        # members of a union failed equally deep: none fits, name the union field itself
        param = ".".join(str(p) for p in path[:union_at])
        kind = _UNION_TYPES.get(path[union_at - 1], "one of the types the schema lists")
        return ApiError(400, f"{param}: must be {kind}", param=param)
    param = ".".join(str(p) for p in path) or None
    if err["type"] == "unsupported_parameter":
        return ApiError(400, f"{param}{err['msg']}", param=param, code="unsupported_parameter")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unrecognized parameter {param}: not supported by kvfold", param=param,
                        code="unknown_parameter")
    return ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)


def _real_path(err: dict[str, Any], data: Any) -> tuple[tuple, int | None]:
    """The error's location in the body itself (pydantic's loc without its union-member tags),
    and the index in loc of the first tag skipped (None: no union on the way)."""
    path, cur, union_at = [], data, None
    loc = err["loc"]
    for i, p in enumerate(loc):
        if isinstance(cur, dict) and isinstance(p, str) and p in cur:
            path.append(p)
            cur = cur[p]
        elif isinstance(cur, list) and isinstance(p, int) and 0 <= p < len(cur):
            path.append(p)
            cur = cur[p]
        elif i == len(loc) - 1 and err["type"] == "missing":  # a required field is absent from the body
            path.append(p)
        elif union_at is None:
            union_at = i
    return tuple(path), union_at

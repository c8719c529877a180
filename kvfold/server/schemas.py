"""Request bodies of the OpenAI-compatible endpoints, and the OpenAI error shape.

Only what kvfold implements is accepted with a non-default value; fields it does not implement
(n > 1, logprobs, echo, penalties, logit_bias, tools) are refused with a 400 rather than silently
ignored. Unknown extra fields are ignored, as clients send many.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..decoding.sampling import SamplingArgumentError, check_sampling

MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_STOPS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    _more_token_limits: ClassVar[tuple[str, ...]] = ()  # fields checked as max_tokens is

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else (v or [])

    @model_validator(mode="after")
    def _check_sampling(self):
        """Out-of-range sampling fields: a 400 naming the field (decoding's rules, OpenAI's limits)."""
        try:
            check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                           stop=self.stop, max_temperature=MAX_TEMPERATURE, max_stops=MAX_STOPS)
            for name in self._more_token_limits:
                check_sampling(max_tokens=getattr(self, name), names={"max_tokens": name})
        except SamplingArgumentError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        return self

    def refuse_unsupported(self) -> None:
        for name, ok in (("n", self.n == 1), ("logprobs", self.logprobs in (None, False)),
                         ("presence_penalty", self.presence_penalty == 0),
                         ("frequency_penalty", self.frequency_penalty == 0), ("logit_bias", not self.logit_bias)):
            if not ok:
                raise ApiError(400, f"{name} is not supported by kvfold", param=name, code="unsupported_parameter")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, 1)),
                         ("suffix", self.suffix is None)):
            if not ok:
                raise ApiError(400, f"{name} is not supported by kvfold", param=name, code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (a list holding one prompt is accepted too)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "kvfold serves one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ApiError(400, "prompt is an empty token list", param="prompt")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text; list content may hold only text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ApiError(400, f"content part type {part.get('type')!r} is not supported (text only)",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    _more_token_limits: ClassVar[tuple[str, ...]] = ("max_completion_tokens",)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise ApiError(400, "tools are not supported by kvfold", param="tools", code="unsupported_parameter")


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body, turning pydantic's error into an OpenAI-shaped 400 (sampling fields out
    of range raise their ApiError from the model's own check)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None

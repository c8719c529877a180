"""Request bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens).

The fields are those of the anthropic SDK's `MessageCreateParams` and `MessageCountTokensParams`
(beta included, as Claude Code sends them). As strict as the schemas of the OpenAI routes
(`schemas._Strict`): no type coercion, a field Anthropic does not define is a 400 naming it. Three
kinds of fields besides those kvfold honours (docs/serving.md lists them):
- accepted and ignored, since they do not change the output: cache hints (`cache_control`
  anywhere), billing and routing (`metadata`, `service_tier`, `inference_geo`, `speed`, ...),
  `context_management` (kvfold never edits the prompt), hints kvfold cannot act on
  (`thinking.budget_tokens`, `thinking.display`, `output_config.effort`);
- refused unless empty (`_only`): what would change the output and kvfold cannot do
  (`mcp_servers`, `compaction`, `thread`);
- content blocks and tools other than text / tool_use / tool_result / thinking and client tools:
  refused by `check_block_types` before the body is parsed, with a message naming the block.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .schemas import ApiError, _Strict

ANTHROPIC_MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")
CacheControl = dict[str, Any] | None  # {"type": "ephemeral", "ttl": ...}: a cache hint, ignored


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None  # citations point into documents, which kvfold refuses


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: Any = None  # programmatic tool calling's caller: bookkeeping, not model input
    toolset_name: str | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None

    def text(self) -> str:
        """The result as the model reads it: text blocks joined by a blank line (the DeepSeek-V4
        release's separator for the parts of a result), "Error: " first when is_error is set
        (chat formats have no error flag on a tool result)."""
        content = self.content
        text = content if isinstance(content, str) else "\n\n".join(b.text for b in content or ())
        return "Error: " + text if self.is_error else text


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]  # system: the mid-conversation-system beta (Claude Code's)
    content: str | list[ContentBlock]
    clear_at: Literal["next_user_message", "never"] | None = None  # system only: honoured
    output_config: dict[str, Any] | None = None  # system only: a per-turn effort hint, ignored

    @model_validator(mode="after")
    def _system_fields(self):
        if self.role != "system" and (self.clear_at is not None or self.output_config is not None):
            raise PydanticCustomError("system_only", "clear_at and output_config belong to system messages")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None  # as /v1/chat/completions: only a forced call is held to the schema
    defer_loading: bool | None = None  # for Anthropic's tool search (refused): the tool is always shown
    eager_input_streaming: bool | None = None  # how input streams, not what it is
    input_examples: list[dict[str, Any]] | None = None  # the chat formats have no place for them
    allowed_callers: list[str] | None = None  # programmatic tool calling: not model input


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ApiError(400, 'tool_choice: "name" goes with, and only with, type "tool"', param="tool_choice.name")
        if self.disable_parallel_tool_use and self.type == "auto":
            # only a constrained call can be held to one: the model may write more, kvfold would drop them
            raise ApiError(400, 'tool_choice.disable_parallel_tool_use: supported with type "any" or "tool" (a '
                           'forced call), not "auto"', param="tool_choice.disable_parallel_tool_use")
        return self


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # a soft target at Anthropic too: not enforced (docs/serving.md)
    display: Literal["summarized", "omitted"] | None = None  # the thinking text is always returned

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise ApiError(400, f'thinking.budget_tokens: type "enabled" needs an integer >= {MIN_THINKING_BUDGET}',
                           param="thinking.budget_tokens")
        return self


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")  # (`schema` is a BaseModel method)


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint: ignored
    format: OutputFormat | None = None  # honoured: structured output, as response_format
    task_budget: dict[str, Any] | None = None  # a hint across contexts: ignored


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what the prompt is made of."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    context_management: dict[str, Any] | None = None  # kvfold never edits the prompt
    speed: Literal["standard", "fast"] | None = None
    billing_policy: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # tools Anthropic's servers would call: refused
    compaction: dict[str, Any] | None = None  # a summary instead of a reply: refused
    _only: ClassVar[dict[str, tuple]] = {"mcp_servers": (None, []), "compaction": (None,)}

    def system_text(self) -> str | None:
        """The system prompt; text blocks joined by a blank line."""
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n\n".join(b.text for b in self.system)

    @model_validator(mode="after")
    def _check_tool_choice(self):
        tc, names = self.tool_choice, {t.name for t in self.tools or ()}
        if tc is not None and tc.type == "tool" and tc.name not in names:
            raise ApiError(400, f"tool_choice names {tc.name!r}, which is not in tools", param="tool_choice.name")
        if tc is not None and tc.type == "any" and not names:
            raise ApiError(400, 'tool_choice "any" needs tools', param="tool_choice")
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: int = Field(json_schema_extra={"minimum": 1})
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": ANTHROPIC_MAX_TEMPERATURE})
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # capacity, not output
    container: str | dict[str, Any] | None = None  # only server tools (refused) use one
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None  # kvfold returns no diagnostics
    fallbacks: list[Any] | str | None = None  # kvfold never declines, so never falls back
    fallback_credit_token: Any = None
    thread: dict[str, Any] | None = None  # server-held conversation state: refused
    _only: ClassVar[dict[str, tuple]] = {**CountTokensRequest._only, "thread": (None,)}

    @model_validator(mode="after")
    def _check_sampling(self):
        """Anthropic's ranges; the rest (top_k, stop_sequences) is checked as chat completions
        check it, once translated."""
        if self.max_tokens < 1:
            raise ApiError(400, f"max_tokens: must be >= 1, got {self.max_tokens}", param="max_tokens")
        t = self.temperature
        if t is not None and not 0 <= t <= ANTHROPIC_MAX_TEMPERATURE:
            raise ApiError(400, f"temperature: must be in [0, {ANTHROPIC_MAX_TEMPERATURE:g}], got {t}",
                           param="temperature")
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if self.thinking is not None and self.thinking.type == "enabled" and budget >= self.max_tokens:
            raise ApiError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})",
                           param="thinking.budget_tokens")
        return self


def check_block_types(body: Any) -> None:
    """A 400 naming the first content block (in system, messages or a tool result) that is not
    text / tool_use / tool_result / thinking, or the first tool that is not a client tool
    (Anthropic's server tools run on its servers). Checked before parsing, so the message says
    what kvfold does not read instead of pydantic's union complaint; shapes that are wrong
    otherwise are left to the parse."""
    if not isinstance(body, dict):
        return
    where: list[tuple[str, Any, tuple]] = [("system", body.get("system"), ("text",))]
    for i, m in enumerate(body.get("messages") if isinstance(body.get("messages"), list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        system = isinstance(m, dict) and m.get("role") == "system"  # (tool additions and removals: refused)
        where.append((f"messages.{i}.content", content, ("text",) if system else BLOCK_TYPES))
        for j, b in enumerate(content if isinstance(content, list) else ()):
            if isinstance(b, dict) and b.get("type") == "tool_result":
                where.append((f"messages.{i}.content.{j}.content", b.get("content"), ("text",)))
    for path, blocks, allowed in where:
        for j, b in enumerate(blocks if isinstance(blocks, list) else ()):
            kind = b.get("type") if isinstance(b, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                raise ApiError(400, f"{path}.{j}: blocks of type {kind!r} are not supported by kvfold, which reads "
                               f"{', '.join(allowed)} blocks here", param=f"{path}.{j}.type")
    tools = body.get("tools")
    for i, t in enumerate(tools if isinstance(tools, list) else ()):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise ApiError(400, f"tools.{i}: the server tool {kind!r} is not supported by kvfold; define a client "
                           "tool with name, description and input_schema", param=f"tools.{i}.type")

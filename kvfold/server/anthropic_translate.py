"""An Anthropic Messages request -> the chat request /v1/chat/completions runs, rendered by the
same chat format (`routes.chat_ids`), so both routes share the prompt, sampling and parsing.

- `system` (a string, or text blocks joined by a blank line) is the system message.
- Consecutive messages of one role merge into one turn, as Anthropic merges them. A user turn's
  `tool_result` blocks become tool messages, in their order, before the turn's text (the
  DeepSeek-V4 release puts results first too); each must answer a `tool_use` of the assistant turn
  right before it, and every such tool_use needs its result there (Anthropic's rules). `is_error`
  writes "Error: " before the result. Text blocks join with a blank line.
- An assistant turn's text blocks join as written, `tool_use` blocks become its tool calls
  (`input` as the arguments), `thinking` blocks its reasoning (the chat format decides where it
  shows: DeepSeek-V4 shows it only in thinking mode). A thinking block's signature must be one
  this server wrote for that text (`ThinkingSigner`), else the request is a 400.
- A final assistant message (prefill) is a 400: the chat formats close every assistant turn.
- `system` messages (the mid-conversation-system beta Claude Code uses): those before the first
  user or assistant message join the system prompt; later ones are the format's instruction turn
  (DeepSeek-V4: a developer message, a turn of its own; other formats: a system message). One
  whose `clear_at` is "next_user_message" is left out once a user message follows it.
- `thinking` enabled or adaptive turns the format's reasoning mode on, disabled off, absent leaves
  its default: DeepSeek-V4's `thinking`, a Jinja template's `enable_thinking`; a format without
  one (the plain template) takes adaptive and disabled as they are, and refuses enabled.
- `tool_choice` auto / any / tool / none is chat's auto / required / named function / none;
  `disable_parallel_tool_use` holds a forced call to one. `output_config.format` is a
  `response_format` json_schema. `stop_sequences` is `stop`, `top_k` vLLM's `top_k`.
A chat-side refusal is reworded in the request's own terms (`messages.3` -> the Anthropic block).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..chat.template import ChatTemplate
from .anthropic_format import ThinkingSigner
from .anthropic_schemas import CountTokensRequest, MessagesRequest, Thinking
from .context import ServerContext
from .routes import chat_ids
from .schemas import ApiError, ChatCompletionRequest, parse

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


@dataclass
class Prompt:
    chat: ChatCompletionRequest  # what the engine runs with (sampling, tools, output parser)
    ids: list[int]
    reasoning: bool  # the prompt opens a reasoning block


def render(ctx: ServerContext, req: CountTokensRequest, signer: ThinkingSigner) -> Prompt:
    """The request's prompt in the model's chat format, as /v1/chat/completions renders it."""
    messages, origin = chat_messages(req, signer, ctx.template)
    body = chat_body(req, ctx.template, messages)
    try:
        chat = parse(ChatCompletionRequest, body)
        ids, reasoning = chat_ids(ctx, chat)
    except ApiError as exc:
        raise ApiError(exc.status, _reworded(exc.message, origin), param=_reworded(exc.param or "", origin) or None,
                       type=exc.type) from None
    return Prompt(chat, ids, reasoning)


def chat_body(req: CountTokensRequest, template: ChatTemplate | None, messages: list[dict]) -> dict[str, Any]:
    """The /v1/chat/completions body of the request (with its translated messages)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        body["tool_choice"] = _TOOL_CHOICE.get(tc.type) or {"type": "function", "function": {"name": tc.name}}
        if tc.disable_parallel_tool_use and tc.type in ("any", "tool"):
            body["parallel_tool_calls"] = False
    kwargs = _template_kwargs(req.thinking, template)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.json_schema}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body.update({k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None})
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return body


def _template_kwargs(thinking: Thinking | None, template: ChatTemplate | None) -> dict[str, bool] | None:
    if thinking is None:
        return None
    on = thinking.type != "disabled"
    kind = template.kind if template is not None else "plain"
    if kind == "deepseek_v4":
        return {"thinking": on}
    if kind == "jinja":
        return {"enable_thinking": on}  # the variable GLM's (and Qwen's) templates read
    if thinking.type == "enabled":
        raise ApiError(400, "thinking: this model's chat format has no reasoning mode", param="thinking")
    return None  # adaptive lets the model not think; disabled is what it does anyway


def chat_messages(req: CountTokensRequest, signer: ThinkingSigner,
                  template: ChatTemplate | None = None) -> tuple[list[dict], list[str]]:
    """The chat messages of the request, and for each the Anthropic path it comes from."""
    out: list[dict] = []
    origin: list[str] = []
    turns = _merged(req)
    system = [] if req.system is None else [("system", req.system_text())]
    while turns and turns[0][0] == "system":  # system messages before the conversation join the system prompt
        _, at, blocks = turns.pop(0)
        system.append((at, _system_text(blocks)))
    if system:
        out.append({"role": "system", "content": "\n\n".join(text for _, text in system)})
        origin.append(system[0][0])
    if not turns:
        raise ApiError(400, "messages: there is no user message", param="messages")
    if turns[-1][0] == "assistant":
        raise ApiError(400, f"{turns[-1][1]}: a final assistant message (prefill) is not supported by kvfold; end "
                       "with a user message", param=turns[-1][1])
    # later ones are the format's instruction turn: DeepSeek-V4 has no system turn mid-conversation,
    # its release renders a developer message there as a turn of its own
    later = "developer" if template is not None and template.kind == "deepseek_v4" else "system"
    calls: dict[str, str] = {}  # tool_use ids of the assistant turn before -> their paths
    for role, at, blocks in turns:
        if role == "user":
            _user_turn(blocks, at, calls, out, origin)
            calls = {}
        elif role == "assistant":
            calls = _assistant_turn(blocks, at, signer, out, origin)
        else:
            out.append({"role": later, "content": _system_text(blocks)})
            origin.append(at)
    return out, origin


def _merged(req: CountTokensRequest) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """(role, path of its first message, [(path, block)]) per turn: consecutive messages of one
    role merged; a system message whose clear_at is "next_user_message" left out once a user
    message follows it."""
    turns: list[tuple[str, str, list[tuple[str, Any]]]] = []
    last_user = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1)
    for i, m in enumerate(req.messages):
        at = f"messages.{i}"
        if isinstance(m.content, str):
            blocks = [(f"{at}.content", m.blocks()[0])]
        else:
            blocks = [(f"{at}.content.{j}", b) for j, b in enumerate(m.content)]
        if not blocks:
            raise ApiError(400, f"{at}: all messages must have non-empty content", param=f"{at}.content")
        if m.clear_at == "next_user_message" and i < last_user:
            continue
        if turns and turns[-1][0] == m.role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((m.role, at, blocks))
    return turns


def _system_text(blocks: list[tuple[str, Any]]) -> str:
    for path, b in blocks:
        if b.type != "text":
            raise ApiError(400, f"{path}: a system message holds text blocks only", param=f"{path}.type")
    return "\n\n".join(b.text for _, b in blocks)


def _user_turn(blocks: list[tuple[str, Any]], at: str, calls: dict[str, str], out: list[dict],
               origin: list[str]) -> None:
    texts = []
    unanswered = dict(calls)
    for path, b in blocks:
        if b.type == "tool_result":
            if b.tool_use_id not in unanswered:
                raise ApiError(400, f"{path}: tool_result for {b.tool_use_id!r}, which no tool_use block of the "
                               "assistant message right before it has (or one answered already)",
                               param=f"{path}.tool_use_id")
            del unanswered[b.tool_use_id]
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            origin.append(path)
        elif b.type == "text":
            texts.append(b.text)
        else:
            raise ApiError(400, f"{path}: a {b.type} block belongs in an assistant message", param=f"{path}.type")
    if unanswered:
        first = next(iter(unanswered.values()))
        raise ApiError(400, f"{at}: tool_use ids {list(unanswered)} have no tool_result here; each tool_use block "
                       f"({first}, ...) needs a tool_result in the next user message", param=at)
    if texts or not calls:
        out.append({"role": "user", "content": "\n\n".join(texts)})
        origin.append(at)


def _assistant_turn(blocks: list[tuple[str, Any]], at: str, signer: ThinkingSigner, out: list[dict],
                    origin: list[str]) -> dict[str, str]:
    """Append the assistant message; returns its tool_use ids (-> their paths)."""
    texts, thinking, calls, ids = [], [], [], {}
    for path, b in blocks:
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "thinking":
            if not signer.verify(b.thinking, b.signature):
                raise ApiError(400, f"{path}.signature: not a signature this server wrote for this thinking text "
                               "(a thinking block from another model, an altered one, or one from a server with "
                               "another key: see $KVFOLD_THINKING_SECRET)", param=f"{path}.signature")
            thinking.append(b.thinking)
        elif b.type == "tool_use":
            if b.id in ids:
                raise ApiError(400, f"{path}: tool_use id {b.id!r} is used twice in this turn", param=f"{path}.id")
            ids[b.id] = path
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            raise ApiError(400, f"{path}: a {b.type} block belongs in a user message", param=f"{path}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    out.append(message)
    origin.append(at)
    return ids


_CHAT_NAMES = (("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
               ("chat_template_kwargs", "thinking"), ("response_format", "output_config.format"))


def _reworded(text: str, origin: list[str]) -> str:
    """A chat-side message or param in the Anthropic request's terms."""
    text = re.sub(r"\bmessages\.(\d+)(?:\.\w+)*",
                  lambda m: origin[int(m[1])] if int(m[1]) < len(origin) else m[0], text)
    text = re.sub(r"\btools\.(\d+)\.function\.parameters\b", r"tools.\1.input_schema", text)
    text = re.sub(r"\btools\.(\d+)\.function\b", r"tools.\1", text)
    text = re.sub(r"^stop\b", "stop_sequences", text)
    for chat, anthropic in _CHAT_NAMES:
        text = text.replace(chat, anthropic)
    return text

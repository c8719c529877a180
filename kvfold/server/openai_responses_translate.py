"""A Responses request -> the chat request /v1/chat/completions runs, rendered by the same chat
format (`routes.chat_ids`), so both routes share the prompt, sampling and output parsing (as
`anthropic_translate` does for the Messages API).

- `instructions` is the first message (system); with `previous_response_id` the earlier turns'
  instructions are not carried over (OpenAI's rule), the earlier items are.
- Items in order: a user / system / developer message is that chat message (its text parts
  joined); the assistant side of a turn (`reasoning`, assistant `message`, `function_call` items
  in a row) is one assistant message: reasoning as its reasoning_content (the reasoning_text
  parts, else the summary), text as content, calls as tool_calls; a `function_call_output` is a
  tool message. So a response's `output` sent back as input renders as its turn did.
- A reasoning item's `encrypted_content` (written with `include: ["reasoning.encrypted_content"]`,
  `openai_responses_format.seal`) is its reasoning, in place of its text: the token ids must be
  signed with this server's key for the served model (else a 400 naming
  `input.N.encrypted_content`). They are not re-tokenized: the reasoning_content handed to the
  chat format is a placeholder (`kvfold.chat.template.raw_placeholder`), and wherever the format
  writes it the prompt holds those ids verbatim (`ChatTemplate.prompt`'s `raw`), so the prompt
  has exactly the tokens the model produced, even ids no text encodes back to (a partial UTF-8
  character, which the tiny model writes). The text on either side is encoded on its own, as it
  is anyway where the format puts its markers around the reasoning (DeepSeek-V4: `</think>`
  after it), and with the byte tokenizer.
A chat-side refusal is reworded in the request's terms (`messages.3` -> `input.2`, ...).
"""
from __future__ import annotations

import re
from typing import Any, Callable

from .context import ServerContext
from ..chat.template import raw_placeholder
from .anthropic_format import ThinkingSigner
from .openai_responses_format import unseal
from .openai_responses_schemas import ResponsesRequest
from .routes import chat_ids
from .schemas import ApiError, ChatCompletionRequest, parse


def chat_messages(items: list[tuple[str, dict]], instructions: str | None,
                  unsealed: Callable[[str, str], str] | None = None) -> tuple[list[dict], list[str]]:
    """The chat messages of (path, item) pairs, and for each message the path it comes from;
    `unsealed(blob, param)`: an encrypted_content's reasoning text (None: refused)."""
    out: list[dict[str, Any]] = []
    origin: list[str] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
        origin.append("instructions")
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    for path, item in items:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            turn = None
            out.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
            origin.append(path)
            continue
        if kind == "function_call_output":
            turn = None
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            origin.append(path)
            continue
        # the assistant side: a new turn unless this item can follow what the open one holds
        if turn is None or not _continues(turn, kind):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
            origin.append(path)
        if kind == "reasoning" and item.get("encrypted_content") is not None:
            param = f"{path}.encrypted_content"
            if unsealed is None:
                raise ApiError(400, f"{param}: not accepted here", param=param)
            turn["reasoning_content"] = unsealed(item["encrypted_content"], param)
        elif kind == "reasoning":
            parts = item["content"] if item["content"] is not None else item["summary"]
            turn["reasoning_content"] = "".join(p["text"] for p in parts)
        elif kind == "message":
            turn["content"] += "".join(p["text"] for p in item["content"])
        else:
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"],
                "arguments": item["arguments"]}})
    return out, origin


def _continues(turn: dict[str, Any], kind: str) -> bool:
    """Whether an item of `kind` belongs to the open assistant turn: reasoning, then text, then
    calls, each at most once in that order."""
    if kind == "reasoning":
        return False if "reasoning_content" in turn or turn["content"] or "tool_calls" in turn else True
    if kind == "message":
        return not turn["content"] and "tool_calls" not in turn
    return True


def chat_body(ctx: ServerContext, req: ResponsesRequest, messages: list[dict]) -> dict[str, Any]:
    """The /v1/chat/completions body of the request (with its translated messages)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [t.chat() for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    fmt = req.text.format.response_format() if req.text is not None and req.text.format is not None else None
    if fmt is not None:
        body["response_format"] = fmt
    if req.logprobs is not None:
        body.update(logprobs=True, top_logprobs=req.logprobs)
    body.update(_reasoning(ctx, req))
    return body


def _reasoning(ctx: ServerContext, req: ResponsesRequest) -> dict[str, Any]:
    """Chat's reasoning fields for `reasoning.effort` (see the module docstring)."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return {}
    kind = ctx.template.kind if ctx.template is not None else "plain"
    on = effort != "none"
    if kind == "deepseek_v4":
        return {"reasoning_effort": effort, "chat_template_kwargs": {"thinking": on}}
    if kind == "jinja":
        return {"reasoning_effort": effort, "chat_template_kwargs": {"enable_thinking": on}}
    if on:
        raise ApiError(400, f"reasoning.effort {effort!r}: this model's chat format has no reasoning mode (only "
                       "\"none\" is accepted)", param="reasoning.effort")
    return {}  # "none" is what the plain template does anyway


def render(ctx: ServerContext, req: ResponsesRequest, items: list[tuple[str, dict]],
           signer: ThinkingSigner | None = None) -> tuple[ChatCompletionRequest, list[int], bool]:
    """(chat request, prompt ids, whether the prompt opens a reasoning block) of the request's
    conversation: `items` are (path, item) pairs, the earlier turns' first; `signer` checks
    reasoning items' encrypted_content (None: such an item is refused)."""
    raw: dict[str, list[int]] = {}

    def unsealed(blob: str, param: str) -> str:  # the ids stand in the text as a placeholder
        ids = unseal(signer, ctx.model_name, blob, param)
        key = raw_placeholder()
        raw[key] = ids
        return key
    messages, origin = chat_messages(items, req.instructions, unsealed if signer is not None else None)
    if not messages or all(m["role"] == "system" for m in messages):
        raise ApiError(400, "input: there is nothing to respond to (give input, or previous_response_id and input)",
                       param="input")
    with reworded(origin):
        chat = parse(ChatCompletionRequest, chat_body(ctx, req, messages))
        ids, reasoning = chat_ids(ctx, chat, raw)
    return chat, ids, reasoning


_CHAT_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
               ("reasoning_effort", "reasoning.effort"), ("chat_template_kwargs", "reasoning"),
               ("max_tokens", "max_output_tokens"))


class reworded:
    """A context in which a chat-side ApiError is re-raised in the Responses request's terms;
    `origin[i]` is where chat message i comes from."""

    def __init__(self, origin: list[str] | None = None):
        self.origin = origin or []

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, ApiError):
            raise ApiError(exc.status, self.text(exc.message), type=exc.type,
                           param=self.text(exc.param) if exc.param else None, code=exc.code) from None
        return False

    def text(self, text: str) -> str:
        origin = self.origin
        text = re.sub(r"\bmessages\.(\d+)(?:\.\w+)*",
                      lambda m: origin[int(m[1])] if int(m[1]) < len(origin) else m[0], text)
        text = re.sub(r"\btools\.(\d+)\.function\.", r"tools.\1.", text)
        text = re.sub(r"\btools\.(\d+)\.function\b", r"tools.\1", text)
        text = text.replace("tool_choice.function.name", "tool_choice.name")
        for chat, ours in _CHAT_NAMES:
            text = re.sub(rf"\b{chat}\b", ours, text)
        return text

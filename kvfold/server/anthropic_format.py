"""Anthropic Messages responses: the model's output, read by the chat format's parser
(`kvfold.chat.parsers`), as content blocks: a whole `message`, or the events of a streamed one.

- Reasoning becomes `thinking` blocks, content `text` blocks, tool calls `tool_use` blocks (id
  "toolu_" + the parser's random hex, `input` the parsed arguments object), in the order the
  parser emits them.
- A thinking block's `signature` is an HMAC-SHA256 of its text under a key of this server
  (`ThinkingSigner`), so a thinking block sent back in history is known to be one this server
  wrote, unaltered: Anthropic's signatures protect its thinking the same way. The key is random
  per server process unless $KVFOLD_THINKING_SECRET sets it (then signatures survive a restart
  and are shared by servers with the same secret).
- `stop_reason`: "max_tokens" when the token limit ended the output, "tool_use" when calls did,
  "stop_sequence" (with `stop_sequence`) when one of the request's stop sequences did, else
  "end_turn".
- `usage`: `input_tokens` are the prompt tokens not read from the prefix cache,
  `cache_read_input_tokens` those that were (Anthropic's split: the prompt is their sum),
  `cache_creation_input_tokens` always 0 (kvfold caches every prompt; nothing is billed).
- A stream is server-sent events with `event:` lines: message_start, ping, then per block
  content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta,
  signature_delta last in a thinking block) / content_block_stop, then message_delta (stop_reason,
  usage) and message_stop; a ping every PING_SECONDS while the engine is silent (a long prefill).
  message_start goes out before the prefill, so its usage counts the whole prompt as input; the
  cache split comes in message_delta, whose counts are the final ones.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
from typing import Any, AsyncIterator, Callable

from ..chat.parsers import Delta
from ..engine import RequestOutput
from ..engine.async_engine import RequestStream
from .formats import sse_json

SIGNATURE_PREFIX = "kvfold-hs256:"
PING_SECONDS = 10.0


class ThinkingSigner:
    """Signs thinking text and checks signatures, under one secret key."""

    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def for_server(cls) -> "ThinkingSigner":
        """$KVFOLD_THINKING_SECRET's key when set, else a random one (this process only)."""
        secret = os.environ.get("KVFOLD_THINKING_SECRET")
        return cls(secret.encode() if secret else secrets.token_bytes(32))

    def sign(self, thinking: str, domain: bytes = b"kvfold thinking") -> str:
        # the domain tag keeps these MACs apart from any other use of the same secret (the
        # Responses API's encrypted reasoning signs under its own domain with this key)
        mac = hmac.new(self._key, domain + b"\0" + thinking.encode("utf-8"), hashlib.sha256).digest()
        return SIGNATURE_PREFIX + base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")

    def verify(self, thinking: str, signature: str, domain: bytes = b"kvfold thinking") -> bool:
        # constant time: the time taken must not tell how much of a forged signature was right
        return hmac.compare_digest(self.sign(thinking, domain).encode(), signature.encode("utf-8"))


class BlockWriter:
    """Parser deltas -> content blocks (`blocks`), and the stream events that build them."""

    def __init__(self, signer: ThinkingSigner):
        self.signer = signer
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._input = ""  # the open tool_use block's input JSON so far

    def add(self, delta: Delta) -> list[tuple[str, dict]]:
        events = []
        if delta.reasoning:
            events += self._append("thinking", delta.reasoning)
        if delta.content:
            events += self._append("text", delta.content)
        for _, call_id, name, fragment in delta.tool_calls:
            if call_id is not None:  # a call's first fragment: its id and name
                events += self._start({"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"),
                                       "name": name, "input": {}})
            if fragment:
                self._input += fragment
                events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        """Close the open block: a thinking block gets its signature, a tool_use block its input."""
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        if block["type"] == "thinking":
            block["signature"] = self.signer.sign(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = _input_object(self._input)
            self._input = ""
        events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
        return events

    @property
    def calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _append(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._start({"type": "text", "text": ""} if kind == "text"
                                  else {"type": "thinking", "thinking": "", "signature": ""})
        self._open[kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict]]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": dict(block)})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def _input_object(text: str) -> dict[str, Any]:
    """A tool_use block's `input`: the parser's arguments JSON object; {} when the output ended
    inside a forced call, whose arguments (streamed as written) are then not complete JSON."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(last: RequestOutput | None, prompt_tokens: int) -> dict[str, int]:
    if last is None:  # nothing came back yet: the whole prompt, none of it known cached
        return {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}
    return {"input_tokens": last.prompt_tokens - last.cached_tokens, "output_tokens": last.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": last.cached_tokens}


def matched_stop(tokenizer: Any, ids: list[int], text: str, stops: list[str]) -> str | None:
    """The stop sequence that ended the output, if one did. The engine cuts the text before the
    first stop string it finds, so the decoding of all ids continues the text with it."""
    if not stops or tokenizer is None:
        return None
    rest = tokenizer.decode(ids)[len(text):]
    return next((s for s in stops if rest.startswith(s)), None) or next((s for s in stops if s in rest), None)


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event in Anthropic's framing (an `event:` line names it)."""
    return f"event: {name}\ndata: {sse_json(data)}\n\n"


class MessageFormat:
    """The bodies of one /v1/messages response: `whole` or the `events` of a stream."""

    def __init__(self, model: str, parser: Callable[[], Any], signer: ThinkingSigner, tokenizer: Any,
                 stops: list[str], prompt_tokens: int):
        self.id = "msg_" + secrets.token_hex(12)
        self.model, self.parser, self.signer = model, parser, signer
        self.tokenizer, self.stops, self.prompt_tokens = tokenizer, stops, prompt_tokens

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": use}

    def _stop(self, last: RequestOutput, calls: bool, ids: list[int], text: str) -> tuple[str, str | None]:
        if last.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        stop = matched_stop(self.tokenizer, ids, text, self.stops)
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        text, ids = "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids]
        parser, writer = self.parser(), BlockWriter(self.signer)
        for delta in (parser.feed(text, ids), parser.finish()):  # ids: the reasoning ends on the </think> token
            writer.add(delta)
        writer.close()
        reason, stop = self._stop(outs[-1], writer.calls, ids, text)
        return self._message(writer.blocks, reason, stop, usage(outs[-1], self.prompt_tokens))

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """The stream's events; the engine request is cancelled if the client goes away."""
        try:  # Starlette cancels this generator when the client disconnects: `finally` cancels the request
            yield event("message_start", {"type": "message_start",
                                          "message": self._message([], None, None, usage(None, self.prompt_tokens))})
            yield event("ping", {"type": "ping"})
            parser, writer, text, ids, last = self.parser(), BlockWriter(self.signer), [], [], None
            async for out in _with_pings(stream):
                if out is None:
                    yield event("ping", {"type": "ping"})
                    continue
                if out.finish_reason == "error":
                    yield event("error", {"type": "error", "error": {"type": "api_error",
                                                                     "message": out.error or "generation failed"}})
                    return
                text.append(out.new_text)
                ids += out.new_token_ids
                deltas = [parser.feed(out.new_text, out.new_token_ids)] + ([parser.finish()] if out.finished else [])
                for delta in deltas:
                    for name, data in writer.add(delta):
                        yield event(name, data)
                last = out
            if last is None:  # cancelled before any output: nobody reads on
                return
            for name, data in writer.close():
                yield event(name, data)
            reason, stop = self._stop(last, writer.calls, ids, "".join(text))
            yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                             "stop_sequence": stop},
                                          "usage": usage(last, self.prompt_tokens)})
            yield event("message_stop", {"type": "message_stop"})
        finally:
            stream.cancel()


async def _with_pings(stream: RequestStream) -> AsyncIterator[RequestOutput | None]:
    """The stream's outputs, with None whenever PING_SECONDS pass without one."""
    while not stream.finished:
        try:
            # the wait's timeout cancels only the queue read, which loses nothing
            yield await asyncio.wait_for(stream.__anext__(), PING_SECONDS)
        except asyncio.TimeoutError:
            yield None
        except StopAsyncIteration:
            return

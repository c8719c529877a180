"""Responses API output: the model's output, read by the chat format's parser
(`kvfold.chat.parsers`), as output items, and the stream events that build them.

- Reasoning becomes a `reasoning` item whose `content` holds the text (`reasoning_text`; its
  `summary` stays empty: kvfold shows the reasoning itself, it writes no summary), content a
  `message` item with one `output_text` part, each tool call a `function_call` item (`call_id`
  the parser's "call_..." id, `arguments` its JSON text), in the order the parser emits them;
  text after a call opens a new message item.
- `include: ["reasoning.encrypted_content"]` gives each reasoning item an `encrypted_content`
  (`seal`): the token ids the model produced in it and the served model's name, signed with the
  server's HMAC key (`ThinkingSigner`, $KVFOLD_THINKING_SECRET, under a domain of its own). A
  reasoning item's ids are those of the engine outputs up to and including the one whose text
  the parser gave as reasoning (tokens whose text it held back, a marker's first bytes, join the
  next reasoning text, or are dropped when text or a call comes, as the closing </think> is).
  They are sealed only when they decode to the item's text exactly; an item whose output also
  held text or a call (one engine output carrying both) gets none.
- Logprobs (when asked for) ride with the text delta of the engine output that carried their
  tokens; tokens whose text never reaches a message (reasoning, tool-call markup) have none in
  the output, and the ones left when a message closes (its end-of-turn token) join it.
- `usage.output_tokens_details.reasoning_tokens`: the tokens decoded while the output was still
  in its reasoning (until the first text or call), counted per engine output.
- Events: output_item.added, content_part.added, output_text.delta (reasoning_text.delta for
  reasoning), output_text.done, content_part.done, function_call_arguments.delta / .done,
  output_item.done; the route numbers them (`sequence_number`) and adds the lifecycle events.
"""
from __future__ import annotations

import base64
import copy
import json
from typing import Any, Callable

from ..chat.parsers import Delta
from ..engine import RequestOutput
from .anthropic_format import ThinkingSigner
from .openai_responses_schemas import ResponsesRequest, new_id
from .schemas import ApiError

ENCRYPTED_PREFIX = "kvfold-rs1"
ENCRYPTED_DOMAIN = b"kvfold responses reasoning"


def seal(signer: ThinkingSigner, model: str, ids: list[int]) -> str:
    """A reasoning item's `encrypted_content`: its token ids and the model's name, signed (not
    secret: the ids are the reasoning the response shows anyway, the signature makes them
    unforgeable)."""
    payload = base64.urlsafe_b64encode(json.dumps({"model": model, "ids": [int(i) for i in ids]},
                                                  separators=(",", ":")).encode()).decode("ascii").rstrip("=")
    return f"{ENCRYPTED_PREFIX}.{payload}.{signer.sign(payload, ENCRYPTED_DOMAIN)}"


def unseal(signer: ThinkingSigner, model: str, blob: str, param: str) -> list[int]:
    """The token ids of an `encrypted_content` this server's key signed for `model`; anything else
    (not kvfold's, tampered with, signed with another key or for another model) is a 400 naming
    `param`."""
    parts = blob.split(".") if isinstance(blob, str) else []
    if len(parts) != 3 or parts[0] != ENCRYPTED_PREFIX:
        raise ApiError(400, f"{param}: not an encrypted_content written by kvfold", param=param)
    if not signer.verify(parts[1], parts[2], ENCRYPTED_DOMAIN):
        raise ApiError(400, f"{param}: its signature does not verify (altered, or signed by a server with another "
                       "key: see $KVFOLD_THINKING_SECRET)", param=param)
    try:
        body = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        made_by, ids = body["model"], body["ids"]
        assert isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    except Exception:
        raise ApiError(400, f"{param}: malformed encrypted_content", param=param) from None
    if made_by != model:
        raise ApiError(400, f"{param}: this reasoning was written by model {made_by!r}; this server serves {model!r}",
                       param=param)
    return ids


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token]) if tokenizer is not None else ""
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def logprob_entries(tokenizer: Any, out: RequestOutput) -> list[dict[str, Any]]:
    return [{**_entry(tokenizer, e.token, e.logprob), "top_logprobs": [_entry(tokenizer, t, v) for t, v in e.top]}
            for e in out.logprobs or []]


class OutputWriter:
    """Parser deltas of one response -> its output items (`items`) and the events building them."""

    def __init__(self, tokenizer: Any, logprobs: bool, in_reasoning: bool, split_name=None,
                 seal: Callable[[list[int]], str] | None = None):
        """`seal`: ids -> a reasoning item's encrypted_content (None: items get none)."""
        self.tokenizer, self.logprobs, self.seal = tokenizer, logprobs, seal
        self._ids: dict[str, list[int] | None] = {}  # reasoning item id -> its token ids (None: not exact)
        self._unclaimed: list[int] = []  # ids whose text no delta has given yet
        # a called name -> (namespace or None, name): a `namespace` tool's function is NAMESPACE.NAME
        self.split_name = split_name or (lambda name: (None, name))
        self.items: list[dict[str, Any]] = []
        self.reasoning_tokens = 0
        self._open: dict[str, Any] | None = None
        self._thinking = in_reasoning  # still in the output's reasoning (for reasoning_tokens)
        self._answered = False  # text or a call came: later reasoning is not the output's reasoning
        self._pending: list[dict[str, Any]] = []  # logprobs not yet given with text

    def add(self, out: RequestOutput, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The events of one engine output, parsed into `deltas`."""
        if self.logprobs:
            self._pending += logprob_entries(self.tokenizer, out)
        events: list[dict[str, Any]] = []
        self._unclaimed += out.new_token_ids
        for delta in deltas:
            if delta.reasoning:
                self._thinking = not self._answered
                events += self._text("reasoning", delta.reasoning)
                self._claim(delta)
            elif delta.content or delta.tool_calls:
                self._unclaimed = []
            if delta.content:
                events += self._text("message", delta.content)
            for _, call_id, name, fragment in delta.tool_calls:
                if call_id is not None:
                    namespace, name = self.split_name(name)
                    events += self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                           "call_id": call_id, "name": name, "arguments": "",
                                           **({"namespace": namespace} if namespace else {})})
                if fragment:
                    self._open["arguments"] += fragment
                    events.append(self._event("response.function_call_arguments.delta", delta=fragment))
        if any(d.content or d.tool_calls for d in deltas):
            self._thinking, self._answered = False, True
        elif self._thinking:
            self.reasoning_tokens += len(out.new_token_ids)
        return events

    def _claim(self, delta: Delta) -> None:
        """The unclaimed ids are the open reasoning item's; a delta that also holds text or calls
        leaves its ids unsplittable: the item gets no encrypted_content."""
        ids = self._ids.setdefault(self._open["id"], [])
        if ids is not None:
            self._ids[self._open["id"]] = None if delta.content or delta.tool_calls else ids + self._unclaimed
        self._unclaimed = []

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item (`status`: its final status, "incomplete" when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        events = []
        if item["type"] == "reasoning" and self.seal is not None:
            ids = self._ids.get(item["id"])
            if ids is not None and self.tokenizer is not None and \
                    self.tokenizer.decode(ids) == item["content"][0]["text"]:
                item["encrypted_content"] = self.seal(ids)
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message" and self.logprobs:
                part["logprobs"] += self._pending
                self._pending = []
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._event(done, item, content_index=0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item, content_index=0, part=part))
        if "status" in item:
            item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message" \
                else {"type": "reasoning_text", "text": ""}
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []} if kind == "message" else {"id": new_id("rs"), "type": "reasoning",
                                                               "summary": [], "content": []}
            events += self._start(item)
            item["content"].append(part)
            events.append(self._event("response.content_part.added", content_index=0, part=copy.deepcopy(part)))
        part = self._open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            self._pending = []  # reasoning tokens carry no logprobs in the output
            return events + [self._event("response.reasoning_text.delta", content_index=0, delta=text)]
        given, self._pending = self._pending, []
        if self.logprobs:
            part["logprobs"] += given
        return events + [self._event("response.output_text.delta", content_index=0, delta=text,
                                     logprobs=given if self.logprobs else [])]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        if item["type"] == "function_call":
            self._pending = []
        self.items.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                          "item": copy.deepcopy(item)}]

    def _event(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        item = self._open if item is None else item
        return {"type": kind, "item_id": item["id"], "output_index": self.items.index(item), **fields}


def usage(last: RequestOutput | None, prompt_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; before any output, the whole prompt and nothing cached."""
    prompt = last.prompt_tokens if last is not None else prompt_tokens
    cached = last.cached_tokens if last is not None else 0
    output = last.completion_tokens if last is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": prompt + output}


def response_object(req: ResponsesRequest, rid: str, created_at: int, model: str, *, status: str,
                    output: list[dict], usage: dict | None, error: dict | None = None,
                    completed_at: int | None = None) -> dict[str, Any]:
    """The response object as OpenAI writes it, echoing the request's settings."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    tc = req.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status,
        "background": bool(req.background), "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": model, "output": copy.deepcopy(output),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "service_tier": "default", "store": req.stores,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": tc if isinstance(tc, str) else {"type": "function", "name": tc.name} if tc else "auto",
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": t.strict} for t in req.tools or ()],
        "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
        "completed_at": completed_at,
    }

"""The JSON bodies of the two generation endpoints: a whole response, and the chunks of a streamed one.

kvfold extension: with `token_ids` set (the request's `"return_token_ids": true`) each choice also
carries `token_ids`: all generated ids in a whole response, the ids new in that chunk in a stream.
A completion with a batch of prompts has n choices per prompt: choice `index` is prompt
index // n, its (index % n)-th choice.

Logprobs take OpenAI's shapes: a chat choice's `logprobs.content` lists `{token, logprob, bytes,
top_logprobs}` per token; a completion choice's `logprobs` holds the parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (token text -> logprob) and `text_offset` (where each token's
text starts in the choice's text), the echoed prompt's tokens first (the very first has no
logprob: null). A token's text is its own decoding, so a token that holds part of a UTF-8
character reads as U+FFFD (`bytes` then are that text's UTF-8, as vLLM gives them).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from ..decoding.logits import TokenLogprob
from ..engine import RequestOutput


# characters JSON leaves raw that line readers split on (str.splitlines: NEL, LINE and PARAGRAPH
# SEPARATOR; the C0 ones JSON escapes already): escaped, so an event's data is one line to any client
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(obj: Any) -> str:
    """`obj` as one line of JSON for a server-sent event's data: UTF-8 text kept as it is, except
    the line separators a client's line reader might split on."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)


def usage_of(lasts: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's `usage` object for finished requests (the last output of each), summed over them."""
    prompt, completion = sum(o.prompt_tokens for o in lasts), sum(o.completion_tokens for o in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in lasts)}}


class ResponseFormat:
    """Builds the JSON bodies of one response kind. A response has one choice per prompt: `whole`
    takes each choice's outputs in index order, `chunk` one output and its choice's index."""
    object_whole = object_chunk = prefix = ""

    def __init__(self, model_name: str, token_ids: bool, tokenizer: Any = None, logprobs: bool = False):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.token_ids = token_ids
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # whether choices carry logprobs (the outputs hold them)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""

    def _envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def first_chunk(self) -> dict | None:
        return None

    def usage_chunk(self, lasts: list[RequestOutput]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage_of(lasts))

    def _choice(self, out_choice: dict, ids: list[int]) -> dict:
        if self.token_ids:
            out_choice["token_ids"] = ids
        return out_choice

    def chunk(self, out: RequestOutput, index: int = 0) -> dict[str, Any] | None:
        """The chunk of one output, or None when it has nothing to say (no text, delta, logprobs,
        token ids or finish): a tool call held back until it is complete sends no chunk per token."""
        choice = self._choice(self._chunk_choice(out, index), out.new_token_ids)
        if not any(choice.get(k) for k in ("text", "delta", "logprobs", "finish_reason", "token_ids")):
            return None
        return self._envelope(self.object_chunk, [choice])

    def whole(self, outs_by_choice: list[list[RequestOutput]]) -> dict[str, Any]:
        choices = [self._choice(self._whole_choice(outs, i), [t for o in outs for t in o.new_token_ids])
                   for i, outs in enumerate(outs_by_choice)]
        return self._envelope(self.object_whole, choices, usage_of([outs[-1] for outs in outs_by_choice]))

    def _chunk_choice(self, out: RequestOutput, index: int) -> dict:
        raise NotImplementedError

    def _whole_choice(self, outs: list[RequestOutput], index: int) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def __init__(self, model_name: str, token_ids: bool, tokenizer: Any = None, logprobs: bool = False,
                 echo: list[str] | None = None, first_ids: list[int] | None = None):
        """`echo`: each choice's prompt text, to put before its completion (None: no echo);
        `first_ids`: each choice's first prompt id (the echoed logprobs name it, with null)."""
        super().__init__(model_name, token_ids, tokenizer, logprobs)
        self.echo = echo
        self.first_ids = first_ids or []
        self._offset: dict[int, int] = {}  # characters of each choice's text so far (text_offset)
        self._echoed: set[int] = set()  # streamed choices whose prompt text went out

    def _logprobs(self, outs: list[RequestOutput], index: int) -> dict | None:
        """OpenAI's completion logprobs of these outputs, the echoed prompt's first."""
        if not self.logprobs:
            return None
        entries: list[TokenLogprob | None] = []
        for o in outs:
            if o.prompt_logprobs is not None and self.echo is not None:
                entries += o.prompt_logprobs  # None first: nothing predicts the first prompt token
            entries += o.logprobs or []
        lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offset.get(index, 0)
        for e in entries:
            text = self.token_text(self.first_ids[index] if e is None else e.token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(None if e is None else e.logprob)
            lp["top_logprobs"].append(None if e is None else {self.token_text(t): v for t, v in e.top})
            lp["text_offset"].append(offset)
            offset += len(text)
        self._offset[index] = offset
        return lp

    def _chunk_choice(self, out: RequestOutput, index: int) -> dict:
        echo = ""
        if self.echo is not None and index not in self._echoed:  # the prompt goes before the first text
            self._echoed.add(index)
            echo = self.echo[index]
        logprobs = self._logprobs([out], index)
        return {"index": index, "text": echo + out.new_text, "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None}

    def _whole_choice(self, outs: list[RequestOutput], index: int) -> dict:
        text = (self.echo[index] if self.echo is not None else "") + "".join(o.new_text for o in outs)
        return {"index": index, "text": text, "logprobs": self._logprobs(outs, index),
                "finish_reason": outs[-1].finish_reason}


class ChatFormat(ResponseFormat):
    """Chat bodies. With `parser` (a factory of `kvfold.chat.parsers.OutputParser`, one per
    choice) the text is read back as the model's format writes it: `reasoning_content`, then
    `content`, then `tool_calls` (and finish_reason "tool_calls" when calls ended the turn),
    streamed as vLLM streams them: each call's id and name in its first delta, its arguments'
    JSON text in fragments after."""
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, model_name: str, token_ids: bool, tokenizer: Any = None, logprobs: bool = False,
                 choices: int = 1, parser: Callable[[], Any] | None = None):
        super().__init__(model_name, token_ids, tokenizer, logprobs)
        self.choices = choices
        self.parser = parser
        self._parsers: dict[int, Any] = {}  # streamed choices' parsers

    def first_chunk(self) -> dict | None:
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(self.choices)]
        return self._envelope(self.object_chunk, choices)

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, outs: list[RequestOutput]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [{**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, v) for t, v in e.top]}
                            for o in outs for e in (o.logprobs or [])], "refusal": None}

    @staticmethod
    def _finish_reason(reason: str | None, calls: bool) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def _chunk_choice(self, out: RequestOutput, index: int) -> dict:
        finish = out.finish_reason if out.finished else None
        if self.parser is None:
            delta = {"content": out.new_text} if out.new_text else {}
            return {"index": index, "delta": delta, "logprobs": self._logprobs([out]), "finish_reason": finish}
        parser = self._parsers.setdefault(index, self.parser())
        # with the ids: the reasoning ends on the </think> token, where structured output starts
        parts = [parser.feed(out.new_text, out.new_token_ids)] + ([parser.finish()] if out.finished else [])
        delta: dict[str, Any] = {}
        reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        calls = [_call_delta(*c) for p in parts for c in p.tool_calls]
        if calls:
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": self._logprobs([out]),
                "finish_reason": self._finish_reason(finish, bool(parser.tool_calls))}

    def _whole_choice(self, outs: list[RequestOutput], index: int) -> dict:
        text = "".join(o.new_text for o in outs)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = []
        if self.parser is not None:
            parser = self.parser()
            parts = [parser.feed(text, [t for o in outs for t in o.new_token_ids]), parser.finish()]
            reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
            calls = parser.tool_calls
            message["content"] = content if content or not calls else None
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(outs),
                "finish_reason": self._finish_reason(outs[-1].finish_reason, bool(calls))}


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    """One streamed tool-call fragment, in OpenAI's delta shape."""
    d: dict[str, Any] = {"index": index}
    if call_id is not None:
        d.update(id=call_id, type="function")
    fn: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        fn = {"name": name, **fn}
    d["function"] = fn
    return d

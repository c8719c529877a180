"""The JSON bodies of the two generation endpoints: a whole response, and the chunks of a streamed one.

kvfold extension: with `token_ids` set (the request's `"return_token_ids": true`) each choice also
carries `token_ids`: all generated ids in a whole response, the ids new in that chunk in a stream.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from ..engine import RequestOutput


def usage_of(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's `usage` object for a finished request (its last output)."""
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


class ResponseFormat:
    """Builds the JSON bodies of one response kind."""
    object_whole = object_chunk = prefix = ""

    def __init__(self, model_name: str, token_ids: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.token_ids = token_ids

    def _envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def first_chunk(self) -> dict | None:
        return None

    def usage_chunk(self, last: RequestOutput) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage_of(last))

    def _choice(self, out_choice: dict, ids: list[int]) -> dict:
        if self.token_ids:
            out_choice["token_ids"] = ids
        return out_choice

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        choice = {"index": 0, "text": out.new_text, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._envelope(self.object_chunk, [self._choice(choice, out.new_token_ids)])

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        ids = [t for o in outs for t in o.new_token_ids]
        choice = {"index": 0, "text": "".join(o.new_text for o in outs), "logprobs": None,
                  "finish_reason": outs[-1].finish_reason}
        return self._envelope(self.object_whole, [self._choice(choice, ids)], usage_of(outs[-1]))


class ChatFormat(ResponseFormat):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def first_chunk(self) -> dict | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.object_chunk, [choice])

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        delta = {"content": out.new_text} if out.new_text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._envelope(self.object_chunk, [self._choice(choice, out.new_token_ids)])

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        ids = [t for o in outs for t in o.new_token_ids]
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
                  "logprobs": None, "finish_reason": outs[-1].finish_reason}
        return self._envelope(self.object_whole, [self._choice(choice, ids)], usage_of(outs[-1]))

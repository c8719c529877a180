"""The JSON bodies of the two generation endpoints: a whole response, and the chunks of a streamed one.

kvfold extension: with `token_ids` set (the request's `"return_token_ids": true`) each choice also
carries `token_ids`: all generated ids in a whole response, the ids new in that chunk in a stream.
A completion with a batch of prompts has one choice per prompt, `index` its place in the batch.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from ..engine import RequestOutput


def usage_of(lasts: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's `usage` object for finished requests (the last output of each), summed over them."""
    prompt, completion = sum(o.prompt_tokens for o in lasts), sum(o.completion_tokens for o in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in lasts)}}


class ResponseFormat:
    """Builds the JSON bodies of one response kind. A response has one choice per prompt: `whole`
    takes each choice's outputs in index order, `chunk` one output and its choice's index."""
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

    def usage_chunk(self, lasts: list[RequestOutput]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage_of(lasts))

    def _choice(self, out_choice: dict, ids: list[int]) -> dict:
        if self.token_ids:
            out_choice["token_ids"] = ids
        return out_choice

    def chunk(self, out: RequestOutput, index: int = 0) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._choice(self._chunk_choice(out, index), out.new_token_ids)])

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

    def _chunk_choice(self, out: RequestOutput, index: int) -> dict:
        return {"index": index, "text": out.new_text, "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None}

    def _whole_choice(self, outs: list[RequestOutput], index: int) -> dict:
        return {"index": index, "text": "".join(o.new_text for o in outs), "logprobs": None,
                "finish_reason": outs[-1].finish_reason}


class ChatFormat(ResponseFormat):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def first_chunk(self) -> dict | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.object_chunk, [choice])

    def _chunk_choice(self, out: RequestOutput, index: int) -> dict:
        return {"index": index, "delta": {"content": out.new_text} if out.new_text else {}, "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None}

    def _whole_choice(self, outs: list[RequestOutput], index: int) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
                "logprobs": None, "finish_reason": outs[-1].finish_reason}

"""One request inside the engine: its prompt, sampling parameters, state, output and stop rules."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from ..decoding.sampling import SamplingArgumentError, check_sampling
from ..errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How one request chooses and stops. Defaults: greedy, 16 tokens, the model's EOS ids.

    `stop_token_ids=None` stops at the model's EOS ids (as `kvfold.generate` does); `[]` never
    stops early. `stop` strings end the text before the first match (the match is not returned).
    """
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Seq[int] | None = None
    stop: Seq[str] = ()

    def validate(self) -> None:
        """Refuse out-of-range fields (InvalidRequestError); the rules are decoding's `check_sampling`."""
        # a lone string would otherwise stop on each of its characters
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                           stop_ids=self.stop_token_ids, stop=self.stop, names={"stop_ids": "stop_token_ids"})
        except SamplingArgumentError as exc:
            raise InvalidRequestError(str(exc)) from None


class Status(enum.Enum):
    WAITING = "waiting"  # queued; no state allocated yet
    RUNNING = "running"  # has a state; prefilling while state.pos < len(prompt), then decoding
    FINISHED = "finished"  # state freed


@dataclass
class RequestOutput:
    """What one `Engine.step()` produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str  # text that became final this step (stop strings and their possible starts held back)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" when finished
    prompt_tokens: int
    completion_tokens: int  # generated so far, stop token included
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    error: str | None = None  # message when finish_reason == "error"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    tokenizer: Any  # None: the model has no tokenizer, so no text (and no stop strings)
    status: Status = Status.WAITING
    state: Any = None
    state_bytes: int = 0  # nbytes of `state` while it is held
    cached_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache key of each whole prompt block
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    _text: str = ""  # all text decoded so far
    _sent: int = 0  # characters of _text already returned
    _pending: list[int] = field(default_factory=list)  # ids chosen since the last output

    def __post_init__(self) -> None:
        # Per-request generator, seeded like kvfold.generate, so a seed gives the same tokens alone or batched.
        self.generator = torch.Generator(device="cpu")
        if self.params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.params.seed)
        self._decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        self._max_stop = max((len(s) for s in self.params.stop), default=0)

    # ---- position ----------------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self.state.pos < len(self.prompt)

    @property
    def capacity(self) -> int:
        """Positions the state needs: the prompt plus every generated token but the last (never fed)."""
        return len(self.prompt) + self.params.max_tokens

    def next_input(self, chunk: int) -> list[int]:
        """Ids to feed this step: the prompt up to the next multiple of `chunk` (so chunk boundaries
        never depend on scheduling and a prefix-cache restore continues exactly like a cold run),
        or, once prefilled, the last chosen token."""
        pos = self.state.pos
        if pos < len(self.prompt):
            return self.prompt[pos:min(len(self.prompt), (pos // chunk + 1) * chunk)]
        return [self.output[-1]]

    # ---- output ------------------------------------------------------------------------------
    def append_token(self, tok: int) -> None:
        """Record one chosen id and apply the stop rules (stop id, stop string, max_tokens)."""
        self.output.append(tok)
        self._pending.append(tok)
        if self._decoder is not None:
            self._text += self._decoder.push(tok)
        if self._find_stop():
            self.finish_reason = "stop"
            return  # the text ends before the stop string: nothing after it may be flushed in
        if tok in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and self._decoder is not None:
            self._text += self._decoder.flush()  # an unfinished character becomes U+FFFD
            self._find_stop()

    def _find_stop(self) -> bool:
        """Cut the text at the first stop string; True when one was found."""
        if not self._max_stop:
            return False
        start = max(0, self._sent - self._max_stop)  # earlier text was already checked
        hits = [i for i in (self._text.find(s, start) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self._text = self._text[:min(hits)]
        return True

    def _holdback(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        for k in range(min(self._max_stop - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self.params.stop):
                return k
        return 0

    def take_output(self) -> RequestOutput:
        finished = self.finish_reason is not None
        end = len(self._text) if finished else len(self._text) - self._holdback()
        end = max(end, self._sent)
        text, self._sent = self._text[self._sent:end], end
        new, self._pending = self._pending, []
        return RequestOutput(self.request_id, new, text, finished, self.finish_reason, len(self.prompt),
                             len(self.output), self.cached_tokens, self.error)

    def release(self) -> None:
        """Free the state now (finished or cancelled); idempotent."""
        if self.state is not None:
            self.state.free()
            self.state = None
        self.state_bytes = 0
        self.status = Status.FINISHED

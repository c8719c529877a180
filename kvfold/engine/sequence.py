"""One request inside the engine: its prompt, sampling parameters, state, output and stop rules."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence as Seq

import torch

from ..decoding.grammar import GrammarMatcher
from ..decoding.logits import Sampler, SamplingRule, TokenLogprob, token_logprobs
from ..decoding.sampling import SamplingArgumentError, check_sampling
from ..decoding.speculative import verify_drafts
from ..errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How one request chooses and stops. Defaults: greedy, 16 tokens, stop at the model's EOS ids.

    As vLLM defines them: `stop_token_ids` end the choice in addition to the EOS ids, which
    `ignore_eos` drops; neither ends it before `min_tokens` tokens (they are masked until then).
    `stop` strings end the text before the first match (the match is not returned). `top_k`,
    `min_p`, the penalties and `logit_bias` shape each choice (`kvfold.decoding.logits`).
    `logprobs` (None: none) adds to each generated token its logprob and that many most likely
    alternatives; `prompt_logprobs` the same for the prompt's tokens (such a request never reads
    the prefix cache, whose hits skip the prompt's logits). `grammar`: a
    `kvfold.decoding.grammar.GrammarSpec` the output must follow, from the first token after the
    ids `grammar_after` (e.g. the end of the reasoning, "</think>"), or from the start.
    """
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Seq[int] | None = None
    stop: Seq[str] = ()
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Any = None
    grammar_after: Seq[int] = ()

    MAX_LOGPROBS: ClassVar[int] = 20  # OpenAI's most top_logprobs

    def validate(self, vocab_size: int | None = None) -> None:
        """Refuse out-of-range fields (InvalidRequestError); the rules are decoding's `check_sampling`."""
        # a lone string would otherwise stop on each of its characters
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                           stop_ids=self.stop_token_ids, stop=self.stop, names={"stop_ids": "stop_token_ids"},
                           top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
                           frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                           logit_bias=self.logit_bias, min_tokens=self.min_tokens, vocab_size=vocab_size)
        except SamplingArgumentError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", param="ignore_eos")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= self.MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be None or an int in [0, {self.MAX_LOGPROBS}], got {v!r}",
                                          param=name)

    def rule(self) -> SamplingRule:
        return SamplingRule(self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalty,
                            self.frequency_penalty, self.repetition_penalty, self.logit_bias, self.min_tokens)


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
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    # the prompt's, in the request's first output only: None for the first token (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    grammar: Any = None  # the compiled grammar of params.grammar, or None
    # n > 1: the choices after the first wait in `followers` of the first (their `leader`) until its
    # prefill ends, then start from a copy of its state, sharing its pages
    leader: "Sequence | None" = None
    followers: list["Sequence"] = field(default_factory=list)
    ghost: bool = False  # a cancelled leader that still prefills for its followers (no output)
    checkpoint: Any = None  # its exact starting point and/or the one to capture (engine/checkpoint.py)
    # prompt positions [a, b) fed one token a model call, as decoding fed them: the earlier outputs
    # of a conversation kvfold produced, which this prompt continues (transcripts.py)
    decode_spans: tuple[tuple[int, int], ...] = ()
    prompt_logprobs: list[TokenLogprob | None] | None = None
    drafter: Any = None  # its own drafter under speculative decoding (speculation.py)
    acceptance: Any = None  # its drafts' measured acceptance (decoding/draft_length.py)
    drafts: list[int] = field(default_factory=list)  # this step's drafts after the last token
    draft_probs: Any = None  # their probability rows (None: a deterministic drafter)
    _text: str = ""  # all text decoded so far
    _sent: int = 0  # characters of _text already returned
    _pending: list[int] = field(default_factory=list)  # ids chosen since the last output
    _pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    _stops_from: int = 0  # a stop string must end after this much text (the text of the first min_tokens ids)
    _prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        # Per-request generator, seeded like kvfold.generate, so a seed gives the same tokens alone or batched.
        self.generator = torch.Generator(device="cpu")
        if self.params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.params.seed)
        matcher = None if self.grammar is None else GrammarMatcher(self.grammar, start_after=self.params.grammar_after)
        self.sampler = Sampler(self.params.rule(), prompt=self.prompt, stop_ids=sorted(self.stop_ids),
                               generator=self.generator, grammar=matcher)
        self._decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        self._max_stop = max((len(s) for s in self.params.stop), default=0)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def width(self) -> int:
        """Sequences this one stands for in the scheduler: itself and its unforked followers."""
        return 1 + len(self.followers)

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
        one token inside a decode span and never across a span's start, or, once prefilled, the
        last chosen token."""
        pos = self.state.pos
        if pos < len(self.prompt):
            end = min(len(self.prompt), (pos // chunk + 1) * chunk)
            for a, b in self.decode_spans:
                if a <= pos < b:
                    return self.prompt[pos:pos + 1]
                if pos < a < end:
                    end = a
            return self.prompt[pos:end]
        return [self.output[-1]]

    # ---- output ------------------------------------------------------------------------------
    def record_prompt_logprobs(self, start: int, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that the rows of a prefill chunk from `start` predict
        (row j predicts position start + j + 1)."""
        targets = self.prompt[start + 1:start + 1 + logits.shape[0]]
        self.prompt_logprobs += token_logprobs(logits[:len(targets)], targets, self.params.prompt_logprobs)

    def choose(self, logits_row: torch.Tensor) -> None:
        """Choose the next id from the last row's logits, with its logprobs if asked, and record it."""
        tok = self.sampler.choose(logits_row, self.output)
        self.sampler.accept(tok)
        if self.params.logprobs is not None:
            self._pending_logprobs += token_logprobs(logits_row[None], [tok], self.params.logprobs)
        self.append_token(tok, complete=self.sampler.finished)

    def choose_verified(self, logits: torch.Tensor, drafts: list[int], draft_probs) -> tuple[int, int]:
        """Accept a prefix of `drafts` against the verify rows [len(drafts) + 1, vocab] with this
        request's own rule (decoding/speculative.py `verify_drafts`), then record the accepted drafts
        and the main model's next token one at a time, as `choose` would, each with its logprobs
        from its own row, until a stop rule ends the output. Returns (drafts accepted, ids recorded)."""
        n, nxt = verify_drafts(logits, drafts, draft_probs, self.sampler, self.output)
        if nxt is not None:
            self.sampler.accept(nxt)
        new = drafts[:n] + ([] if nxt is None else [nxt])
        for i, tok in enumerate(new):
            if self.params.logprobs is not None:
                self._pending_logprobs += token_logprobs(logits[i:i + 1], [tok], self.params.logprobs)
            self.append_token(tok, complete=i == len(new) - 1 and self.sampler.finished)
            if self.finish_reason is not None:
                return n, i + 1
        return n, len(new)

    def append_token(self, tok: int, complete: bool = False) -> None:
        """Record one chosen id and apply the stop rules (stop id, stop string, max_tokens, and
        `complete`: the grammar reached its end). As in vLLM, a stop string counts only where it
        ends in text of the ids after `min_tokens`."""
        self.output.append(tok)
        self._pending.append(tok)
        if self._decoder is not None:
            self._text += self._decoder.push(tok)
        if len(self.output) < self.params.min_tokens and not complete:
            self._stops_from = len(self._text)
            return
        if self._find_stop():
            self.finish_reason = "stop"
            return  # the text ends before the stop string: nothing after it may be flushed in
        if tok in self.stop_ids or complete:
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
        hits = [i for i in (self._text.find(s, max(start, self._stops_from - len(s) + 1)) for s in self.params.stop)
                if i >= 0]
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
        logprobs, self._pending_logprobs = (self._pending_logprobs, []) if self.params.logprobs is not None \
            else (None, [])
        prompt_lp = None
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt_lp, self._prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(self.request_id, new, text, finished, self.finish_reason, len(self.prompt),
                             len(self.output), self.cached_tokens, self.error, logprobs, prompt_lp)

    def close_drafter(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self.drafts, self.draft_probs = [], None

    def release(self) -> None:
        """Free the state (and the drafter's) now (finished or cancelled); idempotent."""
        self.close_drafter()
        if self.state is not None:
            self.state.free()
            self.state = None
        self.state_bytes = 0
        self.status = Status.FINISHED

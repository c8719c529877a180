"""From the model's logits to one request's choice: the request's processing of the logits
(bias, minimum length, grammar, penalties), the `Sampler` that applies it and then chooses, and
the logprobs a client asks for.

The order is vLLM's: logit_bias, then the grammar's mask, then min_tokens (the stop ids are
masked until that many tokens are out, unless nothing else is left: a grammar that must end
ends), then the repetition, frequency and presence penalties (masks commute, so the order of
the first three changes nothing else); greedy takes the argmax of the result, sampling divides it by the temperature and
cuts it with min_p, top_k and top_p (`sampling.nucleus`). Penalties are vLLM's:
repetition_penalty divides a positive logit (multiplies a negative one) of every token seen in
the prompt or the output; frequency_penalty subtracts the token's count in the output times the
penalty, presence_penalty the penalty once if the token is in the output.

Logprobs are the log-softmax of the model's raw logits, before any of this (vLLM's default,
"raw_logprobs"): what the model says, whatever the request did to choose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .sampling import cpu_logits, draw, greedy, nucleus, sampling_probs


@dataclass(frozen=True)
class SamplingRule:
    """How one request turns logits into a token (defaults: greedy, nothing changed)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0  # the stop ids cannot be chosen before this many tokens are out

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Sampler:
    """One request's choice rule over its own history: the prompt, and the tokens chosen so far
    (given to each call, so a speculative verify can ask about any draft prefix). `grammar`, a
    `grammar.GrammarMatcher`, masks what it does not allow and advances on `accept`."""

    def __init__(self, rule: SamplingRule, *, prompt: Sequence[int] = (), stop_ids: Sequence[int] = (),
                 generator: torch.Generator | None = None, grammar: Any = None):
        self.rule = rule
        self.generator = generator
        self.grammar = grammar
        self._prompt = [int(t) for t in prompt] if rule.repetition_penalty != 1 else []
        self._stop_ids = torch.tensor(sorted({int(t) for t in stop_ids}), dtype=torch.long)
        bias = dict(rule.logit_bias or {})
        self._bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self._bias = torch.tensor(list(bias.values()), dtype=torch.float32)

    @property
    def plain(self) -> bool:
        """True when the logits reach the choice unchanged (no bias, penalty, minimum or grammar)."""
        r = self.rule
        return not (r.logit_bias or r.min_tokens or r.penalised or self.grammar is not None)

    def process(self, logits_1d: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
        """The logits this request chooses from after `output` (float32, on the CPU)."""
        x = cpu_logits(logits_1d)
        if self.plain:
            return x
        x = x.clone()
        if self._bias_ids.numel():
            x[self._bias_ids] += self._bias
        if self.grammar is not None:
            self.grammar.mask_(x)
        if len(output) < self.rule.min_tokens and self._stop_ids.numel():
            held = x[self._stop_ids].clone()
            x[self._stop_ids] = float("-inf")
            if not bool((x > float("-inf")).any()):  # a grammar that must end now: min_tokens yields
                x[self._stop_ids] = held
        if self.rule.penalised:
            x = apply_penalties(x, self._prompt, output, self.rule)
        return x

    def choose(self, logits_1d: torch.Tensor, output: Sequence[int]) -> int:
        """The next token after `output` (greedy at temperature 0, else drawn with the generator).
        It does not advance the grammar: `accept` the token the caller keeps."""
        x = self.process(logits_1d, output)
        r = self.rule
        if r.temperature == 0.0:
            return greedy(x)
        ids, probs = nucleus(x, r.temperature, r.top_p, r.top_k, r.min_p)
        return int(ids[draw(probs, self.generator)])

    def probs(self, logits_1d: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
        """The float64 distribution `choose` draws from after `output` (sampling only)."""
        r = self.rule
        return sampling_probs(self.process(logits_1d, output), r.temperature, r.top_p, r.top_k, r.min_p)

    def accept(self, token: int) -> None:
        """Record that `token` was emitted: the grammar moves past it."""
        if self.grammar is not None:
            self.grammar.accept(int(token))

    @property
    def finished(self) -> bool:
        """True once the grammar has reached its end: the output is complete, whatever the stop ids."""
        return self.grammar is not None and self.grammar.terminated


def apply_penalties(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                    rule: SamplingRule) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties on float32 logits [vocab] (a new tensor)."""
    vocab = logits.numel()
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)[:vocab]
    seen_out = counts > 0
    x = logits
    if rule.repetition_penalty != 1:
        seen = seen_out.clone()
        if prompt:
            seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        p = torch.where(seen, torch.tensor(float(rule.repetition_penalty)), torch.tensor(1.0))
        x = torch.where(x > 0, x / p, x * p)
    if rule.frequency_penalty != 0:
        x = x - float(rule.frequency_penalty) * counts.to(torch.float32)
    if rule.presence_penalty != 0:
        x = x - float(rule.presence_penalty) * seen_out.to(torch.float32)
    return x


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprobs: the chosen token's, and the `top` most likely tokens' (most
    likely first, equal values in id order)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Logprobs of `tokens[i]` under the raw logits row i ([len(tokens), vocab]), each with its
    row's `top` most likely tokens: log_softmax in float32, as the model gives them."""
    lp = torch.log_softmax(logits.detach().to(device="cpu", dtype=torch.float32), dim=-1)
    out = []
    for row, tok in zip(lp, tokens):
        alts: tuple[tuple[int, float], ...] = ()
        if top > 0:
            vals, ids = torch.sort(row, descending=True, stable=True)
            alts = tuple((int(i), float(v)) for i, v in zip(ids[:top], vals[:top]))
        out.append(TokenLogprob(int(tok), float(row[int(tok)]), alts))
    return out

"""Drafters: they guess the next few tokens, which the main model then verifies (speculative.py).

* `NgramDrafter`: prompt lookup, model-free and deterministic.
* `MtpDrafter`: the checkpoint's own multi-token-prediction block (DeepSeek-V4's, GLM-5.3's). Its
  state advances only over verified positions, fed with the main model's real final streams H_t
  and the accepted token t+1; draft steps past them use the MTP block's own output in place of
  the main model's (not computed yet) and are rewound at the next `update`. It runs the verified
  positions when it is next asked to propose, all of them in one call, and of a long run of them
  only the last `KEEP` (in a fresh state that starts there, as for a sequence it joins late): a
  sequence that does not draft for a while (draft_length.py chose k = 0) pays next to nothing for
  its drafter meanwhile, and its first drafts after are a little worse, never its output.

Drafts only change speed: the verify pass decides every emitted token.
"""
from __future__ import annotations

import torch

from ..errors import MtpUnavailableError
from .sampling import sampling_probs


class Drafter:
    """Protocol of a drafter; subclass it or duck-type it."""

    needs_hidden: bool = False

    def update(self, hidden: torch.Tensor | None, start_pos: int, next_tokens: list[int]) -> None:
        """Positions start_pos .. start_pos+len(next_tokens)-1 were just verified/accepted by the
        main model; hidden[i] is the main model's final streams at position start_pos+i (None if
        needs_hidden is False), and next_tokens[i] is the token at position start_pos+i+1 (the
        last one is the freshly chosen next token)."""

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens continuing `context` (all tokens so far incl. the freshly chosen
        one), plus their draft probability rows [len, vocab] (None for a deterministic drafter,
        meaning one-hot)."""
        return [], None

    def close(self) -> None:
        """Release whatever the drafter holds (called once, when generation ends)."""


class NgramDrafter(Drafter):
    """Prompt lookup: model-free and deterministic.

    For n from `max_ngram` down to `min_ngram`, look for the most recent earlier occurrence of
    the context's last n tokens; the first n that has one wins, and the tokens that followed that
    occurrence are proposed. When the occurrence is so recent that fewer than k tokens follow it,
    the copy runs on into the proposed tokens themselves (LZ77-style), i.e. it assumes the
    repetition continues with the same period: "x a b a b" proposes "a b a b ..." after "a b".

    The n-gram index is built incrementally: as long as each context extends the previous one
    (as in generation), a proposal costs O(k + new tokens), not O(len(context)).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._reset()

    def _reset(self) -> None:
        self._seen: list[int] = []
        # n -> {n-gram: start of its most recent occurrence among starts indexed so far}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        # per n, the number of starts already indexed
        self._indexed = {n: 0 for n in self._index}

    def _sync(self, context: list[int]) -> None:
        m = len(self._seen)
        if len(context) < m or context[:m] != self._seen:
            self._reset()  # not an extension of what we indexed (a new sequence): start over
            m = 0
        self._seen.extend(context[m:])
        L = len(self._seen)
        for n, index in self._index.items():
            # starts s < L - n only: the suffix itself (start L - n) must not match itself
            for s in range(self._indexed[n], max(L - n, 0)):
                index[tuple(self._seen[s:s + n])] = s
            self._indexed[n] = max(self._indexed[n], L - n, 0)

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        context = [int(t) for t in context]
        if k <= 0 or not context:
            return [], None
        self._sync(context)
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._index[n].get(tuple(context[L - n:]))
            if start is None:
                continue
            src = start + n  # < L: at least one real token follows the occurrence
            out: list[int] = []
            for j in range(k):
                p = src + j
                out.append(context[p] if p < L else out[p - L])
            return out, None
        return [], None


class MtpDrafter(Drafter):
    """Drafts with the model's MTP block, through `model.supports_mtp`, `model.new_mtp_state` and
    `model.mtp_step` (models/deepseek_v4/model.py, models/glm5/model.py)."""

    needs_hidden = True

    def __init__(self, model, capacity: int, max_rewind: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, ops=None):
        """`ops`: the kernels the MTP block runs (a `model.backend(mode)`: an engine passes its own
        mode's); None: the model's own mode."""
        if not model.supports_mtp:
            raise MtpUnavailableError(
                "speculative='mtp' needs the checkpoint's multi-token-prediction layer, but this checkpoint "
                "ships none (no mtp.* weights for DeepSeek-V4, no layers.<num_hidden_layers>.* for GLM-5.3); "
                "use speculative='ngram' or a checkpoint that ships them")
        self.model, self.ops = model, model.backend() if ops is None else ops
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        # draft steps (k - 1 of them) are undone by moving the cursor
        self.capacity, self.max_rewind = capacity, max(max_rewind, 1)
        self.state = model.new_mtp_state(capacity=capacity, max_rewind=self.max_rewind)
        self.verified: int | None = None  # next position to feed with real main-model streams
        self._logits: torch.Tensor | None = None  # MTP logits at the last verified position
        self._streams: torch.Tensor | None = None  # its output streams there [1, hc, d]
        # verified positions not run yet: (first position, [hidden rows], [next tokens], whether
        # positions before the first were dropped)
        self._pending: tuple[int, list[torch.Tensor], list[int], bool] | None = None

    def _run(self, hidden: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_step(hidden, next_ids, self.state, self.ops)

    KEEP = 8  # the most verified positions held, not run yet (each holds a row of hc x d streams)

    def update(self, hidden: torch.Tensor | None, start_pos: int, next_tokens: list[int]) -> None:
        if hidden is None or hidden.shape[0] != len(next_tokens):
            raise ValueError("the MTP drafter needs one main-model stream row per verified position")
        if self.verified is None and start_pos > 0:
            # a restored session: the MTP window starts here (earlier rows were never fed);
            # drafts are a little worse for the first W tokens, outputs are unaffected
            self.state.start_at(start_pos)
        elif start_pos != (self.verified or 0):
            raise ValueError(f"MTP drafter expected position {self.verified}, got {start_pos}")
        if not next_tokens:
            return
        if self._pending is None:
            self._pending = (start_pos, [], [], False)
        start, rows, tokens, _ = self._pending
        rows.append(hidden)
        tokens.extend(next_tokens)
        if len(tokens) > 2 * self.KEEP:  # keep the last KEEP (bounded memory; _catch_up starts afresh)
            kept = torch.cat(rows)[-self.KEEP:]
            self._pending = (start + len(tokens) - self.KEEP, [kept], tokens[-self.KEEP:], True)
        self.verified = start_pos + len(next_tokens)
        self._logits = self._streams = None

    def _catch_up(self) -> None:
        """Run the verified positions not run yet, in one call; in a fresh state that starts at
        the first of them if earlier ones were dropped."""
        if self._pending is None:
            return
        start, rows, tokens, dropped = self._pending
        self._pending = None
        if dropped:  # a state that starts here
            fresh = self.model.new_mtp_state(capacity=self.capacity, max_rewind=self.max_rewind)
            fresh.start_at(start)
            self.state.free()
            self.state = fresh
        else:
            self.state.rewind_to(start)  # drop the previous round's draft steps
        logits, streams = self._run(torch.cat(rows) if len(rows) > 1 else rows[0], tokens)
        self._logits, self._streams = logits[-1], streams[-1:]

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.temperature <= 0:
            return int(torch.argmax(logits).item()), None
        q = sampling_probs(logits, self.temperature, self.top_p)
        return int(torch.multinomial(q, 1, generator=self.generator).item()), q

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        if k <= 0:
            return [], None
        self._catch_up()
        if self._logits is None:
            return [], None
        # never draft past the state's reserved capacity
        k = min(k, self.state.capacity - self.state.pos + 1)
        drafts, rows = [], []
        logits, streams = self._logits, self._streams
        for i in range(k):
            tok, q = self._choose(logits)
            drafts.append(tok)
            rows.append(q)
            if i + 1 < k:
                lg, streams = self._run(streams, [tok])
                logits = lg[-1]
        if self.temperature <= 0:
            return drafts, None
        return drafts, torch.stack(rows)

    def close(self) -> None:
        self.state.free()

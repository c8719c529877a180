"""Speculative decoding inside the engine (`Engine(speculative="ngram" | "mtp", num_draft=k)`).

Each decoding sequence has its own drafter (decoding/drafters.py): the n-gram drafter, or one
over the checkpoint's MTP layer with an MTP state of its own. Each step it proposes up to k tokens;
the step's one batched forward scores [last token] + drafts for it (all k + 1 rows), and the
sequence's own sampler accepts a prefix (decoding/speculative.py `verify_drafts`: greedy output
is the plain greedy output, sampled output keeps the request's distribution by rejection
sampling). The state then rewinds past the rejected drafts (states are created with
max_rewind = k) and the drafter is told which positions were verified, with the main model's
final streams there when it reads them.

Drafts change only speed. A drafter that fails is dropped and its sequence decodes one token a
step; the request is not failed for it. The MTP drafter of a sequence that starts from the
prefix cache, or as a further choice of an n > 1 request, sees the main streams only from where
its sequence starts computing: its earlier rows were never fed, so its first drafts are worse,
never its output.
"""
from __future__ import annotations

from typing import Any

from ..decoding.speculative import check_speculative, make_drafter
from ..errors import MtpUnavailableError
from .sequence import Sequence


class EngineSpeculation:
    def __init__(self, model: Any, kind: str, num_draft: int, batch_invariant: bool):
        if not isinstance(kind, str):
            raise ValueError(f"the engine's speculative must be 'ngram' or 'mtp', got {kind!r}")
        check_speculative(kind, num_draft)
        if kind == "mtp" and not model.supports_mtp:
            raise MtpUnavailableError(
                "speculative='mtp' needs the checkpoint's multi-token-prediction layer, but this checkpoint ships "
                "none (no mtp.* weights for DeepSeek-V4, no layers.<num_hidden_layers>.* for GLM-5.3); use "
                "speculative='ngram' or a checkpoint that ships them")
        self.model, self.kind, self.num_draft = model, kind, num_draft
        self.batch_invariant = batch_invariant  # the engine's mode, which its MTP drafters run in too
        self.needs_hidden = kind == "mtp"
        self.drafted = self.accepted = self.dropped = 0
        self.verifies = 0  # verify steps of a sequence with drafts
        self.accepted_at = [0] * num_draft  # per draft position: drafts accepted there (vLLM's per-position rate)

    @property
    def max_rewind(self) -> int:
        """A verify call writes k + 1 positions and keeps at least one: it rewinds at most k."""
        return self.num_draft

    def state_bytes(self, capacity: int) -> int:
        """Bytes of the drafter's own state for a sequence of `capacity` positions."""
        return self.model.mtp_state_bytes(capacity, max(self.max_rewind, 1)) if self.kind == "mtp" else 0

    def attach(self, seq: Sequence) -> None:
        """Give a sequence that just got its state a drafter of its own."""
        seq.drafter = make_drafter(self.kind, self.model, capacity=seq.capacity, max_rewind=self.max_rewind,
                                   temperature=seq.params.temperature, top_p=seq.params.top_p,
                                   generator=seq.generator, ops=self.model.backend(self.batch_invariant))

    def decode_input(self, seq: Sequence) -> list[int]:
        """This step's ids for a decoding sequence: its last token and the drafts after it (kept
        on `seq.drafts`, their probability rows on `seq.draft_probs`). Never more drafts than
        max_tokens or the state's capacity leave room for: a step emits up to k + 1 tokens."""
        seq.drafts, seq.draft_probs = [], None
        k = min(self.num_draft, seq.params.max_tokens - len(seq.output) - 1, seq.capacity - seq.state.pos - 1)
        if seq.drafter is None or k <= 0:
            return [seq.output[-1]]
        try:
            proposed, q = seq.drafter.propose(seq.prompt + seq.output, k)
        except Exception:  # speed only: go on without it
            self.drop(seq)
            return [seq.output[-1]]
        drafts = [int(d) for d in proposed[:k]]
        seq.drafts, seq.draft_probs = drafts, (q[:len(drafts)] if q is not None and drafts else None)
        return [seq.output[-1]] + drafts

    def feed(self, seq: Sequence, hidden, start: int, next_tokens: list[int]) -> None:
        """Positions start .. start + len(next_tokens) - 1 are verified; next_tokens[i] is the token
        at position start + i + 1 (drafters.Drafter.update)."""
        if seq.drafter is None or seq.finish_reason is not None or not next_tokens:
            return
        try:
            seq.drafter.update(hidden if seq.drafter.needs_hidden else None, start, next_tokens)
        except Exception:
            self.drop(seq)

    def count(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += drafted > 0
        for i in range(accepted):  # a draft is accepted only after every draft before it
            self.accepted_at[i] += 1

    def drop(self, seq: Sequence) -> None:
        self.dropped += 1
        seq.close_drafter()

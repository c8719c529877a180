"""Speculative decoding inside the engine (`Engine(speculative="ngram" | "mtp", num_draft=k)`).

Each decoding sequence has its own drafter (decoding/drafters.py): the n-gram drafter, or one
over the checkpoint's MTP layer with an MTP state of its own. Each step it proposes up to k tokens;
the step's one batched forward scores [last token] + drafts for it (all k + 1 rows), and the
sequence's own sampler accepts a prefix (decoding/speculative.py `verify_drafts`: greedy output
is the plain greedy output, sampled output keeps the request's distribution by rejection
sampling). The state then rewinds past the rejected drafts (states are created with
max_rewind = k) and the drafter is told which positions were verified, with the main model's
final streams there when it reads them.

With `adaptive` (`Engine(adaptive_draft=True)`, on in `kvfold serve`), how many tokens a
sequence drafts is chosen each step (decoding/draft_length.py; off: always k). Before the step's
proposals, `plan_step` gives every decoding sequence the draft count that maximises the step's
expected tokens per second. It reads the sequence's own measured acceptance (a new sequence starts
from the engine's, all sequences together) and this engine's measured cost of a step by its row
count, so a verify's rows are costed as what they add to the step they join. A step with a
prefill chunk is not timed.

Drafts change only speed. A drafter that fails is dropped and its sequence decodes one token a
step; the request is not failed for it. The MTP drafter of a sequence that starts from the
prefix cache, or as a further choice of an n > 1 request, sees the main streams only from where
its sequence starts computing: its earlier rows were never fed, so its first drafts are worse,
never its output.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..decoding.draft_length import Acceptance, StepCosts, plan_drafts
from ..decoding.speculative import check_speculative, make_drafter
from ..errors import MtpUnavailableError
from .sequence import Sequence


class EngineSpeculation:
    def __init__(self, model: Any, kind: str, num_draft: int, batch_invariant: bool, adaptive: bool = False):
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
        self.costs = StepCosts() if adaptive else None  # this engine's step costs (draft_length.py)
        self.prior = Acceptance(num_draft)  # every sequence's drafts together: where a new sequence starts
        self._plan: dict[int, int] = {}  # id(sequence) -> its draft count this step

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
        seq.acceptance = self.prior.copy()

    def _most(self, seq: Sequence) -> int:
        """The most drafts a step of `seq` may verify: a step emits up to k + 1 tokens, never more
        than max_tokens or the state's capacity leave room for."""
        return min(self.num_draft, seq.params.max_tokens - len(seq.output) - 1, seq.capacity - seq.state.pos - 1)

    def plan_step(self, running: list[Sequence]) -> None:
        """Each decoding sequence's draft count for the coming step (draft_length.py), before any
        proposes; the decoding sequences without a drafter are rows of the step too."""
        if self.costs is None:
            return
        decoding = [s for s in running if not s.prefilling]
        drafting = [s for s in decoding if s.drafter is not None and s.acceptance is not None]
        ks = plan_drafts([(s.acceptance, max(self._most(s), 0)) for s in drafting], self.costs,
                         other_rows=len(decoding) - len(drafting))
        self._plan = {id(s): k for s, k in zip(drafting, ks)}

    def timed(self, batch: list, started: float) -> None:
        """The step's forward, begun at perf_counter `started`, is done: a cost of its row count,
        unless a prefill chunk shared it."""
        if self.costs is None or not all(seq.output for seq, _ in batch):
            return
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)  # the kernels run asynchronously
        self.costs.record_forward(sum(len(ids) for _, ids in batch), time.perf_counter() - started)

    def decode_input(self, seq: Sequence) -> list[int]:
        """This step's ids for a decoding sequence: its last token and the drafts after it (kept
        on `seq.drafts`, their probability rows on `seq.draft_probs`). Never more drafts than
        max_tokens or the state's capacity leave room for: a step emits up to k + 1 tokens."""
        seq.drafts, seq.draft_probs = [], None
        k = self._most(seq)
        if self.costs is not None:
            k = min(k, self._plan.get(id(seq), 0))
        if seq.drafter is None or k <= 0:
            if seq.acceptance is not None:
                seq.acceptance.record(0, 0)
            return [seq.output[-1]]
        t0 = time.perf_counter()
        try:
            proposed, q = seq.drafter.propose(seq.prompt + seq.output, k)
        except Exception:  # speed only: go on without it
            self.drop(seq)
            return [seq.output[-1]]
        drafts = [int(d) for d in proposed[:k]]
        if self.costs is not None:
            self.costs.record_draft(len(drafts), time.perf_counter() - t0)
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

    def count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        for acceptance in (seq.acceptance, self.prior):
            if acceptance is not None:
                acceptance.record(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += drafted > 0
        for i in range(accepted):  # a draft is accepted only after every draft before it
            self.accepted_at[i] += 1

    def drop(self, seq: Sequence) -> None:
        self.dropped += 1
        seq.close_drafter()

"""The MTP drafter: DeepSeek-V4's own multi-token-prediction block proposes draft tokens.

The MTP state advances only over verified positions, fed with the main model's real final
streams H_t and the accepted token t+1; draft steps past them use the MTP block's own output
streams in place of the main model's (not computed yet) and are rewound at the next `update`.
Drafts only change speed: the verify pass decides every emitted token.
"""
from __future__ import annotations

import torch

from ..errors import MtpUnavailableError
from .speculative import target_probs


class MtpDrafter:
    needs_hidden = True

    def __init__(self, model, capacity: int, max_rewind: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        if getattr(model, "mtp", None) is None:
            raise MtpUnavailableError(
                "speculative='mtp' needs the checkpoint's multi-token-prediction weights, but this "
                "checkpoint has no mtp.* weights; use speculative='ngram' or a checkpoint that ships them")
        self.model, self.mtp = model, model.mtp
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        # draft steps (k - 1 of them) are undone by moving the cursor
        self.state = self.mtp.new_state(capacity=capacity, max_rewind=max(max_rewind, 1))
        self.verified: int | None = None  # next position to feed with real main-model streams
        self._logits: torch.Tensor | None = None  # MTP logits at the last verified position
        self._streams: torch.Tensor | None = None  # its output streams there [1, hc, d]

    def _run(self, hidden: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.model.device)
        return self.mtp(hidden, ids, self.state, self.model.model.embed_tokens.weight, self.model.lm_head,
                        self.model.rope_main)

    def update(self, hidden: torch.Tensor | None, start_pos: int, next_tokens: list[int]) -> None:
        if hidden is None or hidden.shape[0] != len(next_tokens):
            raise ValueError("the MTP drafter needs one main-model stream row per verified position")
        if self.verified is None and start_pos > 0:
            # a restored session: the MTP window starts here (earlier rows were never fed);
            # drafts are a little worse for the first W tokens, outputs are unaffected
            self.state.pos = self.state.written_until = self.state.rewind_floor = start_pos
        elif start_pos != (self.verified or 0):
            raise ValueError(f"MTP drafter expected position {self.verified}, got {start_pos}")
        self.state.rewind_to(start_pos)  # drop the previous round's draft steps
        logits, streams = self._run(hidden, next_tokens)
        self.verified = start_pos + len(next_tokens)
        self._logits, self._streams = logits[-1], streams[-1:]

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.temperature <= 0:
            return int(torch.argmax(logits).item()), None
        q = target_probs(logits, self.temperature, self.top_p)
        return int(torch.multinomial(q, 1, generator=self.generator).item()), q

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        if self._logits is None or k <= 0:
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

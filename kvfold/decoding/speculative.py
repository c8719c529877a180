"""Speculative decoding: drafters that guess the next few tokens, and the verify/accept rule.

A drafter proposes up to k tokens; the main model scores `[y] + drafts` in one forward (the
"verify" pass) and keeps the longest prefix it agrees with, plus one token of its own choice.

* Greedy (temperature 0): a draft is kept while it equals the argmax of the main model's
  logits at that position (ties toward the lowest id, as `sample_next`); the output is the
  plain greedy output (up to the ~1e-5 difference between chunked and 1-token logits).
* Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft
  d_i is kept with probability min(1, p(d_i) / q(d_i)); on the first rejection the token is
  drawn from normalize(max(p - q, 0)); when every draft is kept, a bonus token is drawn from
  p at the last position. The emitted tokens are distributed exactly as sampling from p
  (the main model's temperature/top-p distribution) one token at a time.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .sampling import sample_next

SPECULATIVE_KINDS = ("mtp", "ngram")


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


def make_drafter(kind: Any, model: Any, *, capacity: int, max_rewind: int, temperature: float,
                 top_p: float, generator: torch.Generator) -> Drafter:
    """A drafter by name ("mtp", "ngram"), or the given object if it already is one."""
    if isinstance(kind, str):
        if kind == "ngram":
            return NgramDrafter()
        if kind == "mtp":
            from .mtp import MtpDrafter
            return MtpDrafter(model, capacity, max_rewind, temperature, top_p, generator)
    elif hasattr(kind, "propose") and hasattr(kind, "update"):
        return kind
    raise ValueError(f"speculative must be None, one of {SPECULATIVE_KINDS} or a Drafter, got {kind!r}")


# ---- acceptance ----------------------------------------------------------------------------

def target_probs(logits_1d: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The float64 distribution `sample_next` draws from: softmax(logits / temperature) restricted
    to the top-p nucleus (same stable order, same keep rule) and renormalised."""
    if temperature <= 0.0:
        raise ValueError("target_probs is for sampling (temperature > 0); greedy needs no distribution")
    logits = logits_1d.detach().to(device="cpu", dtype=torch.float32)
    probs = torch.softmax(logits / temperature, dim=-1).to(torch.float64)
    if not torch.isfinite(probs).all():
        raise ValueError("logits give no distribution (NaN, all -inf, or +inf present)")
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    keep = max(int(torch.count_nonzero((cum - sorted_probs) < top_p)), 1)
    out = torch.zeros_like(probs)
    out[order[:keep]] = sorted_probs[:keep] / cum[keep - 1]
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from non-negative float64 weights (not necessarily normalised)."""
    cum = torch.cumsum(weights, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cum[-1]
    k = int(torch.searchsorted(cum, u, right=True))
    k = min(k, weights.numel() - 1)
    while weights[k] <= 0 and k > 0:  # u landed on the edge of a zero-weight run (rounding)
        k -= 1
    return k


def rejection_step(p: torch.Tensor, q: torch.Tensor | None, draft: int,
                   generator: torch.Generator | None) -> tuple[bool, int]:
    """One step of speculative rejection sampling.

    `p` is the target distribution [vocab], `q` the distribution `draft` was drawn from (None:
    the drafter is deterministic, q is one-hot at `draft`). Returns (True, draft) with
    probability min(1, p[draft] / q[draft]), else (False, t) with t ~ normalize(max(p - q, 0)).
    Whatever q is, the returned token is distributed as p.
    """
    p = p.to(torch.float64)
    pd = float(p[draft])
    qd = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u * qd < pd:  # u < p/q without dividing; p == 0 never accepts
        return True, draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - q.to(device=p.device, dtype=torch.float64), min=0.0)
    if not float(residual.sum()) > 0.0:
        # p <= q everywhere means p == q (up to rounding): rejection had probability ~0
        residual = p
    return False, _draw(residual, generator)


def verify_drafts(logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                  temperature: float, top_p: float, generator: torch.Generator | None) -> tuple[int, int]:
    """Accept a prefix of `drafts` against the verify logits [len(drafts) + 1, vocab] (row i scores
    the token after drafts[:i]). Returns (n_accepted, next_token): next_token is the main model's
    token after the last accepted draft (a correction on rejection, a bonus when all pass)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify logits have {logits.shape[0]} rows for {k} drafts (need {k + 1})")
    if temperature == 0.0:
        for i, d in enumerate(drafts):
            best = sample_next(logits[i], 0.0, top_p, None)
            if best != d:
                return i, best
        return k, sample_next(logits[k], 0.0, top_p, None)
    for i, d in enumerate(drafts):
        q = None if draft_probs is None else draft_probs[i]
        ok, tok = rejection_step(target_probs(logits[i], temperature, top_p), q, int(d), generator)
        if not ok:
            return i, tok
    return k, sample_next(logits[k], temperature, top_p, generator)

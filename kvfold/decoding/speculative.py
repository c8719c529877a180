"""Speculative decoding: choosing a drafter, and the verify/accept rule.

A drafter (drafters.py) proposes up to k tokens; the main model scores `[y] + drafts` in one
forward (the "verify" pass) and keeps the longest prefix it agrees with, plus one token of its
own choice.

* Greedy (temperature 0): a draft is kept while it equals the argmax of the main model's
  processed logits at that position (ties toward the lowest id, as `sample_next`); the output
  is the plain greedy output (up to the ~1e-5 difference between chunked and 1-token logits).
* Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft
  d_i is kept with probability min(1, p(d_i) / q(d_i)); on the first rejection the token is
  drawn from normalize(max(p - q, 0)); when every draft is kept, a bonus token is drawn from
  p at the last position. The emitted tokens are distributed exactly as sampling from p
  one token at a time, p being the request's processed distribution (`logits.Sampler`:
  penalties, bias, grammar, then temperature, min-p, top-k, top-p) given the tokens before.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .drafters import Drafter, MtpDrafter, NgramDrafter
from .logits import Sampler
from .sampling import draw

SPECULATIVE_KINDS = ("mtp", "ngram")


def _is_drafter(kind: Any) -> bool:
    return not isinstance(kind, str) and hasattr(kind, "propose") and hasattr(kind, "update")


def check_speculative(kind: Any, num_draft: int = 1) -> None:
    """Refuse (ValueError) a `speculative` kind that is neither a name in SPECULATIVE_KINDS nor a
    Drafter, and a `num_draft` that is not an int >= 1."""
    if not (_is_drafter(kind) or (isinstance(kind, str) and kind in SPECULATIVE_KINDS)):
        raise ValueError(f"speculative must be None, one of {SPECULATIVE_KINDS} or a Drafter, got {kind!r}")
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an int >= 1, got {num_draft!r}")


def make_drafter(kind: Any, model: Any, *, capacity: int, max_rewind: int, temperature: float,
                 top_p: float, generator: torch.Generator, ops: Any = None) -> Drafter:
    """A drafter by name ("mtp", "ngram"), or the given object if it already is one. `ops`: the
    kernels an MTP drafter runs (None: the model's own mode)."""
    check_speculative(kind)
    if not isinstance(kind, str):
        return kind
    if kind == "ngram":
        return NgramDrafter()
    return MtpDrafter(model, capacity, max_rewind, temperature, top_p, generator, ops)


# ---- acceptance ----------------------------------------------------------------------------

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
    return False, draw(residual, generator)


def verify_drafts(logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                  sampler: Sampler, output: Sequence[int] = ()) -> tuple[int, int | None]:
    """Accept a prefix of `drafts` against the verify logits [len(drafts) + 1, vocab] (row i scores
    the token after drafts[:i]). Returns (n_accepted, next_token): next_token is the main model's
    token after the last accepted draft (a correction on rejection, a bonus when all pass).

    Row i is judged by the request's own rule after `output + drafts[:i]` (`sampler.process`:
    bias, penalties, grammar), so speculative output follows the same processed distribution as
    one token at a time; each accepted draft is `sampler.accept`ed before the next row is
    processed (the grammar moves only over tokens that are kept, never over a rejected one),
    and the caller accepts next_token. next_token is None when the grammar ended on the last
    accepted draft (the output is complete there)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify logits have {logits.shape[0]} rows for {k} drafts (need {k + 1})")
    history = list(output)
    for i, d in enumerate(drafts):
        if sampler.rule.temperature == 0.0:
            tok = sampler.choose(logits[i], history)
            ok = tok == int(d)
        else:
            q = None if draft_probs is None else draft_probs[i]
            ok, tok = rejection_step(sampler.probs(logits[i], history), q, int(d), sampler.generator)
        if not ok:
            return i, tok
        sampler.accept(int(d))
        if sampler.finished:  # the grammar ended on this draft: nothing may follow it
            return i + 1, None
        history.append(int(d))
    return k, sampler.choose(logits[k], history)

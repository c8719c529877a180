"""Perplexity of a model on a text (`kvfold eval-ppl`), and top-1 agreement between two runs.

The text's tokens are cut into consecutive windows of `context` tokens. Each window is one
sequence: BOS, then the window, run as one forward (the same path as any prefill), so every token
of the text is predicted exactly once, from the tokens before it in its window. Perplexity is
exp(mean negative log-likelihood), accumulated in float64 so the sum's rounding never shows in the
printed digits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError


@dataclass(frozen=True)
class TextScores:
    nll: torch.Tensor   # [N] float64: -log p(token_i | the tokens before it in its window)
    top1: torch.Tensor  # [N] long: the model's most likely token at each position

    @property
    def tokens(self) -> int:
        return self.nll.numel()

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())

    def top1_agreement(self, other: "TextScores") -> float:
        """The fraction of positions where both runs rank the same token first."""
        if other.tokens != self.tokens:
            raise InvalidInputError(f"scores of {self.tokens} and {other.tokens} tokens cannot be compared")
        return (self.top1 == other.top1).double().mean().item()


@torch.no_grad()
def score_text(model, ids: list[int], context: int = 512, kv_dtype: str | None = None) -> TextScores:
    """Score `ids` (the text's tokens, without BOS) with `model` in windows of `context` tokens."""
    if context < 1:
        raise InvalidInputError(f"context must be at least 1 token, got {context}")
    if not ids:
        raise InvalidInputError("the text has no tokens to score")
    bos = model.tokenizer.bos_id
    if bos is None:
        raise InvalidInputError("eval-ppl needs a model whose tokenizer has a BOS token to start each window")
    nll, top1 = [], []
    extra = {"kv_dtype": kv_dtype} if kv_dtype else {}
    for start in range(0, len(ids), context):
        window = ids[start:start + context]
        state = model.new_state(capacity=len(window) + 1, **extra)
        try:
            logits = model(torch.tensor([bos] + window), state)[:-1].double()
        finally:
            state.free()
        target = torch.tensor(window, device=logits.device)
        nll.append(-logits.log_softmax(-1).gather(1, target[:, None])[:, 0].cpu())
        top1.append(logits.argmax(-1).cpu())
    return TextScores(torch.cat(nll), torch.cat(top1))


def unigram_perplexity(ids: list[int]) -> float:
    """The perplexity of the text's own unigram distribution on itself: a baseline that has seen the
    answers (it is fitted on the scored text), so a model that has learned anything beats it."""
    counts = torch.bincount(torch.tensor(ids)).double()
    p = counts[torch.tensor(ids)] / len(ids)
    return math.exp(-p.log().mean().item())

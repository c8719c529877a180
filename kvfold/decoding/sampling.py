"""Next-token choice from one row of logits: greedy, temperature and nucleus (top-p).

Sampling runs on a float32 CPU copy with a CPU generator, so the same seed picks the
same tokens whether the model ran on CPU or GPU (given the same logits).
"""

from __future__ import annotations

import math

import torch


def sample_next(
    logits_1d: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """Return the next token id.

    temperature == 0 is greedy: the argmax, ties broken toward the lowest id.
    Otherwise sample from softmax(logits / temperature) restricted to the smallest
    set of most likely tokens whose mass reaches `top_p` (always at least one).
    `generator`, if given, must be a CPU generator.
    """
    if logits_1d.dim() != 1:
        raise ValueError(f"expected 1-D logits, got shape {tuple(logits_1d.shape)}")
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("sampling runs on CPU; pass a CPU torch.Generator")

    logits = logits_1d.detach().to(device="cpu", dtype=torch.float32)
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if temperature == 0.0:
        return int(torch.argmax(logits))  # documented: first index of the maximum

    # Stable descending sort keeps equal-probability tokens in id order.
    probs = torch.softmax(logits / temperature, dim=-1).to(torch.float64)
    if not torch.isfinite(probs).all():
        raise ValueError("logits give no distribution (all -inf, or +inf present)")
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    # Keep token k while the mass before it is still short of top_p.
    keep = int(torch.count_nonzero((cum - sorted_probs) < top_p))
    keep = max(keep, 1)
    kept = cum[:keep]

    # Inverse-CDF draw from one uniform: simple, and exactly reproducible per seed.
    u = torch.rand((), generator=generator, dtype=torch.float64) * kept[-1]
    k = int(torch.searchsorted(kept, u, right=True))
    return int(order[min(k, keep - 1)])

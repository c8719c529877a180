"""Next-token choice from one row of logits (greedy, temperature and nucleus / top-p), and the one
check of sampling arguments that `generate`, the engine and the server share.

Sampling runs on a float32 CPU copy with a CPU generator, so the same seed picks the
same tokens whether the model ran on CPU or GPU (given the same logits).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping

import torch

SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts: [lo, hi)


# ---- argument checks -------------------------------------------------------------------------

class SamplingArgumentError(ValueError):
    """A sampling argument out of range. `param` is its name as the caller spells it, so each
    caller can re-raise in its own terms (the engine's InvalidRequestError, the server's 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_sampling(*, max_tokens: Any = None, temperature: Any = 0.0, top_p: Any = 1.0, seed: Any = None,
                   stop_ids: Iterable[Any] | None = None, stop: str | Iterable[Any] | None = (),
                   names: Mapping[str, str] | None = None, min_tokens: int = 1,
                   max_temperature: float | None = None, max_stops: int | None = None) -> None:
    """Raise SamplingArgumentError for the first argument out of range, in the order listed.

    `max_tokens` (None: not given) must be an int >= `min_tokens`; `temperature` finite and >= 0
    (and <= `max_temperature` when given); `top_p` in (0, 1]; `seed` None or a 64-bit int;
    `stop_ids` None or ints >= 0; `stop` one string or strings, all non-empty (at most
    `max_stops` when given). `names` maps these keyword names to the caller's parameter names
    (e.g. {"max_tokens": "max_new_tokens"}), which the messages and `param` use.
    """
    def fail(key: str, rule: str, *got: Any) -> SamplingArgumentError:
        name = (names or {}).get(key, key)
        return SamplingArgumentError(name, f"{name} {rule}" + "".join(f", got {v!r}" for v in got))

    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= min_tokens):
        raise fail("max_tokens", f"must be an int >= {min_tokens}", max_tokens)
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise fail("temperature", "must be finite and >= 0", temperature)
    if max_temperature is not None and temperature > max_temperature:
        raise fail("temperature", f"must be in [0, {max_temperature:g}]", temperature)
    if not (isinstance(top_p, numbers.Real) and 0.0 < top_p <= 1.0):
        raise fail("top_p", "must be in (0, 1]", top_p)
    if seed is not None and not (_is_int(seed) and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise fail("seed", "must be a 64-bit int or None", seed)
    if stop_ids is not None and not all(_is_int(i) and i >= 0 for i in stop_ids):
        raise fail("stop_ids", "must be token ids (ints >= 0)", stop_ids)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if (max_stops is not None and len(stops) > max_stops) or any(not isinstance(s, str) or not s for s in stops):
        raise fail("stop", "strings must be non-empty strings" if max_stops is None
                   else f"takes up to {max_stops} non-empty strings")


# ---- the sampling distribution ---------------------------------------------------------------

def _cpu_logits(logits_1d: torch.Tensor) -> torch.Tensor:
    logits = logits_1d.detach().to(device="cpu", dtype=torch.float32)
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    return logits


def nucleus(logits_1d: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens sampling may pick, and their weights: (ids, probs) of softmax(logits / temperature)
    restricted to the smallest set of most likely tokens whose mass reaches `top_p` (at least one).

    Most likely first, equal probabilities in id order (a stable sort); probs are float64 and not
    renormalised. Both `sample_next` and speculative verification draw from exactly this set.
    """
    probs = torch.softmax(_cpu_logits(logits_1d) / temperature, dim=-1).to(torch.float64)
    if not torch.isfinite(probs).all():
        raise ValueError("logits give no distribution (all -inf, or +inf present)")
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    # token k stays while the mass before it is still short of top_p
    keep = max(int(torch.count_nonzero((cum - sorted_probs) < top_p)), 1)
    return order[:keep], sorted_probs[:keep]


def sampling_probs(logits_1d: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The float64 distribution over the whole vocabulary that `sample_next` draws from: the
    `nucleus`, renormalised by the same total the draw uses."""
    if temperature <= 0.0:
        raise ValueError("sampling_probs is for sampling (temperature > 0); greedy needs no distribution")
    ids, probs = nucleus(logits_1d, temperature, top_p)
    out = torch.zeros(logits_1d.shape[-1], dtype=torch.float64)
    out[ids] = probs / torch.cumsum(probs, dim=-1)[-1]
    return out


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index drawn from non-negative float64 weights (not necessarily normalised) by inverse CDF
    from one uniform: simple, and exactly reproducible per seed."""
    cum = torch.cumsum(weights, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cum[-1]
    k = min(int(torch.searchsorted(cum, u, right=True)), weights.numel() - 1)
    while weights[k] <= 0 and k > 0:  # u landed on the edge of a zero-weight run (rounding)
        k -= 1
    return k


def sample_next(
    logits_1d: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """Return the next token id.

    temperature == 0 is greedy: the argmax, ties broken toward the lowest id.
    Otherwise draw from the `nucleus` of softmax(logits / temperature) at `top_p`.
    `generator`, if given, must be a CPU generator.
    """
    if logits_1d.dim() != 1:
        raise ValueError(f"expected 1-D logits, got shape {tuple(logits_1d.shape)}")
    check_sampling(temperature=temperature, top_p=top_p)
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("sampling runs on CPU; pass a CPU torch.Generator")
    if temperature == 0.0:
        return int(torch.argmax(_cpu_logits(logits_1d)))  # documented: first index of the maximum
    ids, probs = nucleus(logits_1d, temperature, top_p)
    return int(ids[draw(probs, generator)])

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


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties: OpenAI's range
BIAS_RANGE = (-100.0, 100.0)  # logit_bias values: OpenAI's range
# repetition_penalty scales a logit by at most 100 either way, so every fp32 logit under 3.4e36
# stays finite (a penalty of 1e-300 would turn a logit of 1 into +inf and the distribution into NaN)
REPETITION_RANGE = (0.01, 100.0)


def check_sampling(*, max_tokens: Any = None, temperature: Any = 0.0, top_p: Any = 1.0, seed: Any = None,
                   stop_ids: Iterable[Any] | None = None, stop: str | Iterable[Any] | None = (),
                   names: Mapping[str, str] | None = None, max_tokens_floor: int = 1,
                   max_temperature: float | None = None, max_stops: int | None = None, top_k: Any = 0,
                   min_p: Any = 0.0, presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0,
                   repetition_penalty: Any = 1.0, logit_bias: Mapping[Any, Any] | None = None,
                   min_tokens: Any = 0, vocab_size: int | None = None) -> None:
    """Raise SamplingArgumentError for the first argument out of range, in the order listed.

    `max_tokens` (None: not given) must be an int >= `max_tokens_floor`; `temperature` finite and
    >= 0 (and <= `max_temperature` when given); `top_p` in (0, 1]; `seed` None or a 64-bit int;
    `stop_ids` None or ints >= 0; `stop` one string or strings, all non-empty (at most
    `max_stops` when given); `top_k` an int, 0 or -1 (off) or >= 1; `min_p` in [0, 1];
    `presence_penalty` and `frequency_penalty` in [-2, 2]; `repetition_penalty` in [0.01, 100];
    `logit_bias` token ids (ints >= 0, below `vocab_size` when given) to values in [-100, 100];
    `min_tokens` an int >= 0 and at most `max_tokens`. `names` maps these keyword names to the
    caller's parameter names (e.g. {"max_tokens": "max_new_tokens"}), which the messages and
    `param` use.
    """
    def fail(key: str, rule: str, *got: Any) -> SamplingArgumentError:
        name = (names or {}).get(key, key)
        return SamplingArgumentError(name, f"{name} {rule}" + "".join(f", got {v!r}" for v in got))

    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= max_tokens_floor):
        raise fail("max_tokens", f"must be an int >= {max_tokens_floor}", max_tokens)
    if not (_is_real(temperature) and temperature >= 0):
        raise fail("temperature", "must be finite and >= 0", temperature)
    if max_temperature is not None and temperature > max_temperature:
        raise fail("temperature", f"must be in [0, {max_temperature:g}]", temperature)
    if not (_is_real(top_p) and 0.0 < top_p <= 1.0):
        raise fail("top_p", "must be in (0, 1]", top_p)
    if seed is not None and not (_is_int(seed) and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise fail("seed", "must be a 64-bit int or None", seed)
    if stop_ids is not None and not all(_is_int(i) and i >= 0 for i in stop_ids):
        raise fail("stop_ids", "must be token ids (ints >= 0)", stop_ids)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if (max_stops is not None and len(stops) > max_stops) or any(not isinstance(s, str) or not s for s in stops):
        raise fail("stop", "strings must be non-empty strings" if max_stops is None
                   else f"takes up to {max_stops} non-empty strings")
    _check_shaping(fail, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
                   vocab_size)
    if not (_is_int(min_tokens) and min_tokens >= 0):
        raise fail("min_tokens", "must be an int >= 0", min_tokens)
    if max_tokens is not None and min_tokens > max_tokens:
        raise fail("min_tokens", f"must be at most {(names or {}).get('max_tokens', 'max_tokens')} ({max_tokens})",
                   min_tokens)


def _check_shaping(fail, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
                   vocab_size) -> None:
    """The rules of the arguments that reshape the distribution (`check_sampling`'s second half)."""
    if not (_is_int(top_k) and (top_k >= 0 or top_k == -1)):
        raise fail("top_k", "must be an int: 0 or -1 (no limit), or >= 1", top_k)
    if not (_is_real(min_p) and 0.0 <= min_p <= 1.0):
        raise fail("min_p", "must be in [0, 1]", min_p)
    for key, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (_is_real(v) and PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1]):
            raise fail(key, f"must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}]", v)
    if not (_is_real(repetition_penalty) and REPETITION_RANGE[0] <= repetition_penalty <= REPETITION_RANGE[1]):
        raise fail("repetition_penalty", f"must be in [{REPETITION_RANGE[0]:g}, {REPETITION_RANGE[1]:g}]",
                   repetition_penalty)
    if logit_bias is None:
        return
    if not isinstance(logit_bias, Mapping):
        raise fail("logit_bias", "must map token ids to biases", logit_bias)
    for tok, bias in logit_bias.items():
        if not (_is_int(tok) and tok >= 0 and (vocab_size is None or tok < vocab_size)):
            where = f" in [0, {vocab_size})" if vocab_size is not None else " (ints >= 0)"
            raise fail("logit_bias", f"keys must be token ids{where}", tok)
        if not (_is_real(bias) and BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]):
            raise fail("logit_bias", f"values must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}]", bias)


# ---- the sampling distribution ---------------------------------------------------------------

def cpu_logits(logits_1d: torch.Tensor) -> torch.Tensor:
    logits = logits_1d.detach().to(device="cpu", dtype=torch.float32)
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    return logits


def nucleus(logits_1d: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
            min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens sampling may pick, and their weights: (ids, probs) of softmax(logits / temperature)
    cut, in this order (vLLM's), to the tokens whose probability is at least `min_p` times the
    largest, then to the `top_k` most likely (0 or -1: no limit), then to the smallest set of most
    likely tokens whose mass reaches `top_p` of what is left (at least one).

    Most likely first, equal probabilities in id order (a stable sort); probs are float64 and not
    renormalised. Both `sample_next` and speculative verification draw from exactly this set.
    """
    probs = torch.softmax(cpu_logits(logits_1d) / temperature, dim=-1).to(torch.float64)
    if not torch.isfinite(probs).all():
        raise ValueError("logits give no distribution (all -inf, or +inf present)")
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = probs.numel()
    if min_p > 0.0:  # sorted descending: the tokens at or above the threshold are a prefix
        keep = int(torch.count_nonzero(sorted_probs >= min_p * sorted_probs[0]))
    if top_k > 0:
        keep = min(keep, top_k)
    kept = sorted_probs[:keep]
    cum = torch.cumsum(kept, dim=-1)
    # token k stays while the mass before it is still short of top_p (of the mass min_p and top_k left)
    mass = cum[-1] if keep < probs.numel() else 1.0
    keep = max(int(torch.count_nonzero((cum - kept) < top_p * mass)), 1)
    return order[:keep], sorted_probs[:keep]


def sampling_probs(logits_1d: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                   min_p: float = 0.0) -> torch.Tensor:
    """The float64 distribution over the whole vocabulary that `sample_next` draws from: the
    `nucleus`, renormalised by the same total the draw uses."""
    if temperature <= 0.0:
        raise ValueError("sampling_probs is for sampling (temperature > 0); greedy needs no distribution")
    ids, probs = nucleus(logits_1d, temperature, top_p, top_k, min_p)
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


def greedy(logits_1d: torch.Tensor) -> int:
    """The argmax, ties broken toward the lowest id (torch documents the first index)."""
    logits = cpu_logits(logits_1d)
    if not bool((logits > float("-inf")).any()):
        raise ValueError("logits give no choice (every token is -inf)")
    return int(torch.argmax(logits))


def sample_next(
    logits_1d: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    """Return the next token id.

    temperature == 0 is greedy: the argmax, ties broken toward the lowest id.
    Otherwise draw from the `nucleus` of softmax(logits / temperature) at `top_p` (and `top_k`, `min_p`).
    `generator`, if given, must be a CPU generator.
    """
    if logits_1d.dim() != 1:
        raise ValueError(f"expected 1-D logits, got shape {tuple(logits_1d.shape)}")
    check_sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("sampling runs on CPU; pass a CPU torch.Generator")
    if temperature == 0.0:
        return greedy(logits_1d)
    ids, probs = nucleus(logits_1d, temperature, top_p, top_k, min_p)
    return int(ids[draw(probs, generator)])

"""Prefill-then-decode generation loop over a model's per-sequence state.

Model contract used here (and nothing more):
  state = model.new_state(capacity=N)
  logits = model.forward(ids, state)      # [T, vocab]; advances state.pos by T
  state.nbytes, state.free()
  model.device (torch.device), model.config.eos_token_id (int | list[int] | None)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from .sampling import sample_next


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]  # generated ids; ends with the stop id when one was hit
    prefill_seconds: float  # prompt forward + choosing the first token
    decode_seconds: float  # one forward + choice per further token
    prefill_tok_s: float
    decode_tok_s: float
    state_bytes: int  # state.nbytes after the last forward


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos]


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously; without a sync the timers would measure launch time.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(n: int, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else 0.0


def generate(
    model: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: Iterable[int] | None = None,
    capacity: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Run the prompt in one forward, then sample up to `max_new_tokens` ids one at a time.

    Stops early after emitting any id in `stop_ids` (default: the config's EOS ids; pass
    `[]` to never stop early). `on_token` is called with each generated id as soon as it
    is chosen. The state is always freed before returning or raising.
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        prompt = [int(i) for i in prompt_ids.tolist()]
    else:
        prompt = [int(i) for i in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty; generation needs at least one token (e.g. BOS)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0.0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    stops = set(_eos_ids(model) if stop_ids is None else (int(i) for i in stop_ids))
    if capacity is None:
        capacity = len(prompt) + max_new_tokens

    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()  # fresh entropy: unseeded runs differ
    else:
        generator.manual_seed(seed)

    device: torch.device = getattr(model, "device", torch.device("cpu"))
    tokens: list[int] = []

    def choose(logits: torch.Tensor) -> int:
        tok = sample_next(logits[-1], temperature, top_p, generator)
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        return tok

    state = model.new_state(capacity=capacity)
    try:
        with torch.no_grad():
            _sync(device)
            t0 = time.perf_counter()
            logits = model.forward(prompt, state)
            tok = choose(logits) if max_new_tokens > 0 else None
            _sync(device)
            t1 = time.perf_counter()
            # The last chosen token is never fed back: nothing would read its logits.
            while tok is not None and len(tokens) < max_new_tokens and tok not in stops:
                logits = model.forward([tok], state)
                tok = choose(logits)
            _sync(device)
            t2 = time.perf_counter()
        state_bytes = int(state.nbytes)
    finally:
        state.free()

    decode_steps = max(len(tokens) - 1, 0)
    return GenerationResult(
        prompt_tokens=len(prompt),
        tokens=tokens,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        prefill_tok_s=_rate(len(prompt), t1 - t0),
        decode_tok_s=_rate(decode_steps, t2 - t1),
        state_bytes=state_bytes,
    )

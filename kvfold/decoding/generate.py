"""Prefill-then-decode generation loop over a model's per-sequence state, with optional
speculative decoding (a drafter proposes tokens, one forward verifies them).

Model contract used here (and nothing more):
  state = model.new_state(capacity=N)     # speculative: new_state(capacity=N, max_rewind=K)
  logits = model.forward(ids, state)      # [T, vocab]; advances state.pos by T
  logits = model.forward(ids, state, last_only=True)               # [1, vocab]: the prefill
  logits, hidden = model.forward(ids, state, return_hidden=True)   # only for drafters that read it
  state.pos, state.capacity, state.rewind_to(n) (speculative only), state.nbytes, state.free()
  model.device (torch.device), model.config.eos_token_id (int | list[int] | None)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from .sampling import sample_next
from .speculative import SPECULATIVE_KINDS, Drafter, make_drafter, verify_drafts


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]  # generated ids; ends with the stop id when one was hit
    prefill_seconds: float  # prompt forward + choosing the first token
    decode_seconds: float  # one forward (a verify pass when speculative) + choice per step
    prefill_tok_s: float
    decode_tok_s: float
    state_bytes: int  # state.nbytes after the last forward
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of those, how many the main model accepted
    acceptance_rate: float = 0.0  # accepted / drafted (0 when nothing was drafted)
    verify_steps: int = 0  # forward passes after the prefill (each emits 1 + its accepted drafts)


def generation_capacity(n_input: int, max_new_tokens: int, speculative: Any = None,
                        num_draft: int = 4) -> tuple[int, int]:
    """(capacity, max_rewind) of the state `generate` creates for `n_input` fed ids."""
    if speculative is None:
        return n_input + max_new_tokens, 0
    return n_input + max_new_tokens + num_draft + 1, num_draft + 1


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


class _Output:
    """The emitted tokens, the callback, and the stopping rule, shared by every decoding mode."""

    def __init__(self, context: list[int], limit: int, stops: set[int], on_token: Callable[[int], None] | None):
        self.tokens: list[int] = []
        self.context = context  # everything fed or chosen so far (the drafters' view)
        self.limit = limit
        self.stops = stops
        self.on_token = on_token

    def emit(self, tok: int) -> bool:
        """Record one chosen token; True when generation must stop after it."""
        self.tokens.append(tok)
        self.context.append(tok)
        if self.on_token is not None:
            self.on_token(tok)
        return tok in self.stops or len(self.tokens) >= self.limit


def _as_prompt(prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        return [int(i) for i in prompt_ids.tolist()]
    return [int(i) for i in prompt_ids]


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
    speculative: str | Drafter | None = None,
    num_draft: int = 4,
    state: Any = None,
    history: Sequence[int] | None = None,
    kv_dtype: str | None = None,
) -> GenerationResult:
    """Run the prompt in one forward, then choose up to `max_new_tokens` ids.

    Stops early after emitting any id in `stop_ids` (default: the config's EOS ids; pass
    `[]` to never stop early). `on_token` is called with each generated id as soon as it
    is chosen. The last chosen id is never fed to the model (nothing would read its logits).

    `speculative` ("ngram", "mtp" or a `Drafter`, which generate closes when done) drafts up to
    `num_draft` tokens per step and verifies them in one forward. Greedy output is the plain
    greedy output (barring an argmax near-tie within the ~1e-5 by which chunked logits differ
    from 1-token ones); sampled output has the plain sampling distribution (but, per seed,
    other tokens than plain sampling).

    `state`: continue an existing state (e.g. one restored from a session) instead of creating
    one; the prompt is fed at `state.pos` and the caller keeps ownership (it is not freed, and
    ends with `pos` = fed ids, the last generated id pending). `history`: the ids that state has
    consumed (`len(history) == state.pos`), which the drafters see as context. Without `state`,
    generate creates one (`capacity` overrides its size) and always frees it before returning
    or raising.
    """
    prompt = _as_prompt(prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids is empty; generation needs at least one token (e.g. BOS)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0.0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if speculative is not None:
        is_drafter = not isinstance(speculative, str) and hasattr(speculative, "propose") \
            and hasattr(speculative, "update")
        if not (is_drafter or (isinstance(speculative, str) and speculative in SPECULATIVE_KINDS)):
            raise ValueError(f"speculative must be None, one of {SPECULATIVE_KINDS} or a Drafter, got {speculative!r}")
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            raise ValueError(f"num_draft must be an int >= 1, got {num_draft!r}")
    stops = set(_eos_ids(model) if stop_ids is None else (int(i) for i in stop_ids))

    owns_state = state is None
    if owns_state:
        if history is not None:
            raise ValueError("history describes the ids a given state consumed; pass state= with it")
        hist: list[int] = []
        cap, max_rewind = generation_capacity(len(prompt), max_new_tokens, speculative, num_draft)
        if capacity is not None:
            cap = capacity
    else:
        if capacity is not None:
            raise ValueError("capacity sizes a state generate creates; a given state keeps its own")
        hist = [] if history is None else [int(i) for i in history]
        if history is not None and len(hist) != state.pos:
            raise ValueError(f"history has {len(hist)} ids but the state has consumed {state.pos}")
        cap, max_rewind = state.capacity, getattr(state, "max_rewind", 0)
        if speculative is not None and max_rewind < num_draft:
            raise ValueError(f"speculative decoding with num_draft={num_draft} needs a state with max_rewind >= "
                             f"{num_draft}, this one has {max_rewind}")

    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()  # fresh entropy: unseeded runs differ
    else:
        generator.manual_seed(seed)

    device: torch.device = getattr(model, "device", torch.device("cpu"))
    out = _Output(hist + prompt, max_new_tokens, stops, on_token)
    drafter: Drafter | None = None
    stats = {"drafted": 0, "accepted": 0, "steps": 0}
    try:
        if speculative is not None:  # before the main state: a refusal allocates nothing
            drafter = make_drafter(speculative, model, capacity=cap, max_rewind=max_rewind, temperature=temperature,
                                   top_p=top_p, generator=generator)
        if owns_state:
            kw = {} if kv_dtype is None else {"kv_dtype": kv_dtype}  # `kv_dtype="fp8"`: FP8 window/compressed KV
            state = model.new_state(capacity=cap, max_rewind=max_rewind, **kw) if speculative is not None \
                else model.new_state(capacity=cap, **kw)
        with torch.no_grad():
            _sync(device)
            t0 = time.perf_counter()
            done = _prefill(model, state, prompt, drafter, out, temperature, top_p, generator)
            _sync(device)
            t1 = time.perf_counter()
            while not done:
                done = _step(model, state, drafter, out, num_draft, temperature, top_p, generator, stats)
            _sync(device)
            t2 = time.perf_counter()
        state_bytes = int(state.nbytes)
    finally:
        try:
            if drafter is not None:
                drafter.close()
        finally:
            if owns_state and state is not None:
                state.free()

    tokens = out.tokens
    decode_steps = max(len(tokens) - 1, 0)
    drafted, accepted = stats["drafted"], stats["accepted"]
    return GenerationResult(
        prompt_tokens=len(prompt),
        tokens=tokens,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        prefill_tok_s=_rate(len(prompt), t1 - t0),
        decode_tok_s=_rate(decode_steps, t2 - t1),
        state_bytes=state_bytes,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        verify_steps=stats["steps"],
    )


def _forward(model: Any, ids: list[int], state: Any, drafter: Drafter | None, **kw):
    if drafter is not None and drafter.needs_hidden:
        return model.forward(ids, state, return_hidden=True, **kw)
    return model.forward(ids, state, **kw), None


def _prefill(model, state, prompt, drafter, out: _Output, temperature, top_p, generator) -> bool:
    """Feed the prompt, choose the first token; True when generation is already over."""
    start = state.pos
    if drafter is not None and drafter.needs_hidden:
        # Pieces of the model's own chunk size: the same math as one call, but the drafter
        # digests each piece's hidden streams before the next exists (bounded memory).
        piece = int(getattr(model, "max_chunk", 0)) or len(prompt)
        for a in range(0, len(prompt) - piece, piece):
            _, hidden = _forward(model, prompt[a:a + piece], state, drafter, last_only=True)
            drafter.update(hidden, start + a, prompt[a + 1:a + piece + 1])
        last = ((len(prompt) - 1) // piece) * piece
    else:
        last = 0
    # only the last row's logits are read: never materialise T x vocab for a long prompt
    logits, hidden = _forward(model, prompt[last:], state, drafter, last_only=True)
    if out.limit == 0:
        return True
    y = sample_next(logits[-1], temperature, top_p, generator)
    if out.emit(y):
        return True
    if drafter is not None:
        drafter.update(hidden, start + last, prompt[last + 1:] + [y])
    return False


def _step(model, state, drafter, out: _Output, num_draft, temperature, top_p, generator, stats) -> bool:
    """Feed the pending token (plus drafts, if any), choose the next token(s); True when done."""
    y = out.tokens[-1]
    pos0 = state.pos
    drafts: list[int] = []
    q = None
    if drafter is not None:
        # never draft past max_new_tokens (a step emits up to k + 1) nor past the capacity
        k = min(num_draft, out.limit - len(out.tokens) - 1, state.capacity - pos0 - 1)
        if k > 0:
            proposed, q = drafter.propose(list(out.context), k)
            drafts = [int(d) for d in proposed[:k]]
            q = q[:len(drafts)] if (q is not None and drafts) else None
    logits, hidden = _forward(model, [y] + drafts, state, drafter)
    if drafts:
        n, nxt = verify_drafts(logits, drafts, q, temperature, top_p, generator)
    else:
        n, nxt = 0, sample_next(logits[0], temperature, top_p, generator)
    stats["steps"] += 1
    stats["drafted"] += len(drafts)
    stats["accepted"] += n
    new = drafts[:n] + [nxt]
    m, done = 0, False
    for tok in new:
        m += 1
        if out.emit(tok):
            done = True
            break
    # consumed now: y and the first m - 1 emitted tokens; the m-th is pending
    if state.pos != pos0 + m:
        state.rewind_to(pos0 + m)
    if drafter is not None and not done:
        drafter.update(None if hidden is None else hidden[:m], pos0, new[:m])
    return done

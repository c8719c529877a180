"""Prefill-then-decode generation loop over a model's per-sequence state, with optional
speculative decoding (a drafter proposes tokens, one forward verifies them).

Model contract used here (and nothing more):
  state = model.new_state(capacity=N)     # speculative: new_state(capacity=N, max_rewind=K)
  logits = model.forward(ids, state)      # [T, vocab]; advances state.pos by T
  logits = model.forward(ids, state, last_only=True)               # [1, vocab]: the prefill
  logits, hidden = model.forward(ids, state, return_hidden=True)   # only for drafters that read it
  state.pos, state.capacity, state.rewind_to(n) (speculative only), state.nbytes, state.free()
  model.device (torch.device), model.config.eos_token_id (int | list[int] | None)
  model.config.vocab_size (only with logit_bias: its ids are checked against it)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from .draft_length import Acceptance, StepCosts, plan_drafts, shared_acceptance, shared_costs
from .logits import Sampler, SamplingRule
from .sampling import check_sampling
from .speculative import Drafter, check_speculative, make_drafter, verify_drafts


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
    # of the drafts at each draft position, the share accepted (a draft counts only when every
    # draft before it was accepted: what peers report per position)
    accepted_per_position: tuple[float, ...] = ()
    mean_accepted_length: float = 0.0  # tokens a step with drafts emitted on average: 1 + accepted / such steps


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
    adaptive_draft: bool = False,
    state: Any = None,
    history: Sequence[int] | None = None,
    kv_dtype: str | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    grammar: Any = None,
) -> GenerationResult:
    """Run the prompt in one forward, then choose up to `max_new_tokens` ids.

    Stops early after emitting any id in `stop_ids` (default: the config's EOS ids, none with
    `ignore_eos`; pass `[]` to never stop early), but not before `min_tokens` ids (the stop ids
    are masked until then). `on_token` is called with each generated id as soon as it is
    chosen. The last chosen id is never fed to the model (nothing would read its logits).

    `top_k`, `min_p`, the penalties and `logit_bias` shape each choice as vLLM defines them
    (`kvfold.decoding.logits`); the penalties count the prompt (repetition) and the ids
    generated so far. `grammar`: a `grammar.GrammarMatcher` the ids must follow.

    `speculative` ("ngram", "mtp" or a `Drafter`, which generate closes when done) drafts up to
    `num_draft` tokens per step and verifies them in one forward, whose rows run as decode rows:
    each verified position's logits are the bits plain decoding computes there, so greedy output
    is the plain greedy output; sampled output has the plain sampling distribution (but, per seed,
    other tokens than plain sampling). With `adaptive_draft` each step drafts the number of
    tokens, 0 to `num_draft`, that the measured acceptance and step costs say is fastest
    (draft_length.py; `kvfold generate` and `kvfold serve` turn it on); without it, always
    `num_draft`.

    `state`: continue an existing state (e.g. one restored from a session) instead of creating
    one; the prompt is fed at `state.pos` and the caller keeps ownership (it is not freed, and
    ends with `pos` = fed ids, the last generated id pending). `history`: the ids that state has
    consumed (`len(history) == state.pos`), which the drafters see as context. Without `state`,
    generate creates one (`capacity` overrides its size) and always frees it before returning
    or raising.
    """
    prompt = _as_prompt(prompt_ids)
    rule = SamplingRule(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                        logit_bias, min_tokens)
    stops = _checked_stops(model, prompt, max_new_tokens, rule, seed, stop_ids, ignore_eos, speculative, num_draft)
    hist, cap, max_rewind = _plan_state(state, history, capacity, len(prompt), max_new_tokens, speculative,
                                        num_draft)
    out = _Output(hist + prompt, max_new_tokens, stops, on_token)
    generator = _generator(seed)
    sampler = Sampler(rule, prompt=hist + prompt, stop_ids=sorted(stops), generator=generator, grammar=grammar)
    run = _Run(model, out, sampler, num_draft)
    if speculative is not None and adaptive_draft:
        run.acceptance = shared_acceptance(model, speculative if isinstance(speculative, str) else
                                           type(speculative).__name__, num_draft)
        mode = model.backend().key() if hasattr(model, "backend") else None
        run.costs = shared_costs(model, torch.get_num_threads(), mode)
    owns_state = state is None
    try:
        if speculative is not None:  # before the main state: a refusal allocates nothing
            run.drafter = make_drafter(speculative, model, capacity=cap, max_rewind=max_rewind,
                                       temperature=temperature, top_p=top_p, generator=generator)
        run.state = _new_state(model, cap, max_rewind, speculative, kv_dtype) if owns_state else state
        prefill_s, decode_s = run.timed(prompt)
        state_bytes = int(run.state.nbytes)
    finally:
        _release(run.drafter, run.state if owns_state else None)
    return _result(len(prompt), run, prefill_s, decode_s, state_bytes)


def _checked_stops(model, prompt: list[int], max_new_tokens, rule: SamplingRule, seed, stop_ids, ignore_eos,
                   speculative, num_draft) -> set[int]:
    """Refuse bad arguments (ValueError) before anything is allocated; the ids to stop after."""
    if not prompt:
        raise ValueError("prompt_ids is empty; generation needs at least one token (e.g. BOS)")
    stop_list = None if stop_ids is None else list(stop_ids)
    r = rule
    check_sampling(max_tokens=max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=seed, stop_ids=stop_list,
                   names={"max_tokens": "max_new_tokens"}, max_tokens_floor=0, top_k=r.top_k, min_p=r.min_p,
                   presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                   repetition_penalty=r.repetition_penalty, logit_bias=r.logit_bias, min_tokens=r.min_tokens,
                   vocab_size=model.config.vocab_size if r.logit_bias else None)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    if speculative is not None:
        check_speculative(speculative, num_draft)
    if stop_list is not None:
        return {int(i) for i in stop_list}
    return set() if ignore_eos else set(_eos_ids(model))


def _plan_state(state, history, capacity, n_prompt: int, max_new_tokens: int, speculative,
                num_draft: int) -> tuple[list[int], int, int]:
    """(ids the state has consumed, capacity, max_rewind) of the state generation runs on."""
    if state is None:
        if history is not None:
            raise ValueError("history describes the ids a given state consumed; pass state= with it")
        cap, max_rewind = generation_capacity(n_prompt, max_new_tokens, speculative, num_draft)
        return [], cap if capacity is None else capacity, max_rewind
    if capacity is not None:
        raise ValueError("capacity sizes a state generate creates; a given state keeps its own")
    hist = [] if history is None else [int(i) for i in history]
    if history is not None and len(hist) != state.pos:
        raise ValueError(f"history has {len(hist)} ids but the state has consumed {state.pos}")
    max_rewind = getattr(state, "max_rewind", 0)
    if speculative is not None and max_rewind < num_draft:
        raise ValueError(f"speculative decoding with num_draft={num_draft} needs a state with max_rewind >= "
                         f"{num_draft}, this one has {max_rewind}")
    return hist, state.capacity, max_rewind


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()  # fresh entropy: unseeded runs differ
    else:
        generator.manual_seed(seed)
    return generator


def _new_state(model: Any, capacity: int, max_rewind: int, speculative, kv_dtype: str | None):
    kw = {} if kv_dtype is None else {"kv_dtype": kv_dtype}  # `kv_dtype="fp8"`: FP8 window/compressed KV
    if speculative is None:
        return model.new_state(capacity=capacity, **kw)
    return model.new_state(capacity=capacity, max_rewind=max_rewind, **kw)


def _release(drafter: Drafter | None, owned_state: Any) -> None:
    """Close the drafter and free the state generate created, even if one of them raises."""
    try:
        if drafter is not None:
            drafter.close()
    finally:
        if owned_state is not None:
            owned_state.free()


def _result(n_prompt: int, run: "_Run", prefill_s: float, decode_s: float, state_bytes: int) -> GenerationResult:
    tokens = run.out.tokens
    return GenerationResult(
        prompt_tokens=n_prompt,
        tokens=tokens,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        prefill_tok_s=_rate(n_prompt, prefill_s),
        decode_tok_s=_rate(max(len(tokens) - 1, 0), decode_s),
        state_bytes=state_bytes,
        drafted=run.drafted,
        accepted=run.accepted,
        acceptance_rate=run.accepted / run.drafted if run.drafted else 0.0,
        verify_steps=run.steps,
        accepted_per_position=tuple(a / d for a, d in zip(run.accepted_at, run.drafted_at) if d),
        mean_accepted_length=1 + run.accepted / run.draft_steps if run.draft_steps else 0.0,
    )


@dataclass
class _Run:
    """One generation's loop: the model, its state and drafter, how tokens are chosen, and counts."""

    model: Any
    out: _Output
    sampler: Sampler
    num_draft: int
    state: Any = None
    drafter: Drafter | None = None
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    draft_steps: int = 0  # steps that verified drafts
    drafted_at: list[int] = field(default_factory=list)  # per draft position: drafts verified there
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted there
    # adaptive draft length (draft_length.py): this sequence's acceptance and the measured costs
    acceptance: Acceptance | None = None
    costs: StepCosts | None = None

    def __post_init__(self) -> None:
        self.drafted_at, self.accepted_at = [0] * self.num_draft, [0] * self.num_draft

    def timed(self, prompt: list[int]) -> tuple[float, float]:
        """Prefill, then step until done; returns (prefill seconds, decode seconds)."""
        device: torch.device = getattr(self.model, "device", torch.device("cpu"))
        with torch.no_grad():
            _sync(device)
            t0 = time.perf_counter()
            done = self.prefill(prompt)
            _sync(device)
            t1 = time.perf_counter()
            while not done:
                done = self.step()
            _sync(device)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def _forward(self, ids: list[int], **kw):
        if self.drafter is not None and self.drafter.needs_hidden:
            return self.model.forward(ids, self.state, return_hidden=True, **kw)
        return self.model.forward(ids, self.state, **kw), None

    def prefill(self, prompt: list[int]) -> bool:
        """Feed the prompt, choose the first token; True when generation is already over."""
        start = self.state.pos
        last = 0
        if self.drafter is not None and self.drafter.needs_hidden:
            # Pieces of the model's own chunk size: the same math as one call, but the drafter
            # digests each piece's hidden streams before the next exists (bounded memory).
            piece = int(getattr(self.model, "max_chunk", 0)) or len(prompt)
            for a in range(0, len(prompt) - piece, piece):
                _, hidden = self._forward(prompt[a:a + piece], last_only=True)
                self.drafter.update(hidden, start + a, prompt[a + 1:a + piece + 1])
            last = ((len(prompt) - 1) // piece) * piece
        # only the last row's logits are read: never materialise T x vocab for a long prompt
        logits, hidden = self._forward(prompt[last:], last_only=True)
        if self.out.limit == 0:
            return True
        y = self._choose(logits[-1])
        if self.out.emit(y) or self.sampler.finished:
            return True
        if self.drafter is not None:
            self.drafter.update(hidden, start + last, prompt[last + 1:] + [y])
        return False

    def _choose(self, logits_row: torch.Tensor) -> int:
        """The next id after what is out so far, recorded with the sampler (its grammar)."""
        tok = self._agree([self.sampler.choose(logits_row, self.out.tokens)])[0]
        self.sampler.accept(tok)
        return tok

    def _agree(self, ids: list[int]) -> list[int]:
        """Under tensor parallelism, rank 0's choice on every rank. Every rank computed the same
        logits bits (kvfold/parallel: the all-reduce is the same sum everywhere) and samples with
        the same seed, so a rank that chose otherwise is a bug, refused rather than followed."""
        tp = getattr(self.model, "tp", None)
        if tp is None:
            return ids
        got = list(tp.broadcast_objects(list(ids)))
        if got != list(ids):
            from ..parallel.group import TensorParallelError
            raise TensorParallelError(f"rank {tp.rank} chose {list(ids)} where rank 0 chose {got}")
        return got

    def _propose(self) -> tuple[list[int], torch.Tensor | None]:
        """This step's drafts and their probability rows (None: none, or a deterministic drafter)."""
        if self.drafter is None:
            return [], None
        # never draft past max_new_tokens (a step emits up to k + 1) nor past the capacity
        k = min(self.num_draft, self.out.limit - len(self.out.tokens) - 1, self.state.capacity - self.state.pos - 1)
        if k > 0 and self.costs is not None:
            k = plan_drafts([(self.acceptance, k)], self.costs)[0]
        if k <= 0:
            return [], None
        proposed, q = self.drafter.propose(list(self.out.context), k)
        drafts = self._agree([int(d) for d in proposed[:k]])
        return drafts, (q[:len(drafts)] if (q is not None and drafts) else None)

    def step(self) -> bool:
        """Feed the pending token (plus drafts, if any), choose the next token(s); True when done."""
        y, pos0 = self.out.tokens[-1], self.state.pos
        t0 = time.perf_counter()
        drafts, q = self._propose()
        t1 = time.perf_counter()
        # verify rows as decode rows: each row's logits are plain decoding's bits
        logits, hidden = self._forward([y] + drafts, **({"decode_rows": True} if drafts else {}))
        if self.costs is not None:
            _sync(getattr(self.model, "device", torch.device("cpu")))
            self.costs.record_draft(len(drafts), t1 - t0)
            self.costs.record_forward(1 + len(drafts), time.perf_counter() - t1)
        if drafts:
            n, nxt = verify_drafts(logits, drafts, q, self.sampler, self.out.tokens)
            n, code = self._agree([n, -1 if nxt is None else nxt])
            nxt = None if code < 0 else code
            if nxt is not None:
                self.sampler.accept(nxt)
        else:
            n, nxt = 0, self._choose(logits[0])
        self.steps += 1
        self.drafted += len(drafts)
        self.accepted += n
        if self.acceptance is not None:
            self.acceptance.record(len(drafts), n)
        self.draft_steps += bool(drafts)
        for j in range(len(drafts)):  # position j was drafted; accepted when all before it were
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < n
        new = drafts[:n] + ([] if nxt is None else [nxt])
        m, done = 0, False
        for tok in new:
            m += 1
            if self.out.emit(tok):
                done = True
                break
        done = done or self.sampler.finished  # the grammar ended on the last token
        # consumed now: y and the first m - 1 emitted tokens; the m-th is pending
        if self.state.pos != pos0 + m:
            self.state.rewind_to(pos0 + m)
        if self.drafter is not None and not done:
            self.drafter.update(None if hidden is None else hidden[:m], pos0, new[:m])
        return done

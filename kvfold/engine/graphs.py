"""Decode steps replayed from CUDA graphs: one graph per bucket, captured once.

A step's decode and verify rows run the model's capturable decode step (graph_step.py of
models/deepseek_v4 and models/glm5; an engine step's prefill chunks, if any, run the forward
beside it: `step_beside_forward`) in a bucket:
  * the smallest row count that holds its rows; a sequence brings one row, or several at
    consecutive positions (its last token and its drafts: a verify step);
  * the smallest context bound (a power of two from CONTEXT_MIN, at most the arena's capacity)
    above every row's position. The step's shapes, and so the pool entries its indexer and HCA
    read, follow the bound, not the arena's capacity.
The rows past the step's are padding in the arena's scratch slot. The graph's inputs are static
device tensors (tokens, positions and arena slots), refilled before each replay. Its state is
the `SlotArena`, whose tensors never move. So admission, cancellation, rewind and prefix hits
change only what the inputs and the page tables hold, and the captured graphs stay valid.

What could make a graph stale is a tensor it captured being replaced: a weight reassigned or
loaded anew, the page pool's storage, the arena's rings. Before every replay `signature()` is
compared with the one taken at capture: the address of every tensor the step reads, the
model's numerics and the kernels its Backend runs in the engine's mode (`Backend.key`). A difference
recaptures that bucket and counts it in `recaptures`; a graph is never replayed on what it was
not captured on. The step gets the model's Backend for the engine's batch-invariant mode, which
only DeepSeek-V4 with the Triton kernels keeps here (`graph_invariance_unsupported`).

On the CPU nothing is captured: each step runs the same function eagerly on the same static
tensors, through the same checks, so the engine's bookkeeping is the same on both devices. A
capture that fails on CUDA leaves that bucket eager, with the reason in `capture_errors`: the
step is slower, never wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from ..errors import CapacityError, ConfigError, SharedPageWriteError, StateMismatchError

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT_MIN = 256

# Parameter, buffer and submodule registrations anywhere in the process (a weight reassigned, a
# module replaced): where one happened, the slots a signature reads are listed again.
_REGISTRATIONS = [0]


def _registered(*_):
    _REGISTRATIONS[0] += 1


for _hook in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
              register_module_module_registration_hook):
    _hook(_registered)


# what `DecodeGraphs.stats` reports (an engine without graph decode reports them as 0)
GRAPH_STATS = ("graph_steps", "graph_draft_rows", "graph_captures", "graph_recaptures", "graph_replays",
               "graph_buckets", "graph_capture_errors")


def buckets_for(max_batch: int) -> list[int]:
    """The row counts graphs are captured at: powers of two below `max_batch`, then max_batch."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


@dataclass
class _Bucket:
    context: int
    # [B, 3 + E] long, one host copy a step: each row's token, position, arena slot and its
    # state's `graph_inputs` (E of them)
    inputs: torch.Tensor
    logits: torch.Tensor | None = None  # [B, vocab]: the graph's outputs (CUDA)
    streams: torch.Tensor | None = None  # [B, hc, hidden]
    graph: object = None  # torch.cuda.CUDAGraph
    signature: tuple | None = None
    capture_error: str | None = None  # why this bucket runs eagerly on CUDA

    def step_inputs(self) -> tuple:
        """(tokens, positions, slots, extras or None): views of `inputs`, the step's arguments."""
        i = self.inputs
        return i[:, 0], i[:, 1], i[:, 2], (i[:, 3:] if i.shape[1] > 3 else None)


class DecodeGraphs:
    def __init__(self, model, arena, max_batch: int, batch_invariant: bool | None = None):
        """`max_batch`: the most rows a step runs (the largest bucket). `batch_invariant`: the
        steps' mode (an engine's own); None: the model's as it is now."""
        self.batch_invariant = model.batch_invariant if batch_invariant is None else bool(batch_invariant)
        why = model.graph_unsupported(self.batch_invariant)
        if why is not None:
            raise ConfigError(why)
        self.model, self.arena, self.step_fn = model, arena, model.decode_graph_step
        self.capture = arena.device.type == "cuda"
        self.buckets = buckets_for(max_batch)
        self._buckets: dict[tuple[int, int], _Bucket] = {}  # (batch size, context bound)
        self._pool = None  # the graphs' shared CUDA memory pool
        self._slots, self._slots_at = None, -1  # (parameter or buffer table, name) of every module
        self.captures = self.recaptures = self.replays = self.steps = 0  # replays: on CUDA, every step
        self.draft_rows = 0  # rows past each sequence's first: drafts verified in graph steps
        self.capture_errors: list[str] = []

    @classmethod
    def for_engine(cls, model, pages, max_running: int, max_seq_len: int, max_rewind: int,
                   batch_invariant: bool) -> "DecodeGraphs":
        """An engine's graphs: an arena of max_running slots of max_seq_len in its page pool, buckets
        up to every running sequence's verify rows, in the engine's batch-invariant mode.
        ConfigError where graph decode cannot run."""
        if pages is None:
            raise ConfigError("decode_graphs reads the compressed pools through the shared page pool; "
                              "leave kv_page_bytes at None or > 0 (a model with the `pages` capability)")
        why = model.graph_unsupported(batch_invariant)
        if why is not None:
            raise ConfigError(why)
        arena = model.new_decode_arena(max_running, max_seq_len, pages, max_rewind)
        return cls(model, arena, max_running * (max_rewind + 1), batch_invariant)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise CapacityError(f"a graph step takes at most {self.buckets[-1]} rows, got {n}")

    def context_bucket(self, end: int) -> int:
        """The context bucket of a step whose positions are all below `end`."""
        c = CONTEXT_MIN
        while c < end:
            c *= 2
        return min(c, self.arena.capacity)

    def signature(self) -> tuple:
        """What a captured graph depends on: every tensor address it reads (the arena's, and every
        parameter and buffer slot of the model, read live: a reassigned weight or a `.data` moved
        shows), and the numerics."""
        m = self.model
        if self._slots is None or self._slots_at != _REGISTRATIONS[0]:  # the model's modules may have changed
            self._slots_at = _REGISTRATIONS[0]
            self._slots = [(table, name) for mod in m.modules() for table in (mod._parameters, mod._buffers)
                           for name in table]
        ptrs = [t.data_ptr() for t in self.arena.tensors() + getattr(m, "graph_tensors", list)()]
        ptrs += [None if table[name] is None else table[name].data_ptr() for table, name in self._slots]
        return m.numerics, m.backend(self.batch_invariant).key(), tuple(ptrs)

    def check(self, pairs: list) -> None:
        """Every refusal of a step, before anything is written: each state must be live, in this
        arena, with room for its rows (at most max_rewind + 1: the rings' slack), and must own the
        pages they write."""
        seen = set()
        for ids, st in pairs:
            st.check_usable(self.model.fingerprint, self.model.device, self.model.dtype)
            if st.arena is not self.arena or self.arena.holders[st.slot] is not st:
                raise StateMismatchError("graph decode runs states made in its arena: new_state(..., arena=arena)")
            if st.slot in seen:
                raise StateMismatchError("a graph step got the same state twice; a state advances once per step")
            seen.add(st.slot)
            t = len(ids)
            if t < 1 or t > self.arena.max_rewind + 1:
                raise CapacityError(f"a graph step runs 1 to max_rewind + 1 = {self.arena.max_rewind + 1} rows of a "
                                    f"sequence (what its rings hold beyond the window), got {t}")
            if st.pos + t > st.capacity:
                raise CapacityError(f"{t} rows at pos {st.pos} would pass the state's capacity {st.capacity}")
            page = st.shared_page_in(st.pos, st.pos + t)
            if page is not None:
                raise SharedPageWriteError(f"the pool rows of positions [{st.pos}, {st.pos + t}) fall in page {page}, "
                                           f"which other holders reference; shared pages are immutable")

    def step(self, pairs: list, hidden: bool = False):
        """One or more rows for each (token ids, state) pair (an int: one token): logits [rows,
        vocab] fp32, the pairs' rows in order, each state advanced past its rows; with `hidden`
        also the rows' final streams [rows, hc, hidden] (what an MTP drafter reads)."""
        pairs = [([ids] if isinstance(ids, int) else [int(i) for i in ids], st) for ids, st in pairs]
        self.check(pairs)
        plans = [st.graph_inputs(len(ids)) for ids, st in pairs]
        rows = torch.tensor([[tok, st.pos + j, st.slot, *plan] for (ids, st), plan in zip(pairs, plans)
                             for j, tok in enumerate(ids)], dtype=torch.long)
        n = rows.shape[0]
        b = self._ready(self.bucket(n), self.context_bucket(int(rows[:, 1].max()) + 1), rows.shape[1] - 3)
        host = self._padding(b.inputs.shape[0], rows.shape[1])
        host[:n] = rows
        b.inputs.copy_(host)
        if b.graph is not None:
            b.graph.replay()
            self.replays += 1
            logits, streams = b.logits, b.streams
        else:
            logits, streams = self._run(b)
        for ids, st in pairs:
            st.after_graph_step(len(ids))
        self.steps += 1
        self.draft_rows += n - len(pairs)
        return (logits[:n].clone(), streams[:n].clone()) if hidden else logits[:n].clone()

    def step_beside_forward(self, pairs: list, decoding: list[bool], last_only: list[bool], hidden: bool):
        """An engine step: the `decoding` pairs (decode and verify rows) as one graph step, every
        row's logits; the others (prefill chunks) as one forward, with their `last_only` flags.
        So a sequence's decode rows take one path whatever shares their step (in batch-invariant
        mode their bits do not depend on the load). -> logits per pair in order (with `hidden`:
        (logits, final streams) per pair)."""
        out = [[None] * len(pairs), [None] * len(pairs)]
        decode = [i for i, d in enumerate(decoding) if d]
        prefill = [i for i, d in enumerate(decoding) if not d]
        if decode:
            rows = self.step([(list(pairs[i][0]), pairs[i][1]) for i in decode], hidden=hidden)
            for part, got in zip(out, rows if hidden else (rows,)):
                for i, r in zip(decode, got.split([len(pairs[i][0]) for i in decode])):
                    part[i] = r
        if prefill:
            got = self.model.forward_batch([pairs[i] for i in prefill], last_only=[last_only[i] for i in prefill],
                                           return_hidden=hidden, batch_invariant=self.batch_invariant)
            for part, per_pair in zip(out, got if hidden else (got,)):
                for i, r in zip(prefill, per_pair):
                    part[i] = r
        return tuple(out) if hidden else out[0]

    def _run(self, b: _Bucket) -> torch.Tensor:
        ops = self.model.backend(self.batch_invariant)  # the model's kernels in the engine's mode
        with torch.inference_mode():
            tokens, positions, slots, extras = b.step_inputs()
            return self.step_fn(ops, self.arena, tokens, positions, slots, b.context, extras)

    def _ready(self, size: int, context: int, n_extras: int) -> _Bucket:
        """The bucket's graph, captured now if it never was or if what it captured has changed."""
        sig = self.signature()
        b = self._buckets.get((size, context))
        if b is not None and b.signature == sig:
            return b
        why = self.model.graph_unsupported(self.batch_invariant)  # what changed may be the numerics
        if why is not None:
            raise ConfigError(why)
        if b is not None:
            self.recaptures += 1
        b = _Bucket(context, self._padding(size, 3 + n_extras).to(self.arena.device))
        if self.capture:
            try:
                self._capture(b)
            except Exception as exc:  # the step itself is the same eagerly: run it so, and say why
                b.graph, b.logits, b.streams = None, None, None
                b.capture_error = f"bucket {size} x {context}: {exc!r}"
                self.capture_errors.append(b.capture_error)
        b.signature = sig
        self._buckets[(size, context)] = b
        self.captures += 1
        return b

    def _padding(self, size: int, width: int) -> torch.Tensor:
        """Host inputs of `size` padding rows: token 0 at position 0 in the scratch slot."""
        pad = torch.zeros(size, width, dtype=torch.long)
        pad[:, 2] = self.arena.scratch
        return pad

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream, then capture; every row is padding then, so the runs write
        only the scratch slot and page."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.logits, b.streams = self._run(b)
        b.graph = graph

    def stats(self) -> dict[str, int]:
        return dict(zip(GRAPH_STATS, (self.steps, self.draft_rows, self.captures, self.recaptures, self.replays,
                                      len(self._buckets), len(self.capture_errors))))

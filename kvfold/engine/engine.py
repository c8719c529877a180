"""`kvfold.Engine`: continuous batching over exact per-sequence states, with a prefix cache.

Each `step()` admits waiting requests that fit, then advances every running sequence with ONE
`model.forward_batch` call: a decode token for each sequence past its prompt, plus prefill
chunks under a per-step token budget. Prefill chunks always end at multiples of
`prefill_chunk` (a multiple of 128), whatever the load, so a sequence's computation is the same
split of the same tokens whether it ran alone, batched, or resumed from the prefix cache.

DeepSeek-V4 states keep their compressed pools in one shared `PagePool` (pages of 128 tokens,
reserved whole at admission, returned at finish or cancel), so a prefix-cache hit reuses the
cached pages by reference and only the per-sequence rest is restored from a snapshot.

Not thread-safe: call it from one thread (`AsyncEngine` does that for the server).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from ..decoding.grammar import request_grammar
from ..errors import CacheFileError, InvalidRequestError, QueueFullError, RequestTooLongError, SnapshotError
from .checkpoint import Checkpoint, resumes, start_from_checkpoint, take_checkpoint
from .graphs import DecodeGraphs
from .disk_cache import DiskHit, engine_prefix_cache
from .latency import RequestLatency
from .scheduler import Scheduler
from .sequence import RequestOutput, SamplingParams, Sequence
from .replicas import HEARTBEAT_S, EngineReplicas
from .sizing import BLOCK, check_limits, page_pool
from .speculation import EngineSpeculation
from .transcripts import continue_conversation, conversation_store, record_conversation
from .stats import engine_metrics



@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int


class Engine:
    def __init__(self, model: Any, *, max_seq_len: int = 4096, max_running: int = 16, max_queue: int = 256,
                 max_batch_tokens: int = 512, prefill_chunk: int = BLOCK, max_state_bytes: int | None = None,
                 prefix_cache_bytes: int = 256 << 20, kv_page_bytes: int | None = None,
                 batch_invariant: bool | None = None, speculative: str | None = None, num_draft: int = 4,
                 adaptive_draft: bool = False, decode_graphs: bool = False, cache_dir: str | None = None,
                 cache_disk_bytes: int = 0, conversations: int = 0):
        """`max_seq_len`: prompt + max_tokens limit per request (its state is sized to exactly
        that much). `max_running`: sequences holding a state at once. `max_queue`: requests
        waiting beyond those (more are refused with QueueFullError). `max_batch_tokens`: tokens
        fed per step. `prefill_chunk`: prefill chunk and prefix-cache block size, a multiple of
        128. `max_state_bytes`: bound on the bytes of all live states (None: no bound beyond
        max_running). `prefix_cache_bytes`: budget of the prefix cache: its snapshots plus the pages
        only it still holds (0 disables it). `cache_dir`, `cache_disk_bytes`: the prefix cache's disk
        tier (disk_cache.py): evicted entries, and all of them at `flush_prefix_cache()`, kept there
        as full snapshots under that budget, found again by any engine of the same model.
        `kv_page_bytes`: size of the shared page pool of compressed KV (models with the `pages`
        capability); None: room for max_running sequences of max_seq_len tokens (at most
        max_state_bytes, at least one such sequence); 0: private per-sequence pools, no page
        sharing. `batch_invariant`: this engine's mode, passed to every model call it makes (the
        model object's own, `set_batch_invariant`, is left as it is): on, a request's tokens never
        depend on what else is running; None (default) where the model supports it (fp32 on the
        CPU with native kernels), True insists (ConfigError where it cannot hold), False: torch's
        kernels, whose last bits may change with the batch.
        `speculative`: None, "ngram" or "mtp" (the checkpoint's MTP layer; MtpUnavailableError
        without one): every decoding sequence drafts up to `num_draft` tokens a step (with
        `adaptive_draft`, as many as measurement says pay), verified in the step's forward
        (speculation.py); greedy output is unchanged, sampling keeps each request's distribution.
        `decode_graphs`: run every step's decode and verify rows as the model's capturable step,
        replayed from one CUDA graph per bucket on a CUDA model (graphs.py; on the CPU eagerly),
        its prefill chunks as one forward call beside it; states live in a `SlotArena` of
        max_running slots. It needs the shared page pool (kv_page_bytes not 0) and a model with
        that step (DeepSeek-V4 or GLM-5.3, numerics "hf", plain expert stacks), outside
        batch-invariant mode (batch_invariant=None leaves it off then) except for DeepSeek-V4 with
        the Triton kernels on (`graph_invariance_unsupported`): ConfigError otherwise. Its rows
        agree with the forward's to rounding, not bit for bit. `conversations`: keep up to this
        many tokens of the conversations the engine produced (0: none), so that a prompt rendering
        one again continues its exact state (transcripts.py); off under graph decode."""
        batch_invariant = check_limits(
            model, max_seq_len=max_seq_len, max_running=max_running, max_queue=max_queue,
            max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes,
            kv_page_bytes=kv_page_bytes, batch_invariant=batch_invariant, decode_graphs=decode_graphs)
        spec = (model, speculative, num_draft, batch_invariant, adaptive_draft)
        self.spec = None if speculative is None else EngineSpeculation(*spec)
        # under tensor parallelism rank 0 schedules and the other ranks follow (replicas.py)
        self._replicas = EngineReplicas(self, model.tp) if getattr(model, "tp", None) is not None else None
        self.heartbeat_s = HEARTBEAT_S if self._replicas is not None else None
        self.max_rewind = self.spec.max_rewind if self.spec is not None else 0
        self.model = model
        model.invariance_refusal(batch_invariant)
        self.batch_invariant = batch_invariant  # this engine's own: the model's mode stays as it is
        self.tokenizer = model.tokenizer
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.vocab_size = model.config.vocab_size
        self.eos_ids = frozenset(int(i) for i in model.config.eos_ids)
        self._fixed_bytes, self._pools = model.state_layout(self.max_rewind)
        self.max_state_bytes = math.inf if max_state_bytes is None else max_state_bytes
        self.scheduler = Scheduler(max_running=max_running, max_queue=max_queue,
                                   max_state_bytes=self.max_state_bytes, max_batch_tokens=max_batch_tokens,
                                   prefill_chunk=prefill_chunk)
        self.pages = page_pool(model, kv_page_bytes, max_running, max_seq_len, self.max_state_bytes, prefill_chunk,
                               extra=1 if decode_graphs else 0)  # the arena's scratch page
        self.graphs = None
        if decode_graphs:
            self.graphs = DecodeGraphs.for_engine(model, self.pages, max_running, max_seq_len, self.max_rewind,
                                                  batch_invariant)
        self.prefix_cache = engine_prefix_cache(model, self.pages, prefill_chunk, prefix_cache_bytes,
                                                self.max_rewind, cache_dir, cache_disk_bytes)
        self.transcripts = conversation_store(model, conversations, decode_graphs)  # (see `conversations`)
        self._seqs: dict[str, Sequence] = {}  # every unfinished request
        self.latency = RequestLatency()
        self._ids = itertools.count()
        self._c = dict.fromkeys(
            ["requests_added", "requests_rejected", "requests_cancelled", "finished_stop", "finished_length",
             "finished_error", "prompt_tokens", "prefill_tokens", "generation_tokens", "steps", "batch_seqs",
             "batch_tokens", "last_batch_seqs", "last_batch_tokens", "states_allocated", "states_freed"], 0)

    def flush_prefix_cache(self) -> int:
        """Write every prefix-cache entry not yet on disk (a clean shutdown; no disk tier: nothing).
        Call it when no step runs. Returns how many entries were written."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    @property
    def arena(self):
        """The `SlotArena` graph decode's states live in (None without decode_graphs)."""
        return None if self.graphs is None else self.graphs.arena

    def _state_kw(self) -> dict:
        """What every new state of this engine is made with (new_state's keywords)."""
        kw = {"max_rewind": self.max_rewind}
        if self.pages is not None:
            kw["pages"] = self.pages
        if self.arena is not None:
            kw["arena"] = self.arena
        return kw

    # ---- sizes -------------------------------------------------------------------------------
    def state_bytes(self, capacity: int) -> int:
        """Exact `nbytes` of a sequence's state of `capacity` positions (and its drafter's), known
        before allocating it."""
        drafter = self.spec.state_bytes(capacity) if self.spec is not None else 0
        return self._fixed_bytes + sum(-(-capacity // r) * row for r, row in self._pools) + drafter

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int] | torch.Tensor, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Refusals happen here, before any work:
        InvalidRequestError (bad ids or parameters), RequestTooLongError (prompt + max_tokens over
        max_seq_len, or a state over max_state_bytes), QueueFullError (max_queue requests waiting)."""
        return self.add_choices(prompt_ids, [params], None if request_id is None else [request_id])[0]

    def add_choices(self, prompt_ids: Seq[int] | torch.Tensor, params: Seq[SamplingParams | None],
                    request_ids: Seq[str] | None = None, checkpoint: Checkpoint | None = None) -> list[str]:
        """Queue one request per `params` on the same prompt (OpenAI's `n`); returns their ids.
        The prompt is prefilled once: when that prefill ends, the other choices start from a
        copy of its state (paged states share its whole pages by reference and copy only the
        rest), then each goes on alone. Refusals as `add_request`, for all of them or none.
        Cancelling the first choice before its prefill ends stops its output only: its prefill
        still runs for the others. `checkpoint`: an exact starting point for the prompt and/or a
        request for the one its prefill leaves (checkpoint.py; ignored under tensor parallelism,
        whose ranks each hold a shard of the state)."""
        ids = list(request_ids) if request_ids is not None else [None] * len(params)
        if self._replicas is not None and self._replicas.leader:
            params = self._replicas.prepare(list(params))
            prompt_ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        named = [i for i in ids if i is not None]
        if not params or len(ids) != len(params) or len(set(named)) < len(named):
            raise InvalidRequestError("add_choices needs one or more params and, if given, as many distinct ids")
        try:
            prompt_ids, spans = continue_conversation(self, prompt_ids)
            seqs = [self._make_sequence(prompt_ids, p, rid, spans) for p, rid in zip(params, ids)]
            leader = seqs[0]
            leader.checkpoint = checkpoint if self._replicas is None else None
            leader.followers = seqs[1:]
            for f in leader.followers:
                f.leader = leader
            self._check_fits(leader)
            self.scheduler.add(leader)
        except (InvalidRequestError, QueueFullError):
            self._c["requests_rejected"] += len(params)
            raise
        for seq in seqs:
            self._seqs[seq.request_id] = seq
            self.latency.arrived(seq.request_id)
        self._c["requests_added"] += len(seqs)
        self._c["prompt_tokens"] += len(leader.prompt)
        rids = [seq.request_id for seq in seqs]
        if self._replicas is not None:
            self._replicas.record("add", list(leader.prompt), list(params), rids)
        return rids

    def _make_sequence(self, prompt_ids, params, request_id, decode_spans=()) -> Sequence:
        params = SamplingParams() if params is None else params
        params.validate(self.vocab_size)
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        prompt = list(prompt_ids)
        if not prompt or not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            raise InvalidRequestError("the prompt must be a non-empty list of token ids")
        bad = [i for i in prompt if not 0 <= i < self.vocab_size]
        if bad:  # refused here: one bad id in a batched forward would refuse the whole batch
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stop_ids = (frozenset() if params.ignore_eos else self.eos_ids) | {int(i) for i in params.stop_token_ids or ()}
        grammar = request_grammar(params.grammar, self.tokenizer, self.vocab_size)
        seq = Sequence(request_id, prompt, params, frozenset(stop_ids), self.tokenizer, grammar=grammar,
                       decode_spans=decode_spans)
        if seq.capacity > self.max_seq_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {seq.capacity} passes "
                f"max_seq_len {self.max_seq_len}; shorten the prompt or lower max_tokens")
        return seq

    def _group_bytes(self, seq: Sequence) -> int:
        return sum(self.state_bytes(s.capacity) for s in [seq, *seq.followers])

    def _group_pages(self, seq: Sequence, cached: int = 0) -> int:
        """Pages a sequence and its followers need at admission: each its own pages, less the
        prompt's whole pages that the followers share and the `cached` tokens' the first reuses."""
        pt = self.pages.page_tokens
        shared = len(seq.prompt) // pt
        return self.pages.pages_for(seq.capacity) - cached // pt + \
            sum(self.pages.pages_for(f.capacity) - shared for f in seq.followers)

    def _check_fits(self, seq: Sequence) -> None:
        """RequestTooLongError for a request (with its followers) that could never be admitted."""
        need = self._group_bytes(seq)
        if need > self.max_state_bytes:
            raise RequestTooLongError(
                f"this request's state{'s' if seq.followers else ''} need{'' if seq.followers else 's'} {need} bytes, "
                f"more than max_state_bytes {self.max_state_bytes} for all sequences together; lower max_tokens, n "
                f"or the prompt length")
        if seq.width > self.scheduler.max_running:
            raise InvalidRequestError(f"n={seq.width} choices are more than this engine runs at once "
                                      f"(max_running={self.scheduler.max_running})")
        if self.pages is not None and self._group_pages(seq) > self.pages.num_pages:
            raise RequestTooLongError(
                f"this request needs {self._group_pages(seq)} KV pages of {self.pages.page_tokens} tokens, more "
                f"than the pool's {self.pages.num_pages}; lower max_tokens, n or the prompt length")

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its state now. False if it is unknown or done.
        A first choice whose prefill other choices still wait for goes on prefilling, silently."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.latency.forget(request_id)
        if self._replicas is not None:
            self._replicas.record("cancel", request_id)
        self._c["requests_cancelled"] += 1
        leader = seq.leader
        if leader is not None and seq in leader.followers:  # not started yet: give back its reservation
            leader.followers.remove(seq)
            self.scheduler.shrink_reservation(leader, self.state_bytes(seq.capacity))
            if leader.ghost and not leader.followers:
                self._drop(leader)
        elif seq.followers:
            seq.ghost = True
        else:
            self._drop(seq)
        return True

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._release(seq)

    def cancel_all(self) -> int:
        """Cancel every unfinished request; returns how many there were."""
        return sum(self.cancel(rid) for rid in list(self._seqs))

    def clear_prefix_cache(self) -> None:
        """Drop every prefix-cache entry; pages only the cache held go back to the pool."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self._replicas is not None:
            self._replicas.record("clear")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one batched forward, choose tokens. Returns one output per
        request that produced a token, finished, or failed this step. Under tensor parallelism
        every rank steps together: rank 0's changes since the last step first, its tokens after."""
        if self._replicas is None:
            outputs = self._step()
        elif not self._replicas.sync_ops():
            return []
        else:
            outputs = self._step()
            self._replicas.agree(outputs)
        self.latency.observe(outputs)
        return outputs

    def follow(self) -> None:
        """A follower rank (tp rank > 0): step as rank 0 says until it stops (`stop_followers`)."""
        self._replicas.follow()

    def stop_followers(self) -> None:
        """Rank 0 under tensor parallelism: end the followers' loops (at shutdown); else nothing."""
        if self._replicas is not None:
            self._replicas.stop()

    def _run_batch(self, batch: list, wants_prompt: list[bool], hidden: bool):
        """Each pair's logits (with `hidden`: and its final streams), in batch order: one forward,
        or with graph decode the decode rows as a graph step beside the prefill chunks' forward."""
        pairs = [(ids, seq.state) for seq, ids in batch]
        last_only = [not (w or seq.drafts) for w, (seq, _) in zip(wants_prompt, batch)]
        if self.graphs is not None:
            return self.graphs.step_beside_forward(pairs, [seq.output for seq, _ in batch], last_only, hidden)
        return self.model.forward_batch(pairs, last_only=last_only, batch_invariant=self.batch_invariant,
                                        decode_rows=[bool(seq.drafts) for seq, _ in batch],  # verify rows
                                        **({"return_hidden": True} if hidden else {}))

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for seq in self.scheduler.admit(self._group_bytes, self._pages_fit):
            self._start(seq, outputs)
        if self.spec is not None:
            self.spec.plan_step(self.scheduler.running)
        batch = self.scheduler.plan(self.spec.decode_input if self.spec is not None else None)
        if not batch:
            return outputs
        wants_prompt = [seq.prompt_logprobs is not None and seq.prefilling for seq, _ in batch]
        hidden = self.spec is not None and self.spec.needs_hidden
        started = time.perf_counter()
        try:
            out = self._run_batch(batch, wants_prompt, hidden)
            if self.spec is not None:
                self.spec.timed(batch, started)
        except Exception as exc:  # the whole batch is suspect: end its requests, keep serving the rest
            for seq, _ in batch:
                self._fail(seq, f"model forward failed: {exc!r}", outputs)
            return outputs
        logits, streams = out if hidden else (out, [None] * len(batch))
        self._count_batch(batch)
        for (seq, ids), lg, prompt_rows, h in zip(batch, logits, wants_prompt, streams):
            start = seq.state.pos - len(ids)
            if seq.drafts:
                self._verify(seq, lg, h, start, outputs)
                continue
            if not seq.output:  # a prefill chunk
                if prompt_rows:
                    seq.record_prompt_logprobs(start, lg)
                self._maybe_snapshot(seq)
                if seq.prefilling:  # the prompt goes on next step; these logits are not read
                    self._feed(seq, h, start, len(ids))
                    continue
                if seq.followers:
                    self._fork(seq, lg[-1], outputs)
                if seq.ghost:
                    self._drop(seq)
                    continue
            self._choose(seq, lg[-1], outputs)
            self._feed(seq, h, start, len(ids))
        return outputs

    def _feed(self, seq: Sequence, hidden, start: int, n: int) -> None:
        """Tell the drafter (if any) that positions start .. start + n - 1 are verified: the tokens
        one position later are the prompt's, then the ones chosen (the last just now)."""
        if self.spec is not None:
            a, b, p = start + 1, start + 1 + n, len(seq.prompt)
            self.spec.feed(seq, hidden, start, seq.prompt[a:b] + seq.output[max(0, a - p):max(0, b - p)])

    def _verify(self, seq: Sequence, logits: torch.Tensor, hidden, start: int, outputs: list[RequestOutput]) -> None:
        """A decoding sequence's verify rows: keep the accepted drafts and the next token, rewind its
        state past the rest (speculation.py)."""
        try:
            n, m = seq.choose_verified(logits, seq.drafts, seq.draft_probs)
        except Exception as exc:  # as in _choose: this request only
            self._fail(seq, f"could not choose a token: {exc!r}", outputs)
            return
        self.spec.count(seq, len(seq.drafts), n)
        self._c["generation_tokens"] += m
        outputs.append(seq.take_output())
        if seq.finish_reason is not None:
            self._finish(seq)
            return
        seq.state.rewind_to(start + m)  # fed: the last token and the first m - 1 kept; the m-th is pending
        self._feed(seq, None if hidden is None else hidden[:m], start, m)

    def _count_batch(self, batch) -> None:
        n_tokens = sum(len(ids) for _, ids in batch)
        self._c.update(steps=self._c["steps"] + 1, last_batch_seqs=len(batch), last_batch_tokens=n_tokens)
        self._c["batch_seqs"] += len(batch)
        self._c["batch_tokens"] += n_tokens
        self._c["prefill_tokens"] += sum(len(ids) for seq, ids in batch if not seq.output)

    def _choose(self, seq: Sequence, logits_row: torch.Tensor, outputs: list[RequestOutput]) -> None:
        try:
            seq.choose(logits_row)
        except Exception as exc:  # e.g. a grammar and min_tokens that leave no token: this request only
            self._fail(seq, f"could not choose a token: {exc!r}", outputs)
            return
        self._c["generation_tokens"] += 1
        outputs.append(seq.take_output())
        if seq.finish_reason is not None:
            self._finish(seq)

    def _fork(self, leader: Sequence, logits_row: torch.Tensor, outputs: list[RequestOutput]) -> None:
        """Start the followers of a leader whose prefill just ended from a copy of its state: a
        paged state gives them its whole prompt pages by reference (and the rest in a snapshot
        without those rows); each then chooses its first token from the leader's last logits."""
        followers, leader.followers = leader.followers, []
        kw, prefix = self._state_kw(), {}
        if self.pages is not None:
            whole = len(leader.prompt) // self.pages.page_tokens * self.pages.page_tokens
            prefix = {"prefix_pages": leader.state.share_prefix(whole)}
        blob = leader.state.snapshot(pools=self.pages is None)
        try:
            for f in followers:
                own = self.state_bytes(f.capacity)
                self.scheduler.start_follower(leader, f, own)
                try:
                    f.state = self.model.new_state(capacity=f.capacity, **kw, **prefix)
                    f.state.restore(blob)
                except Exception as exc:
                    self._fail(f, f"could not copy the first choice's state: {exc!r}", outputs)
                    continue
                self._c["states_allocated"] += 1
                f.cached_tokens = leader.cached_tokens
                if leader.prompt_logprobs is not None:
                    f.prompt_logprobs = list(leader.prompt_logprobs)
                self._attach_drafter(f)
                self._choose(f, logits_row, outputs)
        finally:
            if prefix:
                self.pages.decref(prefix["prefix_pages"])  # share_prefix's reference: the followers took theirs

    def _keys(self, seq: Sequence) -> list[bytes]:
        if not seq.block_keys and len(seq.prompt) >= self.prefill_chunk:
            seq.block_keys = self.prefix_cache.keys_for(seq.prompt)
        return seq.block_keys

    def _pages_fit(self, seq: Sequence) -> bool:
        """Whether the pages of `seq` and its followers (less the cached prefix it will reuse) can
        be allocated now, evicting least recently used prefix-cache entries (never the one it
        hits) if needed. The followers' pages stay reserved until they start."""
        if self.pages is None:
            return True
        cached, keep = 0, None
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None and not resumes(self, seq):
            cached, keep, entry = self.prefix_cache.find(self._keys(seq), len(seq.prompt), count=False,
                                                         ids=seq.prompt, spans=seq.decode_spans)
            cached = cached if entry is not None and entry.pages else 0  # a disk hit shares no pages
        need = self._group_pages(seq, cached) + self._reserved_pages
        if self.pages.free_pages >= need:
            return True
        return self.prefix_cache is not None and self.prefix_cache.evict_for_pages(need, keep)

    def _start(self, seq: Sequence, outputs: list[RequestOutput]) -> None:
        """Give an admitted sequence its state, resumed from the longest cached prefix: its
        pages by reference (paged states) and the rest restored from the entry's snapshot, or
        from the request's own checkpoint when that covers more (checkpoint.py)."""
        if resumes(self, seq) and start_from_checkpoint(self, seq):
            self._c["states_allocated"] += 1
            self._attach_drafter(seq)
            return
        n, key, entry = 0, None, None
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:  # a hit skips the prompt's logits
            n, key, entry = self.prefix_cache.find(self._keys(seq), len(seq.prompt), ids=seq.prompt,
                                                   spans=seq.decode_spans)
        kw = self._state_kw()
        prefix = {"prefix_pages": list(entry.pages)} if entry is not None and entry.pages else {}
        try:
            seq.state = self.model.new_state(capacity=seq.capacity, **kw, **prefix)
        except Exception as exc:
            self._fail(seq, f"could not allocate the state: {exc!r}", outputs)
            return
        self._c["states_allocated"] += 1
        if entry is not None:
            try:
                seq.state.restore(entry.blob)
                seq.cached_tokens = n
                if isinstance(entry, DiskHit):
                    entry.tier.served(n)
                    self._maybe_snapshot(seq)  # back into memory
                elif seq.checkpoint is not None:
                    take_checkpoint(seq, self.prefill_chunk)  # a hit on the prompt's last block
            except SnapshotError as exc:  # refused blobs leave the state untouched: run cold
                if isinstance(entry, DiskHit) and not isinstance(exc, CacheFileError):
                    entry.tier.refuse(key, type(exc).__name__)
                self.prefix_cache.hits -= 1
                self.prefix_cache.hit_tokens -= n
                if prefix:  # its prefix pages must not be written: start over with pages of its own
                    seq.state.free()
                    try:
                        seq.state = self.model.new_state(capacity=seq.capacity, **kw)
                    except Exception as exc:
                        seq.state = None
                        self._c["states_freed"] += 1
                        self._fail(seq, f"could not allocate the state: {exc!r}", outputs)
                        return
        self._attach_drafter(seq)

    def _attach_drafter(self, seq: Sequence) -> None:
        if self.spec is not None:
            try:
                self.spec.attach(seq)
            except Exception:  # drafts only change speed: decode without one
                self.spec.drop(seq)

    def _maybe_snapshot(self, seq: Sequence) -> None:
        """After a prefill chunk that ended on a block boundary, cache the state there: a
        paged state gives the cache its prefix pages by reference plus a snapshot of the rest."""
        pos = seq.state.pos
        if seq.checkpoint is not None:
            take_checkpoint(seq, self.prefill_chunk)
        if self.prefix_cache is None or pos % self.prefill_chunk or (seq.decode_spans and pos > seq.decode_spans[0][0]):
            return  # (past a decode span the state is not a cold run's: only its last one is kept)
        key = self._keys(seq)[pos // self.prefill_chunk - 1]
        if key in self.prefix_cache:
            self.prefix_cache.touch(key)
        elif self.pages is not None:
            pages = seq.state.share_prefix(pos)
            self.prefix_cache.insert(key, seq.state.snapshot(pools=False), pages, seq.prompt, pos)
        else:
            self.prefix_cache.insert(key, seq.state.snapshot(), (), seq.prompt, pos)

    def _release(self, seq: Sequence) -> None:
        if seq.state is not None:
            self._c["states_freed"] += 1
        seq.release()  # its pages go back to the pool now (those the prefix cache holds stay)
        if self.prefix_cache is not None and self.pages is not None:
            self.prefix_cache.shrink()  # pages only the cache holds now count against its budget

    def _finish(self, seq: Sequence) -> None:
        record_conversation(self, seq)
        self._seqs.pop(seq.request_id, None)
        self._drop(seq)
        self._c[f"finished_{seq.finish_reason}"] += 1

    def _fail(self, seq: Sequence, message: str, outputs: list[RequestOutput]) -> None:
        """End a request with an error output (none for a ghost), and the followers waiting on it."""
        for f in seq.followers:
            self._fail(f, message, outputs)
        seq.followers = []
        seq.finish_reason, seq.error = "error", message
        if not seq.ghost:
            outputs.append(seq.take_output())
        self._finish(seq)

    @property
    def _reserved_pages(self) -> int:
        """Pages the admitted leaders' followers will take when they start."""
        if self.pages is None:
            return 0
        pt = self.pages.page_tokens
        return sum(self.pages.pages_for(f.capacity) - len(s.prompt) // pt
                   for s in self.scheduler.running for f in s.followers)

    # ---- convenience -------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run several prompts to completion together (batched), in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, Completion] = {r: Completion(r, [], "", None, 0) for r in rids}
        while any(c.finish_reason is None for c in done.values()) and self.has_unfinished():
            for out in self.step():
                c = done.get(out.request_id)
                if c is not None:
                    c.token_ids += out.new_token_ids
                    c.text += out.new_text
                    c.finish_reason, c.cached_tokens = out.finish_reason, out.cached_tokens
        return [done[r] for r in rids]

    # ---- metrics -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges of everything the engine holds (engine/stats.py)."""
        return engine_metrics(self)


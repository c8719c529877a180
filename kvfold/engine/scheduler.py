"""Scheduling policy: which waiting requests start, and what each running sequence feeds this step.

Admission is first-come first-served: the head of the queue starts when one more sequence fits
under `max_running`, its state fits under `max_state_bytes` and its pages fit the shared page
pool (the engine's `fits`, which may evict the prefix cache); otherwise it (and everything
behind it) waits. Running sequences are never preempted, so nothing another request does can
touch their state. Each step feeds every decoding sequence its last token (and its drafts, under
speculative decoding), then prefill chunks in admission order while they fit the token budget.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from ..errors import QueueFullError
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, *, max_running: int, max_queue: int, max_state_bytes: int, max_batch_tokens: int,
                 prefill_chunk: int):
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_state_bytes = max_state_bytes
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.reserved_bytes = 0  # state bytes of the running sequences

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the engine's queue is full ({self.max_queue} waiting requests); retry later")
        self.waiting.append(seq)

    @property
    def slots(self) -> int:
        """Running sequences, counting the followers their leaders hold places for."""
        return sum(s.width for s in self.running)

    def admit(self, state_bytes: Callable[[Sequence], int],
              fits: Callable[[Sequence], bool] | None = None) -> Iterator[Sequence]:
        """Move waiting sequences to running while they fit, yielding each one as it is moved:
        the caller allocates its state before the next one is considered (so `fits` sees it).
        A leader is admitted with its followers' places and state bytes reserved."""
        while self.waiting and self.slots + self.waiting[0].width <= self.max_running:
            need = state_bytes(self.waiting[0])
            if self.reserved_bytes + need > self.max_state_bytes:
                break  # wait for running sequences to finish and free theirs
            if fits is not None and not fits(self.waiting[0]):
                break  # its pages are not free yet: wait the same way
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.state_bytes = need
            self.reserved_bytes += need
            self.running.append(seq)
            yield seq

    def plan(self, decode_input: Callable[[Sequence], list[int]] | None = None) -> list[tuple[Sequence, list[int]]]:
        """(sequence, ids) pairs for one batched forward. `decode_input`: a decoding sequence's ids
        (default its last token; under speculative decoding, that token and its drafts)."""
        batch = [(s, decode_input(s) if decode_input is not None else s.next_input(self.prefill_chunk))
                 for s in self.running if not s.prefilling]
        budget = self.max_batch_tokens - sum(len(ids) for _, ids in batch)
        prefilled = 0
        for s in self.running:
            if not s.prefilling:
                continue
            ids = s.next_input(self.prefill_chunk)
            # A chunk is never shortened to fit (its boundaries must not depend on load), so one
            # that does not fit waits, except the step's first: prefills always make progress.
            if len(ids) > budget and prefilled:
                break
            batch.append((s, ids))
            budget -= len(ids)
            prefilled += 1
        return batch

    def start_follower(self, leader: Sequence, follower: Sequence, nbytes: int) -> None:
        """A follower starts: its place and `nbytes` of its leader's reservation become its own."""
        leader.state_bytes -= nbytes
        follower.state_bytes = nbytes
        follower.status = Status.RUNNING
        self.running.append(follower)

    def shrink_reservation(self, leader: Sequence, nbytes: int) -> None:
        """A follower that never started is gone: its leader holds `nbytes` less for it."""
        if leader.status is Status.RUNNING:
            leader.state_bytes -= nbytes
            self.reserved_bytes -= nbytes

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or cancelled sequence (its state is freed by the caller)."""
        if seq.status is Status.WAITING:
            if seq in self.waiting:  # (a follower that never started was never queued)
                self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.reserved_bytes -= seq.state_bytes

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

"""The engine under tensor parallelism: rank 0 runs the scheduler, every other rank follows.

Every rank holds an `Engine` over its shard of the model. An engine is deterministic given the
sequence of its calls (requests added, cancelled, steps), the logits of a step are the same bits
on every rank (kvfold/parallel), and each request's seed is drawn on rank 0, so rank 0 only has
to send what changed since the last step: at the start of each step it broadcasts the requests
added (prompt, parameters, ids) and cancelled, every follower applies them and runs the same step
(the same admissions, plan and forward, so the collectives inside match), and after it rank 0
broadcasts the tokens it chose, which each follower checks against its own: rank 0's choices are
the ones that count, and a follower that disagrees ends the group with a TensorParallelError
rather than drift. Speculative drafts and their accept decisions are inside the step, so they
agree the same way.

An idle rank 0 steps anyway every `HEARTBEAT_S` (an empty step is one broadcast), so a follower
waiting for work never runs into the process group's timeout; a follower that dies or hangs
ends rank 0's next step with a TensorParallelError within that timeout.
"""
from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from ..errors import InvalidRequestError
from .sequence import SamplingParams

HEARTBEAT_S = 10.0


class EngineReplicas:
    def __init__(self, engine: Any, tp: Any):
        self.engine, self.tp = engine, tp
        self.ops: list[tuple] = []  # rank 0: what changed since the last step
        self.stopped = False

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def prepare(self, params: list) -> list:
        """Rank 0, before a request is added: each choice's seed drawn here (a follower's own draw
        would differ), and the refusals only this mode has."""
        out = []
        for p in params:
            if p is not None and p.grammar is not None:
                raise InvalidRequestError("structured output is not available under tensor parallelism yet",
                                          param="grammar")
            p = p if p is not None else SamplingParams()
            out.append(p if p.seed is not None else replace(p, seed=secrets.randbits(63)))
        return out

    def record(self, *op) -> None:
        if self.leader:
            self.ops.append(op)

    def sync_ops(self) -> bool:
        """At the start of a step: rank 0 sends its ops, the others apply them. False after a stop."""
        ops, self.ops = self.tp.broadcast_objects(self.ops if self.leader else None), []
        if not self.leader:
            for op in ops:
                if op[0] == "add":
                    self.engine.add_choices(op[1], op[2], op[3])
                elif op[0] == "cancel":
                    self.engine.cancel(op[1])
                elif op[0] == "clear":
                    self.engine.clear_prefix_cache()
        self.stopped = any(op[0] == "stop" for op in ops)
        return not self.stopped

    def agree(self, outputs: list) -> None:
        """After a step: every rank's tokens are rank 0's (module docstring)."""
        mine = [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in outputs]
        theirs = self.tp.broadcast_objects(mine if self.leader else None)
        if theirs != mine:
            from ..parallel.group import TensorParallelError
            raise TensorParallelError(f"rank {self.tp.rank} chose {mine[:4]} where rank 0 chose {theirs[:4]}")

    def follow(self) -> None:
        """A follower's whole life: step as rank 0 says until it stops the group."""
        while not self.stopped:
            self.engine.step()

    def stop(self) -> None:
        """Rank 0: end the followers' loops (at shutdown)."""
        if self.leader and not self.stopped:
            self.ops.append(("stop",))
            self.engine.step()

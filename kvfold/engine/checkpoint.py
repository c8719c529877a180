"""Exact starting points a request brings with it (`Checkpoint`): how a stored conversation
(POST /v1/responses with `previous_response_id`, `kvfold.server.openai_responses`) resumes
without prefilling its history again, bit-identically to a cold run.

Why a block boundary, and why not the finished conversation's own state: the same tokens split
differently give logits equal only to fp32 rounding (docs/guarantees.md, guarantee 1), even in
batch-invariant mode. A cold run prefills a prompt in chunks ending at multiples of the prefill
chunk, so the only states a cold run of the next turn passes through are the ones at those
boundaries, computed by prefill. A finished response's own state is not one of them: its output
was decoded one token at a time (a different split), and it ends off a boundary. So the state a
response keeps is the one its own prefill passed last: the state after its prompt's last whole
block, a full snapshot (every row, no shared pages) taken as that chunk ends. The next turn's
prompt starts with that prompt (when the chat format renders the earlier turns as it did; the
ids are checked), so it restores the snapshot and prefills the rest (the previous prompt's tail
of less than a block, the previous output, the new input) in the chunks a cold run would use:
the same bits as a cold run, as a prefix-cache hit is (the prefix cache does the same, but for
every block, under its own LRU budget; a checkpoint is pinned by its holder).

The engine uses a request's checkpoint when its ids are a prefix of the prompt, it ends on a
block boundary before the prompt's end, and it covers more than the prefix cache would give;
a blob that fails its checks (`SnapshotError`) is marked `refused` and the request starts as it
would without it. `capture` asks for the new snapshot (`taken`), written on the engine's thread
during the prefill, before the request's first output.
"""
from __future__ import annotations

from array import array
from typing import Any, Sequence as Seq

from ..errors import SnapshotError


class Checkpoint:
    """An exact starting point for one request (`ids` and the full snapshot `blob` of the state
    after them; none: start as usual) and whether to `capture` the one its prefill leaves."""

    def __init__(self, ids: Seq[int] = (), blob: bytes | None = None, capture: bool = False):
        self.ids = array("q", ids)  # 8 bytes a token: kept as long as the snapshot is
        self.blob = blob
        self.capture = capture
        self.refused: str | None = None  # why `blob` was refused (it then changed nothing)
        self.used = False  # the request started from `blob`
        self.taken: tuple[array, bytes] | None = None  # (ids, full snapshot) at the prompt's last block

    @property
    def n_tokens(self) -> int:
        return len(self.ids) if self.blob is not None else 0


def resumes(engine: Any, seq: Any) -> bool:
    """Whether `seq` starts from its checkpoint: one that fits its prompt (see the module
    docstring) and covers more of it than the prefix cache would."""
    ck = seq.checkpoint
    if ck is None or ck.blob is None or ck.refused is not None or seq.params.prompt_logprobs is not None:
        return False
    n = ck.n_tokens
    if not 0 < n < len(seq.prompt) or n % engine.prefill_chunk or seq.prompt[:n] != ck.ids.tolist():
        return False
    if engine.prefix_cache is None:
        return True
    hit, _, _ = engine.prefix_cache.find(engine._keys(seq), len(seq.prompt), count=False)
    return n > hit


def start_from_checkpoint(engine: Any, seq: Any) -> bool:
    """Give an admitted sequence a state restored from its checkpoint; False (and the checkpoint
    marked refused when its blob failed its checks) leaves the sequence to start as usual."""
    ck = seq.checkpoint
    try:
        state = engine.model.new_state(capacity=seq.capacity, **engine._state_kw())
    except Exception:
        return False  # the usual start reports it
    try:
        state.restore(ck.blob)
        if state.pos != ck.n_tokens:  # a sound blob of another prefix: never serve it
            raise SnapshotError(f"the snapshot holds {state.pos} tokens, not its {ck.n_tokens} ids")
    except SnapshotError as exc:
        state.free()
        ck.refused = f"{type(exc).__name__}: {exc}"
        return False
    seq.state, seq.cached_tokens, ck.used = state, ck.n_tokens, True
    if ck.capture and ck.n_tokens == len(seq.prompt) // engine.prefill_chunk * engine.prefill_chunk:
        ck.taken = (ck.ids, ck.blob)  # it is the prompt's last block already: no chunk will end there
    return True


def take_checkpoint(seq: Any, block: int) -> None:
    """After a prefill chunk or a prefix-cache restore: when the state is at the prompt's last
    block boundary, keep it there (a full snapshot) for the request's holder."""
    ck, pos = seq.checkpoint, seq.state.pos
    if ck.capture and pos and pos % block == 0 and pos == len(seq.prompt) // block * block:
        ck.taken = (array("q", seq.prompt[:pos]), seq.state.snapshot())

"""What every per-sequence state shares: identity, ownership checks and the freed flag.

Model-specific states (DeepSeek-V4, GLM-5.3) add their buffers, cursors and snapshot codec.
"""
from __future__ import annotations

import itertools

import torch

from ..errors import FreedStateError, StateMismatchError

_kv_ids = itertools.count(1)  # one counter for every kind of state: an id is never reused in a process


def next_kv_id() -> int:
    return next(_kv_ids)


class SequenceState:
    def __init__(self, layers: list, *, capacity: int, max_rewind: int, fingerprint: str,
                 device: torch.device, dtype: torch.dtype):
        self.layers: list | None = layers
        self.capacity = capacity
        self.max_rewind = max_rewind
        self.fingerprint = fingerprint
        self.device = device
        self.dtype = dtype
        self.pos = 0
        self.kv_id = next_kv_id()
        # rows of positions [pos, written_until) were computed and are still intact: a rewound
        # verify pass can re-advance over them (sync_to) without recomputing
        self.written_until = 0
        # positions below this cannot be rewound to (their rows were never held: set by restore)
        self.rewind_floor = 0

    @property
    def freed(self) -> bool:
        return self.layers is None

    def free(self) -> None:
        """Release every buffer. A second call does nothing; any later use raises FreedStateError."""
        self.layers = None

    def _check_alive(self) -> None:
        if self.layers is None:
            raise FreedStateError(f"state kv_id={self.kv_id} was freed; create a new one with model.new_state()")

    def check_usable(self, fingerprint: str, device: torch.device, dtype: torch.dtype) -> None:
        self._check_alive()
        if fingerprint != self.fingerprint:
            raise StateMismatchError(
                f"state kv_id={self.kv_id} was made by a model with config fingerprint {self.fingerprint}, "
                f"not this one ({fingerprint}); create the state with this model's new_state()")
        if torch.device(device) != torch.device(self.device) or dtype != self.dtype:
            raise StateMismatchError(
                f"state kv_id={self.kv_id} lives on {self.device}/{self.dtype} but the model runs on "
                f"{device}/{dtype}; create the state with this model's new_state()")

    def snapshot(self) -> bytes:
        """The rows still in use at `pos`, in kvfold's versioned format (docs/state-format.md)."""
        self._check_alive()
        return self._encode()

    def restore(self, blob: bytes) -> None:
        """Continue exactly where the snapshotted state was. Every check runs before any write;
        a refused blob raises a `SnapshotError` subclass and leaves this state unchanged."""
        self._check_alive()
        self._decode_and_apply(blob)

    def _encode(self) -> bytes:  # the model-specific snapshot codec
        raise NotImplementedError

    def _decode_and_apply(self, blob: bytes) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of buffers held (0 once freed)."""
        return 0 if self.layers is None else sum(layer.nbytes for layer in self.layers)

    def __repr__(self) -> str:
        status = "freed" if self.freed else f"pos={self.pos}/{self.capacity}"
        return f"{type(self).__name__}(kv_id={self.kv_id}, {status}, max_rewind={self.max_rewind})"

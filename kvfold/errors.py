"""Typed errors. Every message says what went wrong and what to do about it."""


class KvfoldError(Exception):
    """Base class of every error kvfold raises on purpose."""


class ConfigError(KvfoldError):
    """A config.json is missing a field, or a field has a value kvfold cannot run."""


class CheckpointError(KvfoldError):
    """A checkpoint directory is missing tensors, has unexpected ones, or has mis-shaped ones."""


class StateError(KvfoldError):
    """Base class of errors about a per-sequence state."""


class CapacityError(StateError):
    """The operation would need more positions than the state reserved at `new_state`."""


class StateMismatchError(StateError):
    """The state belongs to another model, device or dtype."""


class FreedStateError(StateError):
    """The state was freed; create a new one with `model.new_state(...)`."""


class RewindError(StateError):
    """A rewind that would grow the sequence, or undo more than `max_rewind` tokens."""

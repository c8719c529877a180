"""Typed errors. Every message says what went wrong and what to do about it."""


class KvfoldError(Exception):
    """Base class of every error kvfold raises on purpose."""


class InvalidInputError(KvfoldError, ValueError):
    """Token ids that are not a non-empty 1-D sequence of ids inside the vocabulary, or text that
    cannot be encoded (a lone surrogate)."""


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


class SnapshotError(StateError):
    """A snapshot blob was refused; the target state is unchanged."""


class SnapshotTruncatedError(SnapshotError):
    """The blob ends before its fixed header or section table does (or, a DSA indexer blob,
    before its 16-byte header)."""


class SnapshotMagicError(SnapshotError):
    """The blob does not start with kvfold's snapshot magic: not a kvfold state snapshot."""


class SnapshotVersionError(SnapshotError):
    """The blob's format version is not one this kvfold reads."""


class SnapshotModelError(SnapshotError, StateMismatchError):
    """The blob was taken from a model with another config: another fingerprint, or (a GLM-5.3
    DSA indexer blob) another index_head_dim."""


class SnapshotDtypeError(SnapshotError, StateMismatchError):
    """The blob's dtype differs from the target state's."""


class SnapshotCountsError(SnapshotError):
    """The section table's row counts do not follow from the blob's `pos`."""


class SnapshotSizeError(SnapshotError):
    """The body is shorter or longer than the section table (or a DSA indexer blob's header) says."""


class SnapshotChecksumError(SnapshotError):
    """The checksum over header and body does not match: the blob is corrupted."""


class CacheFileError(SnapshotError):
    """A prefix-cache file on disk was refused (truncated, another format, its token ids not
    those its name promises); it is deleted and the request runs without it."""


class SnapshotCapacityError(SnapshotError, CapacityError):
    """The blob's `pos` (a DSA indexer blob's len) does not fit in the target state's capacity;
    refused, never clamped."""


class MtpUnavailableError(KvfoldError):
    """Speculative decoding with the MTP drafter was asked of a checkpoint without `mtp.*` weights."""


class SessionError(StateError):
    """A saved session file was refused; nothing was allocated or changed."""


class SessionCorruptedError(SessionError):
    """The file is not a kvfold session, is truncated, or fails its checksum or metadata checks."""


class SessionVersionError(SessionError):
    """The session file's format version is not one this kvfold reads."""


class SessionModelError(SessionError, StateMismatchError):
    """The session was saved from a model with another config fingerprint (or dtype)."""


class EngineError(KvfoldError):
    """Base class of errors the serving engine (`kvfold.Engine`) raises about a request."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before any work: bad sampling parameters or prompt ids.
    `param`, when known, names the parameter to blame (the server's 400 reports it)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """Prompt plus max_tokens exceed the engine's per-sequence capacity (max_seq_len), or the
    request's state alone would pass max_state_bytes; shorten the prompt or lower max_tokens."""


class QueueFullError(EngineError):
    """The waiting queue holds max_queue requests already; retry later."""


class PagePoolError(StateError):
    """A shared KV page pool refused an operation; nothing was allocated, freed or written."""


class PagesExhaustedError(PagePoolError, CapacityError):
    """Fewer free pages than asked for; nothing was allocated. Free states, evict the prefix
    cache, or create the pool with more pages."""


class SharedPageWriteError(PagePoolError):
    """A write would change a page another holder (sequence or prefix cache) also references;
    shared pages are immutable."""


class SnapshotPagesError(SnapshotError):
    """A snapshot that omits its pool rows (prefix-cache snapshot) does not match the pages the
    target state holds by reference, or a restore would rewrite a shared page."""


class NativeAbiError(KvfoldError):
    """The compiled native kernels (numerics/native.c) and their ctypes mirrors
    (numerics/native_abi.py) disagree: a struct's size, a field's offset or size, a field or a
    function one side lacks. The library is refused, since a kernel would read the wrong bytes;
    change the C struct and its mirror together. `struct` and `field` name the first difference
    (field None: the struct as a whole, or `struct` a function's name)."""

    def __init__(self, message: str = "", struct: str = "", field: str | None = None):
        super().__init__(message)
        self.struct, self.field = struct, field


class PlacementError(ConfigError):
    """A placement across one accelerator and host memory (`--gpu-layers`, `--gpu-experts`, a
    device map) that cannot run: more layers or experts than the model has, a map naming modules
    the model lacks, a part of a layer other than its routed experts, experts on the card for a
    host layer, two accelerators or a non-prefix layer set, budgets that cannot hold the weights
    or the state, or a device that is not there. The message says what fits."""

"""Sessions on disk: a state snapshot plus the token ids it stands for, to continue a conversation later.

File layout (little-endian):
  magic      8 B   b"KVFSESS1"
  version    u32   1
  meta_len   u32   length of the JSON metadata
  checksum   32 B  SHA-256 over metadata + state blob
  metadata   meta_len bytes of UTF-8 JSON: {"kvfold_version", "fingerprint", "dtype", "tokens",
             "pending", "state_bytes"}
  state      the `state.snapshot()` blob (to the end of the file)

`tokens` are the ids the state has consumed (`state.pos == len(tokens)`); `pending` is the id
generate chose last and never fed (or null): continuing feeds it first. Nothing is ever
unpickled. Reading checks, in order, before anything is allocated: size and magic, version,
lengths, checksum, metadata schema, then that the model (config fingerprint and dtype) is the one
that saved it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .errors import SessionCorruptedError, SessionModelError, SessionVersionError

MAGIC = b"KVFSESS1"
VERSION = 1
_HEADER = struct.Struct("<8sII32s")  # 48 bytes


@dataclass
class Session:
    fingerprint: str
    dtype: str
    tokens: list[int]  # ids the state has consumed
    pending: int | None  # chosen last, not yet fed
    state_blob: bytes
    kvfold_version: str

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def continuation(self, new_ids: Sequence[int]) -> list[int]:
        """The ids to feed next: the pending token (if any), then `new_ids`."""
        return ([] if self.pending is None else [self.pending]) + [int(i) for i in new_ids]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _version() -> str:
    from . import __version__
    return __version__


def encode_session(state: Any, tokens: Sequence[int], pending: int | None) -> bytes:
    """The bytes of a session file for `state`, which has consumed exactly `tokens`."""
    tokens = [int(t) for t in tokens]
    if len(tokens) != state.pos:
        raise ValueError(f"session tokens ({len(tokens)}) must be the ids the state consumed (pos {state.pos})")
    blob = state.snapshot()
    meta = json.dumps({
        "kvfold_version": _version(),
        "fingerprint": state.fingerprint,
        "dtype": _dtype_name(state.dtype),
        "tokens": tokens,
        "pending": None if pending is None else int(pending),
        "state_bytes": len(blob),
    }, separators=(",", ":")).encode()
    digest = hashlib.sha256(meta + blob).digest()
    return _HEADER.pack(MAGIC, VERSION, len(meta), digest) + meta + blob


def save_session(path: str | os.PathLike, state: Any, tokens: Sequence[int], pending: int | None) -> None:
    """Write a session file atomically: a temp file in the same directory, fsync, os.replace.
    `path` always holds the old file or the complete new one; an exception removes the temp
    file (only a hard kill in between can leave a `.NAME.*.tmp`). The file is created with
    mode 0600: it holds the conversation."""
    data = encode_session(state, tokens, pending)
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable; not every platform lets a directory be opened
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def decode_session(data: bytes, source: str = "session") -> Session:
    """Parse and check a session's bytes (everything but the model match)."""
    data = bytes(data)
    if data[:len(MAGIC)] != MAGIC[:len(data)]:
        raise SessionCorruptedError(f"{source} is not a kvfold session file (it does not start with {MAGIC!r})")
    if len(data) < _HEADER.size:
        raise SessionCorruptedError(f"{source} is truncated: {len(data)} bytes, shorter than the "
                                    f"{_HEADER.size}-byte header")
    _magic, version, meta_len, digest = _HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise SessionVersionError(f"{source} has session format version {version}; this kvfold reads version "
                                  f"{VERSION}")
    body = data[_HEADER.size:]
    if meta_len > len(body):
        raise SessionCorruptedError(f"{source} is truncated: its metadata needs {meta_len} bytes, "
                                    f"{len(body)} follow the header")
    if hashlib.sha256(body).digest() != digest:
        raise SessionCorruptedError(f"{source} is corrupted (checksum mismatch); it cannot be resumed")
    try:
        meta = json.loads(body[:meta_len].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SessionCorruptedError(f"{source} has unreadable metadata ({e})") from None
    blob = body[meta_len:]

    def bad(what: str) -> SessionCorruptedError:
        return SessionCorruptedError(f"{source} has invalid metadata: {what}")

    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    fp, dtype, tokens, pending = meta.get("fingerprint"), meta.get("dtype"), meta.get("tokens"), meta.get("pending", None)
    if not isinstance(fp, str) or not isinstance(dtype, str):
        raise bad("fingerprint and dtype must be strings")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise bad("tokens must be a list of non-negative ints")
    if pending is not None and not (type(pending) is int and pending >= 0):
        raise bad("pending must be null or a non-negative int")
    if meta.get("state_bytes") != len(blob):
        raise bad(f"state_bytes={meta.get('state_bytes')!r} but {len(blob)} state bytes follow")
    version_str = meta.get("kvfold_version")
    return Session(fingerprint=fp, dtype=dtype, tokens=tokens, pending=pending, state_blob=blob,
                   kvfold_version=version_str if isinstance(version_str, str) else "?")


def read_session(path: str | os.PathLike) -> Session:
    """Read and check a session file on its own (no model needed yet)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SessionCorruptedError(f"cannot read session {path}: {e.strerror or e}") from None
    return decode_session(data, source=f"session {path}")


def check_session_model(session: Session, model: Any, source: str = "session") -> None:
    """Refuse (SessionModelError) a session saved from another model or dtype, or whose ids do
    not fit this model's vocabulary (SessionCorruptedError)."""
    if session.fingerprint != model.fingerprint:
        raise SessionModelError(
            f"{source} was saved from a model with config fingerprint {session.fingerprint}, but this "
            f"model's is {model.fingerprint}; resume it with the model that saved it")
    if session.dtype != _dtype_name(model.dtype):
        raise SessionModelError(f"{source} holds a {session.dtype} state but the model runs in "
                                f"{_dtype_name(model.dtype)}; load the model with dtype {session.dtype}")
    vocab = model.config.vocab_size
    ids = session.tokens + ([] if session.pending is None else [session.pending])
    if any(t >= vocab for t in ids):
        raise SessionCorruptedError(f"{source} has token ids outside this model's vocabulary ({vocab})")


def restore_session(model: Any, session: Session, *, capacity: int, max_rewind: int = 0) -> Any:
    """A new state of `model` holding the session's state (capacity >= session.pos)."""
    state = model.new_state(capacity=max(capacity, session.pos, 1), max_rewind=max_rewind)
    try:
        state.restore(session.state_blob)
        if state.pos != session.pos:
            raise SessionCorruptedError(f"session state is at pos {state.pos} but lists {session.pos} tokens")
    except BaseException:
        state.free()
        raise
    return state


def load_session(path: str | os.PathLike, model: Any, *, extra_capacity: int, max_rewind: int = 0):
    """Read, check against `model`, restore: (state, session), the state sized for
    `extra_capacity` more tokens after the session's. Every refusal comes before allocation."""
    session = read_session(path)
    check_session_model(session, model, source=f"session {path}")
    return restore_session(model, session, capacity=session.pos + extra_capacity, max_rewind=max_rewind), session


def split_history(fed: Sequence[int], generated: Sequence[int]) -> tuple[list[int], int | None]:
    """(consumed ids, pending id) after `generate` fed `fed` (history + prompt) and chose
    `generated`: every generated id but the last was fed; the last one is pending."""
    fed = [int(t) for t in fed]
    if not generated:
        return fed, None
    return fed + [int(t) for t in generated[:-1]], int(generated[-1])

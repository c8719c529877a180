"""The prefix cache's disk tier: entries that outlive the process.

One file per entry, named by the entry's chained block key (prefix_cache.block_hashes, whose root
is the model's fingerprint and dtype), in a subdirectory of the cache directory named by that
root, so models never meet. A file holds

  magic "KVFPCACH", format version (u32), block size (u32), token count n (u64),
  the n prompt token ids (int64), then a full state snapshot (every row: `snapshot()`).

A file is trusted for nothing: the ids must hash to the key the file is named by, and the blob
goes through the snapshot's own checks (magic, version, model fingerprint, dtype, SHA-256) when it
is restored. Whatever is refused is logged once per kind of problem, deleted, and the request runs
cold: a refused file is never served.

Writes go to a temporary file in the same directory, are flushed to disk and renamed into place,
so a reader sees a whole file or none (a full disk leaves the entry absent). Least recently used
eviction keeps the files under the byte budget: a hit refreshes the file's mtime, and the oldest
files go first. Several servers may share one directory: writes are atomic renames, and budget
enforcement runs under an exclusive `flock` on the directory's `.lock` file; an entry another
server deletes while this one reads it stays readable through the open descriptor.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import CacheFileError
from .prefix_cache import block_hashes

log = logging.getLogger("kvfold.cache")

MAGIC = b"KVFPCACH"
FORMAT_VERSION = 1
HEAD = struct.Struct("<8sIIQ")  # magic, version, block, n tokens
SUFFIX = ".kvc"


@dataclass
class DiskHit:
    """An entry found on disk: a full snapshot, read (and checked) when `blob` is first asked for."""
    tier: "DiskTier"
    key: bytes
    n_tokens: int
    pages: tuple = ()  # a disk entry holds no pages: the state restores every row into its own

    @property
    def blob(self) -> bytes:
        return self.tier.read(self.key, self.n_tokens)


class DiskTier:
    def __init__(self, directory: str | os.PathLike, max_bytes: int, block: int, root: bytes, namespace: bytes = b""):
        """Entries of the model named by `root` (prefix_cache.PrefixCache's root: the keys' first
        link) under `directory`, at most `max_bytes` of files, in a subdirectory named by root and
        `namespace` (what else a snapshot must match). Creates the directory."""
        if max_bytes <= 0:
            raise ValueError(f"the disk cache needs a budget > 0 bytes, got {max_bytes}")
        self.block, self.root, self.max_bytes = block, root, max_bytes
        self.dir = Path(directory) / hashlib.sha256(root + b"\0" + namespace).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.dir / ".lock"
        self._warned: set[str] = set()
        self.hits = self.hit_tokens = self.writes = self.evictions = self.refused = self.write_errors = 0
        self._sweep_temporaries()

    # ---- reading -----------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def find(self, keys: Sequence[bytes], n_prompt: int, longer_than: int = 0) -> DiskHit | None:
        """The longest entry among `keys` (a prompt's block keys) covering more than `longer_than`
        tokens and strictly fewer than the prompt's `n_prompt` (one token must still run). Only
        looks at the files' names: the blob is read when the hit is used."""
        usable = (n_prompt - 1) // self.block
        for j in range(min(usable, len(keys)) - 1, -1, -1):
            n = (j + 1) * self.block
            if n <= longer_than:
                return None
            if self._path(keys[j]).exists():
                return DiskHit(self, keys[j], n)
        return None

    def read(self, key: bytes, n_tokens: int) -> bytes:
        """The snapshot of entry `key`, after checking the file's frame and that its ids hash to
        `key`. CacheFileError (the file is deleted) if anything is wrong; the snapshot's own
        checks run when it is restored (`refuse` deletes it then)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
            _touch(path)  # a hit: most recently used
        except OSError as exc:
            raise self._refused(key, "unreadable", f"{path}: {exc}") from None
        if len(data) < HEAD.size:
            raise self._refused(key, "truncated", f"{path}: {len(data)} bytes")
        magic, version, block, n = HEAD.unpack_from(data)
        if magic != MAGIC:
            raise self._refused(key, "magic", f"{path} is not a kvfold cache file")
        if version != FORMAT_VERSION or block != self.block or n != n_tokens:
            raise self._refused(key, "version", f"{path}: format {version}, block {block}, {n} tokens "
                                                 f"(this server: {FORMAT_VERSION}, {self.block}, {n_tokens})")
        end = HEAD.size + 8 * n
        if len(data) < end:
            raise self._refused(key, "truncated", f"{path}: {len(data)} bytes, its ids need {end}")
        ids = array("q")
        ids.frombytes(data[HEAD.size:end])
        chain = block_hashes(ids, self.block, self.root)
        if not chain or chain[-1] != key:
            raise self._refused(key, "ids", f"{path}: its token ids do not hash to its name")
        return data[end:]

    def served(self, n_tokens: int) -> None:
        """A hit's snapshot passed its checks and was restored: count it."""
        self.hits += 1
        self.hit_tokens += n_tokens

    def refuse(self, key: bytes, reason: str) -> None:
        """The snapshot of `key` failed its checks at restore: delete the file (logged once per reason)."""
        self._refused(key, reason, f"{self._path(key)}: the snapshot was refused ({reason})")

    def _refused(self, key: bytes, kind: str, detail: str) -> CacheFileError:
        self.refused += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("prefix cache: dropped a disk entry (%s); further ones like it are dropped "
                        "silently: %s", kind, detail)
        self._unlink(self._path(key))
        return CacheFileError(f"disk cache entry refused ({kind}): {detail}")

    # ---- writing -----------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self._path(key).exists()

    def write(self, key: bytes, ids: Sequence[int], blob: bytes) -> bool:
        """Store one entry atomically, evicting the least recently used files to make room.
        Returns whether it is stored; a full disk (or any OS error) leaves no file and is logged once."""
        ids = array("q", ids)
        size = HEAD.size + 8 * len(ids) + len(blob)
        if size > self.max_bytes:
            return False
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with self._locked():
                self._evict_to(self.max_bytes - size, keep=path)
                with open(tmp, "wb") as f:
                    f.write(HEAD.pack(MAGIC, FORMAT_VERSION, self.block, len(ids)))
                    f.write(ids.tobytes())
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                _touch(path)
        except OSError as exc:
            self.write_errors += 1
            self._unlink(tmp)
            kind = "disk full" if exc.errno == errno.ENOSPC else "write failed"
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("prefix cache: could not write a disk entry (%s): %s", kind, exc)
            return False
        self.writes += 1
        return True

    def files(self) -> list[os.DirEntry]:
        """This model's entry files (another server's renames and deletions may race: skip them)."""
        try:
            return [e for e in os.scandir(self.dir) if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
        except OSError:
            return []

    @property
    def nbytes(self) -> int:
        return sum(_size(e) for e in self.files())

    def _evict_to(self, budget: int, keep: Path) -> None:
        """Delete the least recently used files until they take at most `budget` bytes."""
        entries = []
        for e in self.files():
            try:
                st = e.stat()
            except OSError:
                continue
            if e.path != str(keep):
                entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= budget:
                break
            if self._unlink(Path(p)):
                self.evictions += 1
            total -= size

    def _locked(self):
        return _FileLock(self._lock_path)

    def _sweep_temporaries(self) -> None:
        """Temporary files of a writer that died mid-write (this host's pids only are checked)."""
        for e in os.scandir(self.dir):
            if e.name.endswith(".tmp"):
                pid = e.name.rsplit(".", 2)[-2]
                if pid.isdigit() and not _alive(int(pid)):
                    self._unlink(Path(e.path))

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


class _FileLock:
    """An exclusive flock on a file, held for a `with` block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _touch(path: Path) -> None:
    """Set the mtime from the fine clock: the kernel stamps files from a coarse one (a few ms),
    which would tie the files of one burst of writes and hits in the LRU order."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _size(e: os.DirEntry) -> int:
    try:
        return e.stat().st_size
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def engine_prefix_cache(model, pages, block: int, max_bytes: int, max_rewind: int,
                        cache_dir: str | os.PathLike | None = None, disk_bytes: int = 0):
    """An engine's prefix cache (None with no memory budget), with a disk tier under `cache_dir`
    (at most `disk_bytes` of files) when one is given. The disk entries' root adds what makes a
    full snapshot fit a state besides the model: the block size and the states' max_rewind."""
    from .prefix_cache import PrefixCache
    if cache_dir is not None and not max_bytes:
        raise ValueError("a disk cache (cache_dir) extends the prefix cache: give prefix_cache_bytes > 0")
    if not max_bytes:
        return None
    root = f"{model.fingerprint}/{model.dtype}".encode()
    disk = None
    if cache_dir is not None:
        disk = DiskTier(cache_dir, disk_bytes, block, root, f"block{block}/rewind{max_rewind}".encode())

    def materialize(entry) -> bytes:
        """A paged entry's full snapshot: its blob restored over its pages (by reference, so no
        page is taken), then snapshotted with every row."""
        st = model.new_state(capacity=entry.n_tokens, max_rewind=max_rewind, pages=pages,
                             prefix_pages=list(entry.pages))
        try:
            st.restore(entry.blob)
            return st.snapshot()
        finally:
            st.free()

    return PrefixCache(block, max_bytes, root, pages, disk=disk, materialize=materialize)


DISK_STATS = ("prefix_cache_disk_hits", "prefix_cache_disk_hit_tokens", "prefix_cache_disk_writes",
              "prefix_cache_disk_evictions", "prefix_cache_disk_refused", "prefix_cache_disk_write_errors",
              "prefix_cache_disk_entries", "prefix_cache_disk_bytes")


def disk_stats(disk: DiskTier | None) -> dict:
    """The disk tier's counters for `Engine.metrics` (zeros without one)."""
    if disk is None:
        return dict.fromkeys(DISK_STATS, 0)
    files = disk.files()
    return dict(zip(DISK_STATS, (disk.hits, disk.hit_tokens, disk.writes, disk.evictions, disk.refused,
                                 disk.write_errors, len(files), sum(_size(e) for e in files))))

"""Prefix cache: state snapshots at block boundaries, keyed by a chained hash of the prompt blocks.

Block j's key is sha256(key of block j-1 || ids of block j), so one key names the whole prefix
up to the end of block j. Values are `state.snapshot()` blobs: bytes holding only the rows in
use at that position, independent of any live state, so evicting an entry can never touch a
running sequence and a restore can never alias another sequence's rows (design rules 4 and 10).
Eviction is least-recently-used under a byte budget.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence


def block_hashes(ids: Sequence[int], block: int, root: bytes = b"") -> list[bytes]:
    """Chained keys of every whole block of `ids`: entry j names ids[:(j + 1) * block]."""
    keys, prev = [], hashlib.sha256(root).digest()
    for j in range(len(ids) // block):
        data = array("q", ids[j * block:(j + 1) * block]).tobytes()
        prev = hashlib.sha256(prev + data).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, block: int, max_bytes: int, root: bytes = b""):
        self.block = block
        self.max_bytes = max_bytes
        self.root = root  # e.g. the model fingerprint: keys of different models never meet
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # oldest first
        self.nbytes = 0
        # counters for metrics
        self.lookups = 0
        self.hits = 0
        self.lookup_tokens = 0  # prompt tokens of every lookup
        self.hit_tokens = 0  # of those, restored from a snapshot
        self.inserts = 0
        self.evictions = 0

    @property
    def entries(self) -> int:  # (no __len__: an empty cache must not be falsy)
        return len(self._entries)

    def keys_for(self, ids: Sequence[int]) -> list[bytes]:
        return block_hashes(ids, self.block, self.root)

    def lookup(self, keys: Sequence[bytes], n_tokens: int) -> tuple[int, bytes | None]:
        """Longest cached prefix of a prompt of `n_tokens` tokens whose block keys are `keys`:
        whole blocks only, strictly shorter than the prompt (at least one token must still run
        to produce logits). Returns (tokens covered, snapshot) or (0, None)."""
        self.lookups += 1
        self.lookup_tokens += n_tokens
        usable = (n_tokens - 1) // self.block
        for j in range(min(usable, len(keys)) - 1, -1, -1):
            blob = self._entries.get(keys[j])
            if blob is not None:
                self._entries.move_to_end(keys[j])
                n = (j + 1) * self.block
                self.hits += 1
                self.hit_tokens += n
                return n, blob
        return 0, None

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def insert(self, key: bytes, blob: bytes) -> None:
        """Store a snapshot (an existing key is only refreshed); evict the oldest until it fits."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if len(blob) > self.max_bytes:
            return
        while self.nbytes + len(blob) > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= len(old)
            self.evictions += 1
        self._entries[key] = blob
        self.nbytes += len(blob)
        self.inserts += 1

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

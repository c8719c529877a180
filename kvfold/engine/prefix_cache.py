"""Prefix cache: state at block boundaries, keyed by a chained hash of the prompt blocks.

Block j's key is sha256(key of block j-1 || ids of block j), so one key names the whole prefix
up to the end of block j. An entry holds a `state.snapshot()` blob and, for paged states, one
reference to each page of the prefix's compressed entries (the blob then leaves those rows
out: `snapshot(pools=False)`). A hit hands the pages to the new state BY REFERENCE and
restores the per-sequence rest (window ring, compressor windows, cursors) from the blob.

Pages are append-only and a page's holders never write it once shared (the donor's rewind
floor is raised, writes into shared pages are refused), so evicting an entry only drops
references: pages still used by running sequences stay alive, and nothing a running sequence
reads can change: no restore or eviction touches another sequence's rows.

Eviction is least-recently-used under a byte budget that counts the blobs plus the pages held
by the cache alone (pages also used by a running sequence cost the cache nothing until that
sequence ends). The engine also evicts to free pages for an admission.

With a disk tier (disk_cache.py) an evicted entry is written to disk as a full snapshot (the
engine's `materialize` adds the rows its pages hold) with its token ids, and `flush` writes the
rest at a clean shutdown; a lookup that finds a longer prefix on disk than in memory returns that
(`DiskHit`: no pages, the state restores every row into its own). Only entries worth a full
snapshot go to disk: the longest one of each prompt (a leaf) and those a request has hit (a
shared system prompt, a conversation's earlier turn). Every block of a prompt holds an entry,
and full snapshots of all of them would write the prompt's rows once per block.

A conversation kvfold produced also leaves its last state (`insert_tail`, engine/transcripts.py),
at any position, keyed by every id so far and the positions that were decoded one token a call
(its path: the same ids fed another way are another state). Such an entry holds a full snapshot,
no pages, and stays in memory (the disk tier keeps block entries only).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence


def block_hashes(ids: Sequence[int], block: int, root: bytes = b"") -> list[bytes]:
    """Chained keys of every whole block of `ids`: entry j names ids[:(j + 1) * block]."""
    keys, prev = [], hashlib.sha256(root).digest()
    for j in range(len(ids) // block):
        data = array("q", ids[j * block:(j + 1) * block]).tobytes()
        prev = hashlib.sha256(prev + data).digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class CacheEntry:
    blob: bytes
    pages: tuple[int, ...] = ()  # one reference held by the cache to each
    ids: Sequence[int] = ()  # the prompt it was taken from (shared, not copied): ids[:n_tokens] is its prefix
    n_tokens: int = 0


class PrefixCache:
    def __init__(self, block: int, max_bytes: int, root: bytes = b"", pages=None, disk=None,
                 materialize: Callable[[CacheEntry], bytes] | None = None):
        """`pages`: the `PagePool` whose pages entries may hold (None: blobs only). `disk`: a
        `DiskTier` evicted entries go to, `materialize(entry)` making an entry's full snapshot."""
        self.block = block
        self.disk, self.materialize = disk, materialize
        self.max_bytes = max_bytes
        self.root = root  # e.g. the model fingerprint: keys of different models never meet
        self.pages = pages
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # oldest first
        self._page_refs: Counter[int] = Counter()  # references the cache holds, per page
        self._hit_keys: set[bytes] = set()  # entries a request has been served from
        self._tails: dict[bytes, int] = {}  # conversations' last states: key -> tokens held
        self._tail_lengths: Counter[int] = Counter()
        self.blob_bytes = 0
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

    # ---- accounting --------------------------------------------------------------------------
    def _only_cached(self, exclude: frozenset[int] = frozenset()) -> int:
        """Pages referenced by the cache alone (they go free if every entry holding them goes)."""
        if self.pages is None:
            return 0
        return sum(1 for p, k in self._page_refs.items() if p not in exclude and self.pages.refcount(p) == k)

    @property
    def pages_held(self) -> int:
        """Distinct pages the cache references."""
        return len(self._page_refs)

    @property
    def nbytes(self) -> int:
        """What the cache costs: its blobs plus the pages nobody else uses."""
        return self.blob_bytes + (self._only_cached() * self.pages.page_bytes if self.pages is not None else 0)

    def stats(self) -> dict[str, float]:
        """The counters `Engine.metrics` reports (prefix_cache_*)."""
        return dict(
            prefix_cache_lookups=self.lookups,
            prefix_cache_hits=self.hits,
            prefix_cache_lookup_tokens=self.lookup_tokens,
            prefix_cache_hit_tokens=self.hit_tokens,
            prefix_cache_hit_rate=self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            prefix_cache_request_hit_rate=self.hits / self.lookups if self.lookups else 0.0,
            prefix_cache_entries=self.entries,
            prefix_cache_bytes=self.nbytes,
            prefix_cache_evictions=self.evictions,
            prefix_cache_pages=self.pages_held,
            prefix_cache_blob_bytes=self.blob_bytes,
        )

    # ---- lookup ------------------------------------------------------------------------------
    def keys_for(self, ids: Sequence[int]) -> list[bytes]:
        return block_hashes(ids, self.block, self.root)

    def find(self, keys: Sequence[bytes], n_tokens: int, count: bool = True, ids: Sequence[int] | None = None,
             spans: Sequence[tuple[int, int]] = ()) -> tuple[int, bytes | None, CacheEntry | None]:
        """Longest cached prefix of a prompt of `n_tokens` tokens whose block keys are `keys`:
        whole blocks only, strictly shorter than the prompt (at least one token must still run
        to produce logits). Returns (tokens covered, key, entry) or (0, None, None). `count`:
        record the lookup in the hit counters and refresh the entry's LRU position. `ids`, `spans`:
        the prompt and the positions it feeds one token a call (a conversation it continues): block
        entries then serve only up to the first span, and a conversation's last state beyond."""
        if count:
            self.lookups += 1
            self.lookup_tokens += n_tokens
        blocks_end = min(n_tokens, spans[0][0] + 1) if spans else n_tokens  # (block states are a cold run's)
        n, key, entry = self._find_in_memory(keys, blocks_end)
        if self.disk is not None:
            hit = self.disk.find(keys, blocks_end, longer_than=n)
            if hit is not None:
                n, key, entry = hit.n_tokens, hit.key, hit
        if ids is not None and self._tail_lengths:
            tail = self.find_tail(ids, spans, longer_than=n)
            if tail[2] is not None:
                n, key, entry = tail
        if entry is not None and count:
            if key in self._entries:
                self._entries.move_to_end(key)
                self._hit_keys.add(key)
            self.hits += 1
            self.hit_tokens += n
        return n, key, entry

    # ---- conversations' last states (engine/transcripts.py) -----------------------------------
    def tail_key(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> bytes:
        """The key of the state after `ids`, fed one token a call over `spans`."""
        path = array("q", [x for span in spans for x in span]).tobytes()
        return hashlib.sha256(self.root + b"tail" + len(path).to_bytes(8, "little") + path
                              + array("q", ids).tobytes()).digest()

    def insert_tail(self, ids: Sequence[int], spans: Sequence[tuple[int, int]], blob: bytes) -> bool:
        """Keep a finished conversation's last state: the full snapshot `blob` after `ids`."""
        key = self.tail_key(ids, spans)
        stored = self.insert(key, blob, (), tuple(ids), len(ids))
        if stored:
            self._tails[key] = len(ids)
            self._tail_lengths[len(ids)] += 1
        return stored

    def find_tail(self, ids: Sequence[int], spans: Sequence[tuple[int, int]], longer_than: int
                  ) -> tuple[int, bytes | None, CacheEntry | None]:
        """The longest conversation's last state that `ids` (fed so over `spans`) continues,
        covering more than `longer_than` tokens and fewer than all of them; counted as a hit."""
        for n in sorted((n for n in self._tail_lengths if longer_than < n < len(ids)), reverse=True):
            key = self.tail_key(ids[:n], tuple((a, min(b, n)) for a, b in spans if a < n))
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hit_keys.add(key)
                return n, key, entry
        return 0, None, None

    def _find_in_memory(self, keys: Sequence[bytes], n_tokens: int) -> tuple[int, bytes | None, CacheEntry | None]:
        usable = (n_tokens - 1) // self.block
        for j in range(min(usable, len(keys)) - 1, -1, -1):
            entry = self._entries.get(keys[j])
            if entry is not None:
                return (j + 1) * self.block, keys[j], entry
        return 0, None, None

    def lookup(self, keys: Sequence[bytes], n_tokens: int) -> tuple[int, bytes | None]:
        """`find`, returning (tokens covered, snapshot blob) or (0, None)."""
        n, _, entry = self.find(keys, n_tokens)
        return n, (entry.blob if entry is not None else None)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    # ---- insert / evict ----------------------------------------------------------------------
    def insert(self, key: bytes, blob: bytes, pages: Sequence[int] = (), ids: Sequence[int] = (),
               n_tokens: int = 0) -> bool:
        """Store a snapshot and take over one reference to each of `pages` (dropped at once if
        the entry is not stored). An existing key is only refreshed. Then evict the least
        recently used entries until the budget holds. Returns whether the entry is stored.
        `ids[:n_tokens]`: the prefix the entry holds (what a disk tier writes with it)."""
        if key in self._entries or len(blob) > self.max_bytes:
            if key in self._entries:
                self._entries.move_to_end(key)
            if pages:
                self.pages.decref(pages)
            return False
        entry = CacheEntry(bytes(blob), tuple(pages), ids, n_tokens)
        self._entries[key] = entry
        self._page_refs.update(entry.pages)
        self.blob_bytes += len(entry.blob)
        self.inserts += 1
        self.shrink(keep=key)
        return key in self._entries

    def _drop(self, key: bytes, to_disk: bool = False) -> None:
        n = self._tails.pop(key, None)
        if n is not None:
            self._tail_lengths[n] -= 1
            if self._tail_lengths[n] <= 0:
                del self._tail_lengths[n]
        if to_disk and self.disk is not None and self._worth_a_file(key):
            self._write_to_disk(key, self._entries[key])
        self._hit_keys.discard(key)
        entry = self._entries.pop(key)
        self.blob_bytes -= len(entry.blob)
        self._page_refs.subtract(entry.pages)
        for p in set(entry.pages):
            if self._page_refs[p] <= 0:
                del self._page_refs[p]
        if entry.pages:
            self.pages.decref(entry.pages)

    def _evict_oldest(self, keep: bytes | None = None) -> bool:
        key = next((k for k in self._entries if k != keep), None)
        if key is None:
            return False
        self._drop(key, to_disk=True)
        self.evictions += 1
        return True

    def shrink(self, keep: bytes | None = None) -> None:
        """Evict least recently used entries (`keep` last) until `nbytes` fits the budget."""
        while self._entries and self.nbytes > self.max_bytes:
            if not self._evict_oldest(keep):
                self._evict_oldest()

    def reclaimable_pages(self, keep: bytes | None = None) -> int:
        """Pages that evicting every entry but `keep` would free."""
        exclude = frozenset(self._entries[keep].pages) if keep in self._entries else frozenset()
        return self._only_cached(exclude)

    def evict_for_pages(self, n_free: int, keep: bytes | None = None) -> bool:
        """Evict least recently used entries (never `keep`) until the pool has `n_free` free
        pages; evicts nothing when even that could not reach it. Returns whether it has."""
        if self.pages is None or self.pages.free_pages >= n_free:
            return self.pages is not None
        if self.pages.free_pages + self.reclaimable_pages(keep) < n_free:
            return False
        while self.pages.free_pages < n_free and self._evict_oldest(keep):
            pass
        return self.pages.free_pages >= n_free

    def _write_to_disk(self, key: bytes, entry: CacheEntry) -> bool:
        """Write one entry to the disk tier (a full snapshot), unless it has none, the entry
        lacks its ids or the file is there already."""
        if self.disk is None or not entry.n_tokens or key in self.disk:
            return False
        blob = self.materialize(entry) if entry.pages and self.materialize is not None else entry.blob
        return self.disk.write(key, entry.ids[:entry.n_tokens], blob)

    def _worth_a_file(self, key: bytes, longest: dict[int, int] | None = None) -> bool:
        """A prompt's longest entry, or one a request has hit (see the module docstring).
        `longest`: each prompt's (ids object's) longest entry, from `_longest()`."""
        if key in self._tails:
            return False
        entry = self._entries[key]
        longest = self._longest() if longest is None else longest
        return key in self._hit_keys or longest[id(entry.ids)] == entry.n_tokens

    def _longest(self) -> dict[int, int]:
        longest: dict[int, int] = {}
        for e in self._entries.values():
            longest[id(e.ids)] = max(longest.get(id(e.ids), 0), e.n_tokens)
        return longest

    def flush(self) -> int:
        """Write every entry worth a file and not yet on disk, most recently used first (a clean
        shutdown); the disk's budget drops the oldest. Returns how many were written."""
        if self.disk is None:
            return 0
        longest = self._longest()
        return sum(self._write_to_disk(key, self._entries[key]) for key in reversed(list(self._entries))
                   if self._worth_a_file(key, longest))

    def clear(self) -> None:
        """Drop every entry and the cache's page references."""
        for key in list(self._entries):
            self._drop(key)

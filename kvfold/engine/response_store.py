"""Stored responses of POST /v1/responses (`kvfold.server.openai_responses`): in memory, under a
byte budget (`kvfold serve --responses-store-mib`), least recently used first out.

A record keeps what GET /v1/responses/{id} and .../input_items return (the response object, its
input items), the conversation's items through its output (what a request naming it as
`previous_response_id` continues), and its checkpoint: the token ids and the full state snapshot
its prefill left at its prompt's last block boundary (`checkpoint.Checkpoint.taken`), from which
the next turn resumes exactly. The budget counts the snapshot, its ids (8 bytes each), the JSON
of the response and input items, and a pointer per history item (the items themselves are shared
with the records of earlier turns). Evicting a record drops all of it: a later reference to it
is "not found". A record whose generation still runs (`background`) is never evicted.

Used from the server's event loop only (no locking).
"""
from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    id: str
    body: dict[str, Any]  # the response object
    input_items: list[dict[str, Any]]  # this request's input items, ids assigned
    history: tuple[dict[str, Any], ...] = ()  # the conversation's items through this response's output
    checkpoint: tuple[array, bytes] | None = None  # (ids, full snapshot at their end)
    running: Any = None  # a background response's generation while it runs (its `cancel()`)
    nbytes: int = field(default=0, init=False)

    def measure(self) -> int:
        ck = len(self.checkpoint[1]) + 8 * len(self.checkpoint[0]) if self.checkpoint is not None else 0
        text = len(json.dumps(self.body, ensure_ascii=False)) + len(json.dumps(self.input_items, ensure_ascii=False))
        self.nbytes = ck + text + 8 * len(self.history)
        return self.nbytes


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evictions = 0
        self.refused_checkpoints = 0  # snapshots that failed their checks and were dropped

    def __len__(self) -> int:
        return len(self._records)

    def put(self, rec: StoredResponse) -> bool:
        """Store (or re-store, after a change) a record, as the most recently used, evicting the
        least recently used others to fit. A record over the whole budget is kept without its
        checkpoint if that fits, else not at all. Returns whether it is stored."""
        self._forget(rec.id)
        if rec.measure() > self.max_bytes and rec.checkpoint is not None:
            rec.checkpoint = None
            rec.measure()
        if rec.nbytes > self.max_bytes:
            return False
        self._records[rec.id] = rec
        self.nbytes += rec.nbytes
        for key in [k for k, r in self._records.items() if r.running is None and k != rec.id]:
            if self.nbytes <= self.max_bytes:
                break
            self._forget(key)
            self.evictions += 1
        return True

    def get(self, rid: str) -> StoredResponse | None:
        rec = self._records.get(rid)
        if rec is not None:
            self._records.move_to_end(rid)
        return rec

    def delete(self, rid: str) -> StoredResponse | None:
        return self._forget(rid)

    def drop_checkpoint(self, rid: str) -> None:
        """A snapshot that failed its checks: never offered again (the record stays)."""
        rec = self._records.get(rid)
        if rec is not None and rec.checkpoint is not None:
            self.refused_checkpoints += 1
            self.nbytes -= rec.nbytes
            rec.checkpoint = None
            self.nbytes += rec.measure()

    def _forget(self, rid: str) -> StoredResponse | None:
        rec = self._records.pop(rid, None)
        if rec is not None:
            self.nbytes -= rec.nbytes
        return rec

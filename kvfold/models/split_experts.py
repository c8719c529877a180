"""A card layer's routed experts split between the card and the host: a partial expert pack (the
seed's `partial_set`; llama.cpp's `--n-cpu-moe`, flyweight's `--expert-mode`).

Each (row, slot) runs its expert where the expert lives: the card's stack on the layer's device,
the host's through the host's kernels (native.c on the checkpoint's FP8/FP4 bytes on the CPU).
Only the rows' activations cross, once each way, and only when a row picked a host expert.
Each slot's output is kept apart and the k outputs of a row are combined in slot order
(`combine_experts`, ascending expert ids: the batch-invariant MoE's order and native.c's
kv_moe_rows'), so where an expert ran changes no addition, only that device's own arithmetic.
(Outside batch-invariant mode a one-device model adds its experts' outputs in another order;
the split always combines as above.)

Which experts the card holds:
* "static": a fixed set (the first K by id, or the K a calibration's routing counts rank
  highest: models/expert_counts.py);
* "lru": K card slots hold the experts used most recently; an expert a step ran on the host is
  copied into the least recently used slot after that step, so the next step finds it there.
  The host keeps every expert then (a slot is only a copy).
`hits` and `slots` count the (row, slot) pairs the card served and all of them (`/metrics`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..layers.basic import QuantizedWeight
from ..layers.moe import Experts
from ..numerics.rows import combine_experts
from ..placement import HOST

POLICIES = ("static", "lru")


class SplitExperts(nn.Module):
    def __init__(self, experts: Experts, card: frozenset[int], devmap, home: str, side_backend,
                 policy: str = "static"):
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        n = experts.gate_up_proj.shape[0]
        card_ids = sorted(card)
        host_ids = list(range(n)) if policy == "lru" else [e for e in range(n) if e not in card]
        self.devmap, self.home, self.policy = devmap, home, policy
        self._side_backend = side_backend  # (device name, ops) -> that device's Backend in ops' mode
        self.card = experts.subset(card_ids)  # moves with the layer
        self.host = experts.subset(host_ids)  # stays on the host (_apply)
        self.card_ids = card_ids  # slot j of the card stack holds expert card_ids[j]
        self.register_buffer("card_local", _lookup(card_ids, n))  # global id -> card slot (len: absent)
        self.host_local = _lookup(host_ids, n)  # global id -> host stack index (kept on the host)
        self.last_used = [0] * len(card_ids)
        self.steps = self.hits = self.slots = 0

    @property
    def act_quant(self) -> bool:
        return self.card.act_quant

    def _apply(self, fn, recurse=True):
        """Moving the layer moves the card's part; the host stack stays where it is."""
        host = self._modules.pop("host")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules["host"] = host

    def tag_host(self) -> None:
        self.devmap.tag([*self.host.parameters(), *self.host.buffers(), self.host_local], HOST)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
        if self.act_quant:
            from ..errors import ConfigError
            raise ConfigError("numerics='reference' runs the release's expert order on one device; load the model "
                              "without a placement for it")
        n_card = len(self.card_ids)
        local = self.card_local[ids]
        on_card = (local < n_card).reshape(-1, 1)
        per_slot = self.card.slot_outputs(x, local, ops)
        hits = int(on_card.sum())
        if hits < ids.numel():  # some rows picked host experts: they cross, run there and come back
            devmap = self.devmap
            xh, idh, card_h = devmap.hop(x, HOST), devmap.hop(ids, HOST), devmap.hop(on_card, HOST)
            with devmap.scope(HOST):
                lh = torch.where(card_h.view(ids.shape), len(self.host_local), self.host_local[idh])
                host_slots = self.host.slot_outputs(xh, lh, self._side_backend(HOST, ops))
                missed = idh.reshape(-1)[~card_h.reshape(-1)].tolist()
            per_slot = torch.where(on_card, per_slot, devmap.hop(host_slots, self.home))
        else:
            missed = []
        self.hits, self.slots = self.hits + hits, self.slots + ids.numel()
        if self.policy == "lru":
            self._promote(local, missed)
        return combine_experts(per_slot.view(*ids.shape, -1), weights)

    def _promote(self, local: torch.Tensor, missed: list[int]) -> None:
        """LRU: mark the card slots this step used, then copy the step's host experts (most rows
        first, then lower id) into the slots used longest ago, never one used this step."""
        self.steps += 1
        n_card = len(self.card_ids)
        for j in set(local.reshape(-1).tolist()) - {n_card}:
            self.last_used[j] = self.steps
        counts: dict[int, int] = {}
        for e in missed:
            counts[e] = counts.get(e, 0) + 1
        for e in sorted(counts, key=lambda e: (-counts[e], e)):
            j = min(range(n_card), key=lambda j: (self.last_used[j], j), default=None)
            if j is None or self.last_used[j] == self.steps:
                break
            self._load_slot(j, e)

    @torch.no_grad()
    def _load_slot(self, j: int, e: int) -> None:
        src = e  # under "lru" the host stack holds every expert, in id order
        virtual = self.devmap.virtual  # the copy is a crossing, as a hop is
        with virtual.unchecked() if virtual is not None else contextlib.nullcontext():
            for name in Experts.quantizable:
                dst, from_ = getattr(self.card, name), getattr(self.host, name)
                parts = ("q", "scale") if isinstance(dst, QuantizedWeight) else (None,)
                if isinstance(dst, QuantizedWeight):
                    dst.bytes_changed()
                for part in parts:
                    d = dst if part is None else getattr(dst, part)
                    s = from_ if part is None else getattr(from_, part)
                    if d.dim() and d.shape[0] == len(self.card_ids):
                        d[j].copy_(s[src])
            self.card_local[self.card_ids[j]] = len(self.card_ids)
            self.card_local[e] = j
        self.card_ids[j] = e
        self.last_used[j] = self.steps


def _lookup(ids: list[int], n: int) -> torch.Tensor:
    """[n] long: position of each id in `ids`, len(ids) for ids not there."""
    table = torch.full((n,), len(ids), dtype=torch.long)
    if ids:
        table[torch.tensor(ids, dtype=torch.long)] = torch.arange(len(ids))
    return table

"""A model split across one accelerator and host memory at run time: where each part lives
(a `kvfold.placement.Placement`, what `kvfold plan` prints), the real device behind each name,
and the one way a tensor crosses (`hop`).

Rules (kvfold/placement.py says why; the seed's `Dsv4State` fields name them):
* each layer's weights and per-sequence state live on its device; its state is allocated there
  and nowhere else, so no host copy of a card layer's state exists to be read by mistake;
* the rows' streams cross once at each change of device along embedding, layers and head; a
  layer's rows (ids, positions, rope) are copied to its device once per call (`RowBatch.moved`);
* a card layer's routed experts that the placement leaves on the host run there
  (models/split_experts.py) and their outputs come back to be combined in the fixed slot order.

`virtual`: a `VirtualDevices` test mode (layers/virtual_devices.py). Every name then maps to the
CPU, and each part's run is a scope of that mode, so a missing hop or a tensor on the wrong side
raises on a CPU-only machine while the bits stay the one-device model's.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import PlacementError
from ..layers.virtual_devices import VirtualDevices
from ..placement import HOST, Placement


class DeviceMap:
    def __init__(self, placement: Placement, virtual: VirtualDevices | None = None):
        self.placement = placement
        self.virtual = virtual
        self.counts = None  # the routing counts that ranked its packs (load_placed.py), if any

    # ---- names --------------------------------------------------------------------------------
    def real(self, name: str) -> torch.device:
        """The torch device behind a placement name (the CPU for every name in the test mode)."""
        return torch.device(HOST if self.virtual is not None else name)

    def layer(self, i: int) -> str:
        return self.placement.layer_devices[i]

    @property
    def embed(self) -> str:
        return self.placement.embed_device

    @property
    def head(self) -> str:
        return self.placement.head_device

    @property
    def names(self) -> tuple[str, ...]:
        """Every device this placement uses, host first."""
        p = self.placement
        used = {p.embed_device, p.head_device, *p.layer_devices}
        if p.partial_layers:
            used.add(HOST)
        return tuple(sorted(used, key=lambda d: (d != HOST, d)))

    @property
    def dev_set(self) -> tuple[str, ...]:
        """Each layer's device: the seed's `dev_set`, fixed for a state when it is made."""
        return tuple(self.placement.layer_devices)

    def card_experts(self, i: int) -> frozenset[int] | None:
        """Layer i's routed experts on its own device when some of them are on the host (a
        partial pack), else None (all of them live with the layer)."""
        p = self.placement
        s = p.device_experts[i]
        if p.layer_devices[i] == HOST or s is None or len(s) == p.n_experts:
            return None
        return s

    # ---- crossings and scopes -------------------------------------------------------------------
    def hop(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """`x` on `name`'s device: a copy (so the test mode can tell the two sides apart)."""
        if self.virtual is None:
            return x.to(self.real(name), copy=True)
        with self.virtual.unchecked():
            out = x.clone()
        self.virtual.tag(out, name)
        return out

    def scope(self, name: str):
        """The run of one device's part (a check in the test mode; nothing otherwise)."""
        return self.virtual.scope(name) if self.virtual is not None else contextlib.nullcontext()

    def tag(self, obj, name: str) -> None:
        if self.virtual is not None:
            self.virtual.tag(obj, name)

    def check_model(self, n_layers: int, expert_layers: list[bool], n_experts: int) -> None:
        """Refuse (PlacementError, changing nothing) a placement made for another model's shape."""
        p = self.placement
        if len(p.layer_devices) != n_layers:
            raise PlacementError(f"the placement has {len(p.layer_devices)} layers, the model {n_layers}; make it "
                                 f"for this model (kvfold plan, or --gpu-layers 0..{n_layers})")
        dense = [i for i, (s, moe) in enumerate(zip(p.device_experts, expert_layers)) if (s is None) == moe]
        if dense or (any(expert_layers) and p.n_experts != n_experts):
            raise PlacementError(f"the placement's expert sets do not match the model (layers {dense}, "
                                 f"{p.n_experts} experts against {n_experts}); make it for this model")
        if self.virtual is None:
            from ..placement import check_devices_exist
            check_devices_exist(p)


class Walk:
    """One model call along the placement: the batch as each device sees it (`RowBatch.moved`,
    then `prepare`, the family's per-call tables such as RoPE), and the streams' crossings. For a
    model on one device every name is None, the batch is the call's own and nothing moves."""

    def __init__(self, model, batch, prepare):
        self.devmap: DeviceMap | None = model.devices
        self.model, self.prepare = model, prepare
        self.here: str | None = None  # where the streams are
        home = None if self.devmap is None else self.devmap.head  # RowBatch.build ran on model.device
        if self.devmap is not None:
            self.devmap.tag([batch.token_ids, batch.positions], home)
        self.batches = {home: batch}
        prepare(batch, home)

    def name(self, part: str | int) -> str | None:
        """The device of "embed", "head" or layer i (None on one device)."""
        if self.devmap is None:
            return None
        return {"embed": self.devmap.embed, "head": self.devmap.head}[part] if isinstance(part, str) \
            else self.devmap.layer(part)

    def batch(self, name: str | None):
        b = self.batches.get(name)
        if b is None:
            first = self.batches[self.devmap.head]
            ops = self.model.backend(first.ops.batch_invariant, self.devmap.real(name))
            b = self.batches[name] = first.moved(self.devmap.hop(first.token_ids, name),
                                                 self.devmap.hop(first.positions, name), ops)
            with self.devmap.scope(name):
                self.prepare(b, name)
        return b

    def crosses(self, name: str | None) -> bool:
        """Whether entering `name` moves the streams to another device."""
        return self.here is not None and name != self.here

    def enter(self, name: str | None, x: torch.Tensor):
        """(the batch on `name`, `x` there): `x` crosses if it is on another device."""
        if self.crosses(name):
            x = self.devmap.hop(x, name)
        self.here = name
        return self.batch(name), x

    def scope(self, name: str | None):
        return contextlib.nullcontext() if self.devmap is None else self.devmap.scope(name)

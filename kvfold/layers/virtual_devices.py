"""Placement checked on a CPU-only machine: every tensor carries the *virtual* device its placement
gave it, and an op that mixes two, or runs under one side's scope on the other's tensors, raises.

A split model (models/placed.py) with both sides on the CPU computes what the one-device model
does, so equal bits alone would not show that the split is right: a missing hop, a state row
allocated on the wrong side or an expert run on the wrong side all compute the same numbers
there. `VirtualDevices` is a `TorchFunctionMode`: while it is entered, each torch call is seen
here (tensor methods and `data_ptr` included, so a native call's pointers are seen as they are
taken). The placement tags what it owns (weights, state, the rows it hops), and:
* an op whose tagged inputs carry two devices raises `VirtualDeviceError` (a missing hop);
* inside `scope(device)` (the placement's run of one device's part), an op on a tensor tagged
  with another device raises (state or weights on the wrong side, read by a native kernel too);
* an op's outputs carry its inputs' device, or the scope's where the inputs carry none (a
  tensor created there is that device's).
Metadata (shapes, dtypes, `.device`) and reads of Python scalars (`item`, `tolist`) are not
checked: a real accelerator allows them too. This is a test mode; nothing enters it by default.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import PlacementError


class VirtualDeviceError(PlacementError):
    """An op mixed tensors of two virtual devices, or ran under one device's scope on another's."""


# Calls that read no values on a device, or read Python scalars (allowed across devices)
_UNCHECKED = frozenset({"__get__", "size", "dim", "numel", "stride", "is_contiguous", "element_size",
                        "__len__", "__repr__", "__format__", "item", "tolist", "__bool__", "__int__", "__float__",
                        "__index__", "untyped_storage", "storage_offset", "is_floating_point", "nelement",
                        "__hash__", "get_device"})


class VirtualDevices(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._depth = 0  # how many `with` blocks of the mode are open (`entered`)
        self.tags = WeakIdKeyDictionary()
        self._scope: str | None = None
        self._off = 0
        self.checked = 0  # calls checked (a test asserts the mode saw the forward at all)

    def __enter__(self):
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        return super().__exit__(*exc)

    @property
    def entered(self) -> bool:
        """Whether a `with` block of the mode is open (a mode never entered sees no op at all;
        which thread entered it is torch's to know, and a server's worker enters it too)."""
        return self._depth > 0

    def device_of(self, t: torch.Tensor) -> str | None:
        return self.tags.get(t)

    def tag(self, obj, device: str) -> None:
        """Tag every tensor in `obj` (a tensor, or a structure of them: lists, tuples, dicts, and
        objects' attributes, as a state's layers hold them) with `device`."""
        for t in _tensors_in(obj):
            self.tags[t] = device

    @contextlib.contextmanager
    def scope(self, device: str):
        """Run one device's part: every tensor it touches must be `device`'s or untagged."""
        outer, self._scope = self._scope, device
        try:
            yield
        finally:
            self._scope = outer

    @contextlib.contextmanager
    def unchecked(self):
        """The placement's own crossings (a hop copies a tensor to the other device)."""
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._off or name in _UNCHECKED:
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        devices = {d for t in flat if isinstance(t, torch.Tensor) and (d := self.tags.get(t)) is not None}
        self.checked += 1
        if len(devices) > 1:
            raise VirtualDeviceError(f"{name} mixes tensors on {' and '.join(sorted(devices))}: a hop is missing")
        if self._scope is not None and devices and devices != {self._scope}:
            raise VirtualDeviceError(f"{name} runs in {self._scope}'s part of the model on a tensor of "
                                     f"{devices.pop()}: weights or state on the wrong side")
        out = func(*args, **kwargs)
        device = next(iter(devices)) if devices else self._scope
        if device is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t not in self.tags:
                    self.tags[t] = device
        return out


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    elif getattr(obj, "holds_every_layer", False):  # a PagePool or SlotArena: tagged per layer by its owner
        return
    elif hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for item in items:
        yield from _tensors_in(item, depth + 1)

"""What native.c reads of a module's weights (descriptors holding raw pointers into them), built
once and rebuilt when any of those weights is replaced, moved or loaded again.

The check runs on every call, so it reads the modules' own dicts (`_modules`, `_parameters`,
`_buffers`) found once, not `nn.Module.__getattr__`: each step's object is the one seen at build
time, each tensor's data pointer is the same, and each `QuantizedWeight`'s native view is the
same (it is dropped when the weight is loaded again). A submodule replaced on the way is another
object at its step, so nothing stale is read.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import nn

from .basic import QuantizedWeight


def _steps(root: nn.Module, path: str) -> list[tuple[dict, str]]:
    """The (dict, name) of each attribute on `path` ("a.b.weight") from root."""
    steps, obj = [], root
    for name in path.split("."):
        for d in (obj._modules, obj._parameters, obj._buffers):
            if name in d:
                steps.append((d, name))
                obj = d[name]
                break
        else:
            raise AttributeError(f"{type(obj).__name__} has no submodule, parameter or buffer {name!r}")
    return steps


class NativeCache:
    """`build()`'s value for the weights at `paths` of `root` (None where native.c cannot read them),
    built again when they change or when `get`'s `key` (what else the value depends on, such as
    the thread count or the library the descriptors are made with) differs from the last build's;
    `build` may read that key as `self.key`."""

    def __init__(self, root: nn.Module, paths: list[str], build: Callable[[], object]):
        self.root, self.paths, self.build = root, paths, build
        self.checks = None  # resolved, built and snapshotted on the first get()
        self.key = None

    def _resolve(self) -> None:
        try:
            found = [step for path in self.paths for step in _steps(self.root, path)]
        except AttributeError:  # a weight gone: nothing native (the per-op path reports it)
            found = []
        self.steps = list({(id(d), name): (d, name) for d, name in found}.values())
        self.checks, self.value = None, None

    def _snapshot(self) -> None:
        """What `_unchanged` compares: the object at each step, at each QuantizedWeight's q, scale
        and native view, and each of those tensors' data pointer."""
        checks = [(d, name, d.get(name)) for d, name in self.steps]
        for w in [obj for _, _, obj in checks if isinstance(obj, QuantizedWeight)]:
            checks += [(w._buffers, "q", w.q), (w._buffers, "scale", w.scale),
                       (w.__dict__, "_native", w.__dict__.get("_native"))]
        self.checks = checks
        self.dicts, self.names, self.objects = (list(c) for c in zip(*checks)) if checks else ([], [], [])
        self.tensors = [t for t in self.objects if isinstance(t, torch.Tensor)]
        self.pointers = [t.data_ptr() for t in self.tensors]

    def _unchanged(self) -> bool:
        # map() keeps the loops in C: this runs on every decode step, over every weight of the model
        same = all(map(operator.is_, map(dict.get, self.dicts, self.names), self.objects))
        return same and list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers

    def get(self, key=None):
        if self.checks is None or key != self.key or not self._unchanged():
            self._resolve()  # a replaced submodule has dicts of its own
            self.key = key
            self.value = self.build() if self.steps else None
            self._snapshot()  # after building, which may make a QuantizedWeight's native view
        return self.value

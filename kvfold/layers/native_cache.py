"""What native.c reads of a module's weights (descriptors holding raw pointers into them), built
once and rebuilt when any of those weights is replaced, moved or loaded again.

The check runs on every call, so it reads the modules' own dicts (`_modules`, `_parameters`,
`_buffers`) found once, not `nn.Module.__getattr__`: a tuple of each step's object identity, each
tensor's data pointer, and each `QuantizedWeight`'s native view (dropped when it is loaded again).
A submodule replaced on the way changes the identity of its step, so nothing stale is read.
"""
from __future__ import annotations

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


def _identity(obj) -> tuple:
    if isinstance(obj, torch.Tensor):
        return id(obj), obj.data_ptr()
    if isinstance(obj, QuantizedWeight):
        return id(obj), obj.q.data_ptr(), obj.scale.data_ptr(), id(obj.__dict__.get("_native"))
    return (id(obj),)


class NativeCache:
    """`build()`'s value for the weights at `paths` of `root` (None where native.c cannot read them)."""

    def __init__(self, root: nn.Module, paths: list[str], build: Callable[[], object]):
        self.root, self.paths, self.build = root, paths, build
        self._resolve()

    def _resolve(self) -> None:
        seen, steps = set(), []
        try:
            found = [step for path in self.paths for step in _steps(self.root, path)]
        except AttributeError:  # a weight gone: nothing native (the per-op path reports it)
            found = []
        for d, name in found:
                if (id(d), name) not in seen:
                    seen.add((id(d), name))
                    steps.append((d, name))
        self.steps = steps
        self.key, self.value = None, None

    def _key(self) -> tuple:
        return tuple(_identity(d.get(name)) for d, name in self.steps)

    def get(self):
        key = self._key()
        if key != self.key:
            self._resolve()  # a replaced submodule has dicts of its own
            self.value = self.build() if self.steps else None
            self.key = self._key()  # building may make a QuantizedWeight's native view
        return self.value

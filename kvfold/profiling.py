"""Named scopes the model marks its inner steps with, for profilers (`python -m kvfold.bench.profile`).

    with scope("attention core"):
        ...

costs one global read and a shared no-op context manager while no profiler listens. A profiler
calls `with listening(timer): ...`, where `timer.enter(name)` and `timer.exit()` bracket each
scope. nn.Module boundaries need no scope: torch's forward hooks reach them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


class _Scope:
    def __init__(self, listener: Any, name: str):
        self.listener, self.name = listener, name

    def __enter__(self) -> None:
        self.listener.enter(self.name)

    def __exit__(self, *exc) -> None:
        self.listener.exit()


_QUIET = _Quiet()
_listener: Any = None


def scope(name: str):
    """A context manager around one named step: a no-op unless a profiler is `listening`."""
    return _QUIET if _listener is None else _Scope(_listener, name)


def quiet() -> bool:
    """Whether no profiler listens (fused paths that would hide the scopes run only then)."""
    return _listener is None


@contextlib.contextmanager
def listening(listener: Any) -> Iterator[Any]:
    """Within: every `scope(name)` calls listener.enter(name) on entry and listener.exit() on exit."""
    global _listener
    before, _listener = _listener, listener
    try:
        yield listener
    finally:
        _listener = before

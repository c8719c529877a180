"""A progress line for long byte-counted work: loading, converting and writing checkpoints.

One self-overwriting stderr line (carriage return) with the bytes done and in all, the percentage
and the rate in MiB/s. Dependency-free on purpose: the core install has neither tqdm nor rich.

It stays quiet unless its stream is a terminal (logs and pipes get no carriage-return noise), and
always inside `quieted()`, which the commands' `--quiet` enters. An explicit `enabled=True` (an API
caller asking for the line) wins over both.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, TextIO

# Redraw at most this often (seconds); the final line is always drawn. Tests set it to 0.
MIN_INTERVAL_S = 0.1

_quiet = False


@contextlib.contextmanager
def quieted(on: bool = True) -> Iterator[None]:
    """Within: no progress line unless one is asked for explicitly (this process, all threads)."""
    global _quiet
    before = _quiet
    _quiet = _quiet or on
    try:
        yield
    finally:
        _quiet = before


def is_quiet() -> bool:
    return _quiet


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit under 1024 of it: "512 B", "1.50 MiB", "284.10 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def progress_line(label: str, done: int, total: int, elapsed_s: float) -> str:
    """The text of one progress line (no carriage return): label, percentage, done / total, MiB/s."""
    percent = 100.0 * done / total if total > 0 else 100.0
    rate = done / (1 << 20) / max(elapsed_s, 1e-6)
    return f"kvfold: {label} {percent:5.1f}% ({format_bytes(done)} / {format_bytes(total)}, {rate:.1f} MiB/s)"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ByteProgress:
    """Counts bytes of one job towards `total_bytes` and redraws its line on `stream` (default: the
    current sys.stderr). `enabled`: None draws only on a terminal outside `quieted()`; True or
    False decide outright. Use `advance(n)` per piece of work, then `close()` (or `with`)."""

    def __init__(self, total_bytes: int, label: str, *, enabled: bool | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.label = max(int(total_bytes), 0), 0, label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = (not _quiet and _is_terminal(self.stream)) if enabled is None else enabled
        self.clock = clock
        self.started = clock()
        self.drawn_at: float | None = None  # None: nothing drawn yet (the first advance draws)
        self.drawn_done = 0

    def advance(self, nbytes: int) -> None:
        self.done += int(nbytes)
        if not self.enabled:
            return
        now = self.clock()
        finished = self.done >= self.total
        if self.drawn_at is None or finished or now - self.drawn_at >= MIN_INTERVAL_S:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn_at, self.drawn_done = now, self.done
        # \x1b[K clears what a longer previous line left behind
        self.stream.write("\r" + progress_line(self.label, self.done, self.total, now - self.started) + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        """End the line (a newline) if one was drawn, so that later output starts on its own line;
        a count the throttle left undrawn is drawn first, so the line ends on the true total."""
        if self.enabled and self.drawn_at is not None:
            if self.done != self.drawn_done:
                self._draw(self.clock())
            self.stream.write("\n")
            self.stream.flush()
            self.drawn_at = None

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Table cells of the bench report: a number, or the short status of a cell that did not run."""
from __future__ import annotations

from .protocol import OOM, SKIP_TIME, SYNTHETIC

_MIB = 1024 * 1024


def _f(v, fmt="{:.1f}"):
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _mib(v):
    return f"{v / _MIB:.0f}" if isinstance(v, (int, float)) else "-"


def _short_status(s: str | None) -> str:
    if not s or s == "ok":
        return "-"
    if s.startswith(SKIP_TIME):
        return "skipped (time)"
    if s.startswith(OOM):
        return "OOM"
    if s.startswith("partial"):
        return "partial"
    if s.startswith("unavailable"):
        return "unavailable"
    if s.startswith(SYNTHETIC):
        return "synthetic context"
    return "error"


def _prefill_cell(c: dict | None) -> str:
    if c is None:
        return "n/a"
    if c.get("prefill_status") == "ok":
        return _f(c["prefill_tok_s"])
    return _short_status(c.get("prefill_status"))


def _decode_cell(c: dict | None) -> str:
    if c is None:
        return "n/a"
    if c.get("decode_status") == "ok":
        return _f(c["decode_tok_s"])
    return _short_status(c.get("decode_status"))


def _rss_cell(c: dict | None) -> str:
    if c is None:
        return "n/a"
    if c.get("prefill_status") != "ok":
        return "-"
    if not isinstance(c.get("prefill_peak_rss_bytes"), (int, float)):
        return "-"
    d = c.get("prefill_peak_over_loaded_bytes")
    return f"{_mib(c['prefill_peak_rss_bytes'])} (+{_mib(d)})" if d is not None else _mib(c["prefill_peak_rss_bytes"])

"""The terms of decode_bytes.py's count (one Term per kind of bytes, with its formula) and the
number formatting their formulas use; shared by every family's count."""
from __future__ import annotations

from dataclasses import asdict, dataclass

_MB = 1e6


@dataclass(frozen=True)
class Term:
    key: str  # e.g. "routed_experts_active"
    label: str  # e.g. "routed experts (selected)"
    group: str  # "weights" or "state"
    bytes: float
    formula: str  # how `bytes` is made, with the numbers a reader can check

    def as_dict(self) -> dict:
        return asdict(self)


def mb(n: float) -> str:
    return f"{n / _MB:.2f} MB"


def nb(n: float) -> str:
    """Exact bytes, for the factors of a formula (rounded MB would not multiply back)."""
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"


def per_layer(by_layer: dict[int, float], what: str = "layers") -> str:
    """"N layers x B" when every layer reads the same, else "B0 + B1 + ... (layers i, j, ...)"."""
    if not by_layer:
        return f"no {what}"
    vals = list(by_layer.values())
    if all(v == vals[0] for v in vals):
        return f"{len(vals)} {what if len(vals) > 1 else what.removesuffix('s')} x {nb(vals[0])}"
    return " + ".join(nb(v) for v in vals) + f" ({what} {', '.join(str(i) for i in by_layer)})"


def _shape(shape) -> str:
    return " x ".join(str(s) for s in shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

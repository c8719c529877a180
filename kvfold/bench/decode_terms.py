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


def bucket_common(b: dict, key: str, name: str, layer: int | None, shape, nbytes: int) -> bool:
    """Put a tensor (kvfold's `name` for it, model.* layout) that every family has into its bucket:
    the embedding, the head, a routed or a shared expert. False for the others."""
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        b["embed"] = (shape, nbytes)
    elif name.startswith("lm_head."):
        b["head"].append((key, shape, nbytes))
    elif ".mlp.experts." in name:
        b["routed"][layer] = b["routed"].get(layer, 0) + nbytes
    elif ".mlp.shared_experts." in name:
        b["shared"][layer] = b["shared"].get(layer, 0) + nbytes
    else:
        return False
    return True


# ---- the terms every family has, from its buckets ({"head": [(key, shape, nbytes)], "embed": (shape,
# nbytes) or None, "routed" / "shared": {layer: bytes}, "norms": [bytes], "other": [(key, bytes)]})
def head_and_embedding_terms(b: dict) -> list[Term]:
    """The whole vocabulary head; one row of the embedding."""
    head = sum(n for _, _, n in b["head"])
    terms = [Term("lm_head", "vocabulary head", "weights", head,
                  " + ".join(f"{k} [{_shape(s)}] x {n / max(1, _numel(s)):g} B" for k, s, n in b["head"])
                  or "no head tensor")]
    if b["embed"] is None:
        return terms + [Term("embedding_row", "embedding row", "weights", 0.0, "no embedding tensor")]
    shape, nbytes = b["embed"]
    return terms + [Term("embedding_row", "embedding row", "weights", nbytes / max(1, shape[0]),
                         f"1 of {shape[0]} rows of [{_shape(shape)}]: {nb(nbytes)} / {shape[0]}")]


def expert_terms(cfg, b: dict) -> list[Term]:
    """The top-k of each MoE layer's routed experts (one expert: its matrices and their scales) and
    every shared expert."""
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    expert = {i: v / e for i, v in b["routed"].items()}
    vals = set(expert.values())
    how = (f"{k} (top-k) x {nb(vals.pop())}/expert x {len(expert)} MoE layers" if len(vals) == 1
           else f"{k} (top-k) x ({' + '.join(nb(v) for v in expert.values())}) per-layer expert")
    return [Term("routed_experts_active", f"routed experts ({k} of {e} selected)", "weights",
                 k * sum(expert.values()), how if expert else "no routed experts"),
            Term("shared_expert", "shared experts", "weights", float(sum(b["shared"].values())),
                 per_layer(b["shared"]))]


def norm_and_other_terms(b: dict) -> list[Term]:
    return [Term("norms_hc", "norms, hyper-connections", "weights", float(sum(b["norms"])),
                 f"{len(b['norms'])} tensors, all read: {nb(sum(b['norms']))}"),
            Term("other", "other weights", "weights", float(sum(n for _, n in b["other"])),
                 ", ".join(k for k, _ in b["other"][:4]) + (" ..." if len(b["other"]) > 4 else "") or "none")]

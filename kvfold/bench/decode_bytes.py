"""What one decode token reads, term by term, each with the formula it comes from (issue 42).

`decode_terms(cfg, tensors, context)` -> [Term]: the weights a decode step reads (from the
checkpoint's tensor sizes, `configs.checkpoint_tensor_sizes`, as the loaded checkpoint stores
them: FP8 / FP4 with their scales, bf16, fp32) and the state it reads at `context` tokens of
history. The terms depend on the model family: FAMILIES maps a family name (as
kvfold.models.registry names it) to its function; DeepSeek-V4's is here.

Importing this module is cheap (no torch); a family's function imports what it needs.
"""
from __future__ import annotations

import re
from typing import Callable

from .decode_bytes_glm import glm5_terms
from .decode_terms import (Term, _numel, _shape, bucket_common, expert_terms, head_and_embedding_terms, nb,
                           norm_and_other_terms, per_layer)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# ---- DeepSeek-V4 -----------------------------------------------------------------------------------
def _dsv4_buckets(cfg, tensors) -> dict:
    """Checkpoint tensors (any of the three name layouts) -> bytes per kind and layer, by kvfold name."""
    from ..models.deepseek_v4.names import to_kvfold_name
    b: dict = {"embed": None, "head": [], "attn": {}, "routed": {}, "shared": {}, "router": {}, "norms": [],
               "other": []}
    for key, (shape, nbytes) in sorted(tensors.items()):
        target = to_kvfold_name(key)
        if target is None:  # MTP: not part of a plain decode step
            continue
        name = target.name
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        if bucket_common(b, key, name, layer, shape, nbytes):
            continue
        if ".mlp.gate." in name:
            b["router"].setdefault(layer, []).append((name.rsplit(".", 1)[1], shape, nbytes))
        elif ".self_attn." in name:
            b["attn"][layer] = b["attn"].get(layer, 0) + nbytes
        elif "norm" in name or "_hc." in name or "hc_head" in name:
            b["norms"].append(nbytes)
        else:
            b["other"].append((key, nbytes))
    return b


def _dsv4_router(routers: dict[int, list]) -> tuple[float, str]:
    """The router reads its whole [E, H] matrix (held in fp32 whatever the checkpoint stores: the
    native MoE reads fp32), a hash layer one row of its token -> experts table, a scored layer its
    correction bias."""
    mats, rows, bias = {}, {}, 0.0
    for layer, parts in routers.items():
        for leaf, shape, nbytes in parts:
            if leaf == "tid2eid":
                rows[layer] = nbytes / max(1, shape[0])
            elif leaf == "weight":
                mats[layer] = 4.0 * _numel(shape)
            else:
                bias += nbytes
    total = sum(mats.values()) + sum(rows.values()) + bias
    shape = next((s for parts in routers.values() for leaf, s, _ in parts if leaf == "weight"), ())
    formula = f"gate [{_shape(shape)}] x 4 B: {per_layer(mats)}"
    if rows:
        formula += f" + 1 tid2eid row ({nb(next(iter(rows.values())))}) x {len(rows)} hash layer{'s' * (len(rows) > 1)}"
    if bias:
        formula += f" + score biases {nb(bias)}"
    return total, formula


def _dsv4_weight_terms(cfg, b: dict) -> list[Term]:
    from ..models.deepseek_v4.config import CSA, HCA, SLIDING
    t = head_and_embedding_terms(b)
    for kind, short, label in ((SLIDING, "sliding", "attention, sliding window"),
                               (CSA, "csa", "attention, CSA (+ compressor, indexer)"),
                               (HCA, "hca", "attention, HCA (+ compressor)")):
        by = {i: v for i, v in b["attn"].items() if cfg.layer_types[i] == kind}
        t.append(Term(f"attention_{short}", label, "weights", float(sum(by.values())),
                      per_layer(by, f"{short.upper() if short != 'sliding' else short} layers")))
    t += expert_terms(cfg, b)
    t.append(Term("dense_mlp", "dense MLPs", "weights", 0.0, "none: every DeepSeek-V4 layer is MoE"))
    router, how = _dsv4_router(b["router"])
    t.append(Term("router", "routers", "weights", router, how))
    return t + norm_and_other_terms(b)


def _dsv4_state_terms(cfg, context: int, s: int) -> list[Term]:
    """The cache a decode token at `context` tokens of history reads, in `s`-byte values: every
    layer's window rows; CSA's top-k of its compressed entries and the indexer keys of all of
    them (each is scored); HCA's compressed entries, all. Left out: the compressors' open-window
    rings (fp32), read once per `ratio` tokens, a few KB per token."""
    from ..models.deepseek_v4.config import CSA, SLIDING
    c, w, d, di = context, cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    n = len(cfg.layer_types)
    window = n * min(c, w) * d * s
    groups: dict[tuple[str, int], int] = {}
    for kind, r in zip(cfg.layer_types, cfg.compress_ratios):
        if kind != SLIDING:
            groups[(kind, r)] = groups.get((kind, r), 0) + 1
    comp, idx, comp_f, idx_f = 0, 0, [], []
    for (kind, r), m in groups.items():
        if kind == CSA:
            comp += m * min(cfg.index_topk, c // r) * d * s
            comp_f.append(f"{m} CSA x min({cfg.index_topk}, {c}//{r}) x {d} x {s} B")
            idx += m * (c // r) * di * s
            idx_f.append(f"{m} CSA x {c}//{r} x {di} x {s} B")
        else:
            comp += m * (c // r) * d * s
            comp_f.append(f"{m} HCA x {c}//{r} x {d} x {s} B")
    return [Term("state_window", "window rows", "state", float(window), f"{n} layers x min({c}, {w}) x {d} x {s} B"),
            Term("state_compressed", "compressed entries", "state", float(comp), " + ".join(comp_f) or "none"),
            Term("state_index_keys", "index-score key reads", "state", float(idx), " + ".join(idx_f) or "none")]


def dsv4_terms(cfg, tensors, context: int, state_elem_bytes: int) -> list[Term]:
    return _dsv4_weight_terms(cfg, _dsv4_buckets(cfg, tensors)) + _dsv4_state_terms(cfg, context, state_elem_bytes)


# a family's (cfg, {name: (shape, nbytes)}, context, state value bytes) -> [Term]
FAMILIES: dict[str, Callable[..., list[Term]]] = {"deepseek_v4": dsv4_terms, "glm5_next": glm5_terms}
_CONFIG_FAMILY = {"Dsv4Config": "deepseek_v4", "Glm5Config": "glm5_next"}


def family_of_config(cfg) -> str:
    return _CONFIG_FAMILY.get(type(cfg).__name__, type(cfg).__name__)


def decode_terms(cfg, tensors, context: int, state_elem_bytes: int = 4) -> list[Term]:
    family = family_of_config(cfg)
    if family not in FAMILIES:
        raise ValueError(f"no decode-bytes formula for model family {family!r} (add one to decode_bytes.FAMILIES)")
    return FAMILIES[family](cfg, tensors, context, state_elem_bytes)


def totals(terms: list[Term]) -> dict[str, float]:
    """{term key: bytes} plus the sums: "attention" (every attention_* term), "weights_total",
    "state" and "total" (= weights_total + state)."""
    out = {t.key: t.bytes for t in terms}
    out["attention"] = sum(t.bytes for t in terms if t.key.startswith("attention_"))
    out["weights_total"] = sum(t.bytes for t in terms if t.group == "weights")
    out["state"] = sum(t.bytes for t in terms if t.group == "state")
    out["total"] = out["weights_total"] + out["state"]
    return out


def per_context(cfg, tensors, contexts, state_elem_bytes: int = 4) -> tuple[dict[str, dict], dict]:
    """({context: totals}, the JSON's "decode_bytes" entry: family, state value bytes and
    {context: [term dicts]}). A family without a formula gives ({}, the entry with "missing")."""
    family = family_of_config(cfg)
    info: dict = {"family": family, "state_elem_bytes": state_elem_bytes, "terms": {}}
    if family not in FAMILIES:
        info["missing"] = f"no formula for the {family} family yet (kvfold/bench/decode_bytes.py FAMILIES)"
        return {}, info
    per = {}
    for c in contexts:
        terms = FAMILIES[family](cfg, tensors, c, state_elem_bytes)
        info["terms"][str(c)] = [t.as_dict() for t in terms]
        per[str(c)] = totals(terms)
    return per, info

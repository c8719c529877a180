"""GLM-5.3 (`glm5_next`)'s decode bytes per token (decode_bytes.py's Term list, the same keys as
DeepSeek-V4's where the kinds match): a KDA layer reads all its projections and its recurrent
state; a DSA layer its MLA projections (kv_b_proj whole: the absorbed form), its indexer, the keys
and gates of every visible token (each is scored) and the latent rows of the top-k it selects;
MoE layers the top-k of their routed experts and the shared expert; dense layers their MLP.
"""
from __future__ import annotations

import re

from .decode_terms import (Term, _numel, bucket_common, expert_terms, head_and_embedding_terms, norm_and_other_terms,
                           per_layer)

_LAYER = re.compile(r"^layers\.(\d+)\.")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _bare(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key


def _buckets(cfg, tensors) -> dict:
    b: dict = {"embed": None, "head": [], "kda": {}, "dsa": {}, "routed": {}, "shared": {}, "dense": {},
               "router": {}, "norms": [], "other": []}
    for key, (shape, nbytes) in sorted(tensors.items()):
        name = _bare(key)
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        if layer is not None and layer >= cfg.num_hidden_layers:
            continue  # the MTP layer: not part of a plain decode step
        if bucket_common(b, key, name, layer, shape, nbytes):
            continue
        if ".mlp.gate." in name:
            # the router is held in fp32 whatever the checkpoint stores; its bias is read whole
            b["router"][layer] = b["router"].get(layer, 0) + (4 * _numel(shape) if name.endswith(".weight") else nbytes)
        elif ".mlp." in name:
            b["dense"][layer] = b["dense"].get(layer, 0) + nbytes
        elif ".self_attn." in name:
            kind = "kda" if cfg.layer_types[layer] == "linear_attention" else "dsa"
            b[kind][layer] = b[kind].get(layer, 0) + nbytes
        elif "norm" in name or "_hc" in name or "hc_" in name:
            b["norms"].append(nbytes)
        else:
            b["other"].append((key, nbytes))
    return b


def _weight_terms(cfg, b: dict) -> list[Term]:
    t = head_and_embedding_terms(b)
    t.append(Term("attention_kda", "attention, KDA (all projections)", "weights", float(sum(b["kda"].values())),
                  per_layer(b["kda"], "KDA layers")))
    t.append(Term("attention_dsa", "attention, DSA (MLA + indexer)", "weights", float(sum(b["dsa"].values())),
                  per_layer(b["dsa"], "DSA layers")))
    t += expert_terms(cfg, b)
    t.append(Term("dense_mlp", "dense MLPs", "weights", float(sum(b["dense"].values())),
                  per_layer(b["dense"], "dense layers")))
    t.append(Term("router", "routers (fp32) and score biases", "weights", float(sum(b["router"].values())),
                  per_layer(b["router"], "MoE layers")))
    return t + norm_and_other_terms(b)


def _state_terms(cfg, context: int, s: int) -> list[Term]:
    """KDA: the fp32 recurrent state [H, dk, dv] and the conv taps' last kw-1 inputs (q, k, v);
    DSA (layers that run their own indexer): every visible token's indexer key and gate, and the
    latent rows of the top-k selected (all of them while the context is shorter)."""
    n_kda = sum(t == "linear_attention" for t in cfg.layer_types)
    h, d, kw = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    n_ix = sum(1 for i, t in enumerate(cfg.layer_types) if t == "indexed_attention" and cfg.indexer_types[i] == "full")
    n_dsa = sum(t == "indexed_attention" for t in cfg.layer_types)
    c, di, lat, topk = context, cfg.index_head_dim, cfg.kv_lora_rank, cfg.index_topk
    return [
        Term("state_kda", "KDA recurrent state", "state", float(n_kda * h * d * d * 4),
             f"{n_kda} KDA layers x {h} heads x {d} x {d} x 4 B"),
        Term("state_kda_conv", "KDA conv inputs", "state", float(n_kda * (kw - 1) * 3 * h * d * 4),
             f"{n_kda} KDA layers x {kw - 1} x 3 x {h * d} x 4 B"),
        Term("state_index_keys", "indexer keys and gates (all scored)", "state", float(n_ix * c * 2 * di * s),
             f"{n_ix} indexer layers x {c} x 2 x {di} x {s} B"),
        Term("state_latent", "selected latent rows", "state", float(n_dsa * min(topk, c) * lat * s),
             f"{n_dsa} DSA layers x min({topk}, {c}) x {lat} x {s} B"),
    ]


def glm5_terms(cfg, tensors, context: int, state_elem_bytes: int) -> list[Term]:
    return _weight_terms(cfg, _buckets(cfg, tensors)) + _state_terms(cfg, context, state_elem_bytes)

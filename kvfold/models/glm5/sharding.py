"""Which part of each GLM-5.3 checkpoint tensor a tensor-parallel rank holds (shared/docs/parallel.md):

* KDA layers, by head: q, k, v projections and their conv taps, f_b, g_b, dt_bias (channel rows
  of this rank's heads), A_log and b_proj (its heads), o_proj's input columns; f_a, g_a and the
  gated norm stay whole. The KDA state (conv rows, recurrent state, rewind inputs) is split the
  same way: each rank holds its heads' (state.py gathers it into a snapshot);
* DSA / MLA layers, by head as DeepSeek's MLA: q_b_proj and kv_b_proj rows, o_proj's input
  columns; q_a, kv_a, norms and the indexer whole (so the latent and indexer rows are whole);
* routed experts by contiguous id range, the shared expert on rank 0; dense MLPs, router, mHC,
  embedding and lm_head whole.
"""
from __future__ import annotations

from .config import KDA


def tp_counts(cfg) -> dict[str, int]:
    return {"num_attention_heads": cfg.num_attention_heads, "linear_num_heads": cfg.linear_num_heads,
            "n_routed_experts": cfg.n_routed_experts}


def _layer_kind(name: str, cfg) -> str | None:
    if name.startswith("mtp."):
        return "dsa"
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return "kda" if cfg.layer_types[int(parts[2])] == KDA else "dsa"
    return None


def tp_slice(name: str, cfg, tp) -> tuple[int, int, int] | None:
    """(dim, lo, hi) of the whole tensor `name` (internal name) this rank holds; None: all of it."""
    if tp is None:
        return None
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return (0, *tp.span(cfg.n_routed_experts))
    if ".self_attn." not in name:
        return None
    leaf = name.split(".self_attn.", 1)[1]
    kind = _layer_kind(name, cfg)
    if kind == "kda":
        h0, h1 = tp.span(cfg.linear_num_heads)
        dk = cfg.linear_head_dim
        if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d", "k_conv1d", "v_conv1d",
                    "f_b_proj.weight", "g_b_proj.weight", "dt_bias"):
            return 0, h0 * dk, h1 * dk
        if leaf in ("A_log", "b_proj.weight"):
            return 0, h0, h1
        if leaf == "o_proj.weight":
            return 1, h0 * dk, h1 * dk
        return None
    m0, m1 = tp.span(cfg.num_attention_heads)
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    if leaf == "q_b_proj.weight":
        return 0, m0 * dn, m1 * dn
    if leaf == "kv_b_proj.weight":
        return 0, m0 * (dn + dv), m1 * (dn + dv)
    if leaf == "o_proj.weight":
        return 1, m0 * dv, m1 * dv
    return None

"""Which part of each DeepSeek-V4 checkpoint tensor a tensor-parallel rank holds (as vLLM and
SGLang shard V4, shared/docs/parallel.md):

* query heads: `wq_b` (q_b_proj) rows and the per-head `sinks`, split into contiguous head ranges;
* output groups: `wo_a` (o_a_proj) rows and `wo_b` (o_b_proj) input columns, by group range (a
  group's heads are the heads of the ranks that hold it: heads and groups split alike);
* routed experts: a contiguous id range per rank; the router, bias and hash table stay whole;
* the shared expert: rank 0 (the others do not load it);
* everything else whole: wq_a, K = V (wkv), compressors, indexers, norms, mHC, embedding, lm_head.

The loader reads one checkpoint tensor at a time and keeps only this rank's slice, so no rank holds
the whole model. The MTP block is sharded the same way.
"""
from __future__ import annotations

from .config import Dsv4Config


def tp_counts(cfg: Dsv4Config) -> dict[str, int]:
    """The counts the rank count must divide."""
    return {"num_attention_heads": cfg.num_attention_heads, "o_groups": cfg.o_groups,
            "n_routed_experts": cfg.n_routed_experts}


def tp_slice(name: str, cfg: Dsv4Config, tp) -> tuple[int, int, int] | None:
    """(dim, lo, hi): the slice of the whole tensor `name` (an internal name, a whole stacked expert
    tensor included) this rank holds; None: the whole tensor."""
    if tp is None:
        return None
    if ".self_attn." in name:
        leaf = name.split(".self_attn.", 1)[1]
        heads, groups, r = tp.span(cfg.num_attention_heads), tp.span(cfg.o_groups), cfg.o_lora_rank
        if leaf == "q_b_proj.weight":
            return 0, heads[0] * cfg.head_dim, heads[1] * cfg.head_dim
        if leaf == "sinks":
            return 0, heads[0], heads[1]
        if leaf == "o_a_proj.weight":
            return 0, groups[0] * r, groups[1] * r
        if leaf == "o_b_proj.weight":
            return 1, groups[0] * r, groups[1] * r
        return None
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return (0, *tp.span(cfg.n_routed_experts))
    return None

"""Tensor names of the three DeepSeek-V4 checkpoint layouts, mapped to kvfold's parameter names
(which are the transformers module names):

* transformers module names (`save_original_format=False`): used as they are;
* what transformers' `save_pretrained` writes by default: official leaf names under `model.`
  (`model.layers.1.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, `head.weight`);
* the official release names (`embed.weight`, `layers.1.attn.wq_a.weight`, `hc_head_fn`, ...).
Per-expert w1/w3/w2 tensors land in slices of the stacked `gate_up_proj` / `down_proj`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_RULES = [(re.compile(p), r) for p, r in [
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: parameter `name`, or expert `expert`'s `part` of it."""
    name: str
    expert: int | None = None
    part: str | None = None  # "w1" (gate rows), "w3" (up rows), "w2" (down)


def to_kvfold_name(key: str) -> Target | None:
    """Checkpoint key -> target; None for `mtp.*` (handled by the MTP loader)."""
    k = key.removeprefix("model.")
    if k.startswith("mtp."):
        return None
    if k in ("head.weight", "lm_head.weight"):
        return Target("lm_head.weight")
    for pat, repl in _RULES:
        k = pat.sub(repl, k)
    m = _EXPERT.match(k)
    if m:
        stem, e, part = m.group(1), int(m.group(2)), m.group(3)
        name = f"model.{stem}." + ("down_proj" if part == "w2" else "gate_up_proj")
        return Target(name, e, part)
    return Target("model." + k)

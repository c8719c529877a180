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

from ...numerics.quant_formats import FP4, FP8

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


# ---- MTP keys ---------------------------------------------------------------------------------

# `mtp.0.<head leaf>` (official) -> MtpModule attribute path
_MTP_HEAD = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
             "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
             "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP_KEY = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")


def is_mtp_key(key: str) -> bool:
    return key.removeprefix("model.").startswith("mtp.")


def mtp_target(key: str) -> Target | None:
    """`mtp.0.*` checkpoint key (official block names or transformers block names) -> the parameter of
    `Dsv4Model.mtp` (an `MtpModule`) it fills, named as in `Dsv4Model.named_parameters()` (`mtp.` prefix).
    None for keys kvfold does not load: other MTP depths (`mtp.1.*`, unsupported), and the copies of
    the shared embedding / head some releases carry (`mtp.0.emb.*`, `mtp.0.head.weight`), which the
    official converter drops as well."""
    m = _MTP_KEY.match(key)
    if m is None:
        return None
    depth, rest = int(m.group(1)), m.group(2)
    if depth != 0 or rest.startswith("emb") or rest == "head.weight":
        return None
    if rest in _MTP_HEAD:
        return Target("mtp." + _MTP_HEAD[rest])
    if rest in _MTP_HEAD.values():
        return Target("mtp." + rest)
    t = to_kvfold_name("layers.0." + rest)  # block leaves: same rules as any layer
    name = "mtp.block." + t.name.removeprefix("model.layers.0.")
    return Target(name, t.expert, t.part)


# ---- kvfold names -> official names -------------------------------------------------------------

# leaf names inside one block (transformers module name -> official release name)
_LAYER_LEAVES = {
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_official_names(name: str, n_routed_experts: int) -> list[tuple[str, int | None, str | None]]:
    """kvfold parameter name -> [(official key, expert, part)]: one entry, or for stacked experts one per
    expert and part (`gate_up_proj` -> w1 rows [:I] and w3 rows [I:]; `down_proj` -> w2).
    Raises KeyError for a name that has no official counterpart."""
    if name in _TOP:
        return [(_TOP[name], None, None)]
    if name.startswith("mtp."):
        rest = name[len("mtp."):]
        inv = {v: k for k, v in _MTP_HEAD.items()}
        if rest in inv:
            return [("mtp.0." + inv[rest], None, None)]
        if not rest.startswith("block."):
            raise KeyError(name)
        prefix, leaf = "mtp.0.", rest[len("block."):]
    else:
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(name)
        prefix, leaf = f"layers.{m.group(1)}.", m.group(2)
    if leaf == "mlp.experts.gate_up_proj":
        return [(f"{prefix}ffn.experts.{e}.{p}.weight", e, p) for e in range(n_routed_experts) for p in ("w1", "w3")]
    if leaf == "mlp.experts.down_proj":
        return [(f"{prefix}ffn.experts.{e}.w2.weight", e, "w2") for e in range(n_routed_experts)]
    return [(prefix + _LAYER_LEAVES[leaf], None, None)]


def hf_key_for_official(official_key: str) -> str:
    """The name transformers' `save_pretrained` (5.23, default format) gives a release tensor: official
    leaf names under `model.`, except `head.weight`, and the top-level embed / hc_head names, which it
    keeps as module names (`model.embed_tokens.weight`, `model.hc_head.hc_fn`)."""
    if official_key == "head.weight":
        return official_key
    inverse = {"embed.weight": "embed_tokens.weight", "hc_head_fn": "hc_head.hc_fn",
               "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
    return "model." + inverse.get(official_key, official_key)


# ---- what the official release quantizes -------------------------------------------------------

_FP8_LEAVES = re.compile(
    r"(^|\.)(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight"
    r"|self_attn\.compressor\.indexer\.q_b_proj\.weight"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight)$")
_MTP_FP8 = {"mtp.e_proj.weight", "mtp.h_proj.weight"}
_FP4_LEAVES = re.compile(r"(^|\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def official_quant_kind(name: str) -> str | None:
    """For a kvfold parameter name: FP8 (attention wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b, shared experts,
    MTP e_proj/h_proj), FP4 (routed experts), or None (kept in bf16/fp32: embed, head, norms, compressor
    projections and ape, indexer weights_proj, router, hc parameters, sinks)."""
    if name in _MTP_FP8 or _FP8_LEAVES.search(name):
        return FP8
    if _FP4_LEAVES.search(name):
        return FP4
    return None

"""DeepSeek-V4's multi-token-prediction (MTP) block, used as a speculative drafter.

At position t it reads the main model's final streams H_t and the embedding of token t+1 and
predicts token t+2:  X_k = e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(H_t,k)); then one
full block (sliding-window attention with the plain-theta RoPE, score-routed MoE), its own
hc_head and norm, and the shared `lm_head`. It keeps its own sliding-window state, which
rewinds like the main one. The `mtp.0.*` tensors come in the official layout or with the
transformers block names; both are accepted.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from ..config import SLIDING, Dsv4Config
from ..errors import CheckpointError
from ..layers.basic import Linear, Norm
from ..layers.mhc import HyperHead
from ..state.dsv4_state import Dsv4State, LayerState
from ..state.rings import PositionRing

# official block-relative names -> transformers block-relative names
_OFFICIAL_BLOCK = [
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_attn_(fn|base|scale)", r"attn_hc.\1"),
    (r"hc_ffn_(fn|base|scale)", r"ffn_hc.\1"),
    (r"attn\.wq_a\.weight", "self_attn.q_a_proj.weight"),
    (r"attn\.q_norm\.weight", "self_attn.q_a_norm.weight"),
    (r"attn\.wq_b\.weight", "self_attn.q_b_proj.weight"),
    (r"attn\.wkv\.weight", "self_attn.kv_proj.weight"),
    (r"attn\.kv_norm\.weight", "self_attn.kv_norm.weight"),
    (r"attn\.wo_a\.weight", "self_attn.o_a_proj.weight"),
    (r"attn\.wo_b\.weight", "self_attn.o_b_proj.weight"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"ffn\.gate\.weight", "mlp.gate.weight"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.shared_experts\.w1\.weight", "mlp.shared_experts.gate_proj.weight"),
    (r"ffn\.shared_experts\.w3\.weight", "mlp.shared_experts.up_proj.weight"),
    (r"ffn\.shared_experts\.w2\.weight", "mlp.shared_experts.down_proj.weight"),
]
_HEAD = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
         "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
         "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


def mtp_block_config(cfg: Dsv4Config) -> Dsv4Config:
    """The MTP block is one sliding-window layer with score-routed MoE."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(SLIDING,), compress_ratios=(0,),
                               mlp_layer_types=("moe",))


class MtpModule(nn.Module):
    def __init__(self, cfg: Dsv4Config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from .deepseek_v4 import Block  # the same block code as the main model
        self.cfg = mtp_block_config(cfg)
        self.dtype, self.device = dtype, device
        h = cfg.hidden_size
        self.e_proj = Linear(h, h, dtype, device)
        self.h_proj = Linear(h, h, dtype, device)
        self.enorm = Norm(h, cfg.rms_norm_eps, device)
        self.hnorm = Norm(h, cfg.rms_norm_eps, device)
        self.norm = Norm(h, cfg.rms_norm_eps, device)
        self.hc_head = HyperHead(cfg.hc_mult, h, cfg.hc_eps, cfg.rms_norm_eps, device)
        self.block = Block(self.cfg, 0, dtype, device)
        self.fingerprint = "mtp-" + self.cfg.fingerprint()[:12]

    def new_state(self, capacity: int, max_rewind: int) -> Dsv4State:
        ring = PositionRing(self.cfg.sliding_window + max_rewind, self.cfg.head_dim, self.dtype, self.device)
        return Dsv4State([LayerState(window=ring)], window=self.cfg.sliding_window, capacity=capacity,
                         max_rewind=max_rewind, fingerprint=self.fingerprint, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: Dsv4State, embed: torch.Tensor,
                lm_head: nn.Module, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hc, d] (main streams at positions pos..pos+T-1), next_ids [T] (the tokens one
        position later) -> (logits [T, vocab] predicting two positions ahead, output streams [T, hc, d])."""
        from ..errors import CapacityError
        state.check_usable(self.fingerprint, self.device, self.dtype)
        t = next_ids.numel()
        if state.pos + t > state.capacity:
            raise CapacityError(f"MTP state capacity {state.capacity} exceeded at pos {state.pos} + {t}")
        e = self.e_proj(self.enorm(embed[next_ids]))
        x = e[:, None, :] + self.h_proj(self.hnorm(hidden.to(self.dtype)))
        start = state.pos
        positions = torch.arange(start, start + t, device=next_ids.device)
        streams = self.block(x, next_ids, start, state.layers[0], rope, positions, rope.cos_sin(positions))
        state.pos = state.written_until = start + t
        logits = lm_head(self.norm(self.hc_head(streams))).float()
        return logits, streams


def load_mtp(model, weights: dict[str, torch.Tensor]) -> MtpModule | None:
    """Build the MTP module from `mtp.0.*` tensors (official or transformers block names)."""
    prefix = "mtp.0."
    own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if not own:
        return None
    mtp = MtpModule(model.config, model.dtype, model.device)
    params = dict(mtp.named_parameters())
    params.update(dict(mtp.named_buffers()))
    seen, unexpected = set(), []
    cfg = model.config
    inter = cfg.moe_intermediate_size
    for key, tensor in own.items():
        name = _HEAD.get(key)
        if name is None:
            m = _EXPERT.fullmatch(key)
            if m:
                e, part = int(m.group(1)), m.group(2)
                if e >= cfg.n_routed_experts:
                    unexpected.append(prefix + key)
                    continue
                if part == "w2":
                    params["block.mlp.experts.down_proj"].data[e].copy_(tensor)
                else:
                    rows = slice(0, inter) if part == "w1" else slice(inter, 2 * inter)
                    params["block.mlp.experts.gate_up_proj"].data[e, rows].copy_(tensor)
                seen.add(f"expert{e}.{part}")
                continue
            for pat, repl in _OFFICIAL_BLOCK:
                if re.fullmatch(pat, key):
                    name = "block." + re.sub(pat, repl, key)
                    break
            else:
                name = "block." + key  # transformers block names
        if name not in params:
            unexpected.append(prefix + key)
            continue
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{prefix}{key}: shape {tuple(tensor.shape)} vs expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        seen.add(name)
    expert_parts = {f"expert{e}.{p}" for e in range(cfg.n_routed_experts) for p in ("w1", "w2", "w3")}
    if expert_parts <= seen:
        seen |= {"block.mlp.experts.down_proj", "block.mlp.experts.gate_up_proj"}
    seen -= expert_parts
    missing = sorted(set(params) - seen)
    if missing or unexpected:
        raise CheckpointError(f"MTP weights do not match the config: missing {missing[:20]}, "
                              f"unexpected {unexpected[:20]}")
    return mtp


def official_mtp_weights(mtp: MtpModule) -> dict[str, torch.Tensor]:
    """The module's weights under official `mtp.0.*` names (used to write test checkpoints)."""
    out = {}
    sd = mtp.state_dict()
    inv_head = {v: k for k, v in _HEAD.items()}
    inter = mtp.cfg.moe_intermediate_size
    for name, t in sd.items():
        if name in inv_head:
            out["mtp.0." + inv_head[name]] = t
            continue
        rel = name[len("block."):]
        if rel == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"mtp.0.ffn.experts.{e}.w3.weight"] = t[e, inter:]
            continue
        if rel == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w2.weight"] = t[e]
            continue
        for pat, repl in _OFFICIAL_BLOCK:
            # invert the simple one-to-one renames
            plain = repl.replace(r"\1", "")
            if "(" not in pat and rel == repl:
                out["mtp.0." + pat.replace("\\", "")] = t
                break
            if "(" in pat and rel.startswith(plain):
                out["mtp.0." + pat.split("(")[0].replace("\\", "") + rel[len(plain):]] = t
                break
        else:
            raise KeyError(name)
    return {k: v.contiguous().clone() for k, v in out.items()}

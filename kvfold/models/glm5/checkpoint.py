"""Load a GLM-5.3 (`glm5_next`) checkpoint directory into a `Glm5Model`.

Weights are named as the text part of a transformers `Glm5NextForConditionalGeneration` checkpoint
written by `save_pretrained` (`model.language_model.*`, `hc_attn_fn`, `q_conv1d`, per-expert
`experts.N.gate_proj`); the in-memory layout (`attn_hc.fn`, fused `conv1d`, `forget_gate.*`,
stacked `experts.gate_up_proj`) and text-only `model.*` names load as well.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ...errors import CheckpointError, ConfigError
from .config import load_glm5_config
from .model import Glm5Model

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.")
_VISION_MARKERS = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.")
_HC_NAMES = {"hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
             "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale"}


def _checkpoint_tensors(directory: Path):
    from safetensors import safe_open
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _internal(name: str, n_layers: int) -> tuple[str, str | None]:
    """(kind, internal name): kind "text", "vision" or "skip" (MTP layers, shared heads)."""
    bare = name
    for m in ("model.", ""):
        if any(bare.startswith(m + v) for v in _VISION_MARKERS):
            return "vision", None
    if bare == "lm_head.weight" or bare.startswith("lm_head."):
        return "text", bare
    for p in _TEXT_PREFIXES:
        if bare.startswith(p):
            bare = bare[len(p):]
            break
    else:
        return "skip", None
    parts = bare.split(".")
    if parts[0] == "layers":
        if int(parts[1]) >= n_layers or "shared_head" in parts or parts[2] in ("eh_proj", "enorm", "hnorm"):
            return "skip", None
        if parts[2] in _HC_NAMES:
            parts = parts[:2] + _HC_NAMES[parts[2]].split(".") + parts[3:]
        if parts[2] == "self_attn" and parts[3] == "forget_gate":
            parts = parts[:3] + parts[4:]
    return "text", "model." + ".".join(parts)


@torch.no_grad()
def load_glm5_weights(model: Glm5Model, directory: Path) -> None:
    cfg = model.config
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen: set[str] = set()
    experts: dict[tuple[str, int, str], torch.Tensor] = {}
    n_vision = 0

    def put(name: str, t: torch.Tensor) -> None:
        if name not in params:
            raise CheckpointError(f"checkpoint tensor {name} has no place in the glm5_next model")
        p = params[name]
        if tuple(p.shape) != tuple(t.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        p.copy_(t.to(p.dtype))
        seen.add(name)

    for raw, t in _checkpoint_tensors(directory):
        kind, name = _internal(raw, cfg.num_hidden_layers)
        if kind == "vision":
            n_vision += 1
            continue
        if kind == "skip":
            continue
        parts = name.split(".")
        if ".self_attn.conv1d.weight" in name:  # in-memory layout: fused q|k|v taps
            pre = name[:-len("conv1d.weight")]
            for sub, piece in zip(("q", "k", "v"), t.chunk(3, dim=0)):
                put(f"{pre}{sub}_conv1d", piece)
            continue
        if ".self_attn." in name and name.endswith("_conv1d.weight"):
            put(name[:-len(".weight")], t)
            continue
        if len(parts) >= 8 and parts[4] == "experts" and parts[5].isdigit():  # experts.N.gate_proj.weight
            experts[(".".join(parts[:5]), int(parts[5]), parts[6])] = t
            continue
        put(name, t)
    for (pre, e, which), t in experts.items():
        if which in ("gate_proj", "up_proj"):
            p = params.get(pre + ".gate_up_proj")
            if p is None:
                raise CheckpointError(f"checkpoint expert {pre}.{e} has no place in the glm5_next model")
            i = cfg.moe_intermediate_size
            rows = slice(0, i) if which == "gate_proj" else slice(i, 2 * i)
            p[e, rows].copy_(t.to(p.dtype))
        elif which == "down_proj":
            params[pre + ".down_proj"][e].copy_(t.to(params[pre + ".down_proj"].dtype))
        else:
            raise CheckpointError(f"unknown expert tensor {pre}.{e}.{which}")
        seen.add(pre + (".down_proj" if which == "down_proj" else ".gate_up_proj"))
    if "lm_head.weight" not in seen and cfg.tie_word_embeddings and "model.embed_tokens.weight" in seen:
        params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} glm5_next tensors, e.g. {missing[:5]}")
    if n_vision:
        print(f"kvfold: note: ignoring {n_vision} vision tensors (glm5_next is loaded as a text model)",
              file=sys.stderr)


def load_glm5(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              numerics: str = "hf", weights: str = "dequant") -> Glm5Model:
    directory = Path(directory)
    if numerics != "hf":
        raise ConfigError(f"glm5_next supports numerics 'hf' only, got {numerics!r}")
    if weights != "dequant":
        raise ConfigError(f"glm5_next loads float weights only (weights='dequant'), got {weights!r}")
    cfg = load_glm5_config(directory)
    model = Glm5Model(cfg, dtype=dtype, device=device)
    load_glm5_weights(model, directory)
    try:
        from ...tokenizer import load_tokenizer
        model.tokenizer = load_tokenizer(str(directory), cfg.bos_token_id, cfg.eos_ids[0] if cfg.eos_ids else None,
                                         cfg.vocab_size)
    except ConfigError as e:
        print(f"kvfold: note: {e}", file=sys.stderr)
    return model.eval()

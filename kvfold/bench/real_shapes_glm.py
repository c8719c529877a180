"""The `glm53-flash` bench checkpoint: GLM-5.3-Flash's release config (kvfold/assets/configs/
glm5_3_flash.json) cut to its first N layers (default 4: three KDA layers with the dense MLP,
one DSA layer with its indexer and the 288-expert MoE), without the MTP layer, at the release's
widths: hidden 4096, 64 KDA heads of 128, MLA q_lora 1536 / kv_lora 512 / heads of 256, 32
indexer heads of 128 (k-pool 4, top-2048), experts of 2048 (top 8) plus one shared, vocabulary
154,880.

Written tensor by tensor in the release's block-FP8 format (docs/checkpoints.md): float8_e4m3fn
with an fp32 `weight_scale_inv` per 128x128 block (scale = the block's amax / 448) for the DSA
layer's MLA projections, its indexer's `wq_b` and `wk`, the shared and routed experts, and the
dense MLPs (the release's list does not name the dense MLPs; DeepSeek-V3-style FP8 releases
quantize them, so the bench does, which makes them cheaper to read, not dearer). The other
matrices (embedding, `lm_head`, KDA projections, the indexer's `weights_proj`) are bf16, norms
bf16, the remaining vectors fp32. Names are the text-only `model.*` layout with per-expert
`gate_proj` / `up_proj` / `down_proj`. Values are drawn as `tests/test_glm5_next.py` draws its
tiny model's (norms near 1, matrices N(0, 1/fan_in)), one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import zlib
from pathlib import Path
from typing import Any, Iterator

E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
_MLA_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")


def glm_real_config(path: Path, layers: int):
    """The release config at `path` cut to its first `layers` layers, without MTP."""
    from ..models.glm5.config import glm5_config_from_dict
    cfg = glm5_config_from_dict(json.loads(path.read_text()))
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be 1..{cfg.num_hidden_layers} for glm53-flash, got {layers}")
    n = layers
    return dataclasses.replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                               mlp_layer_types=cfg.mlp_layer_types[:n], indexer_types=cfg.indexer_types[:n])


def stored_fp8(name: str, cfg) -> bool:
    """Whether the bench stores the model tensor `name` (kvfold's names) in block FP8."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return False
    i = int(parts[2])
    if ".mlp." in name and name.endswith(("_proj.weight", "gate_up_proj", "down_proj")):
        return True  # dense MLP, shared expert and routed experts
    return cfg.layer_types[i] == "indexed_attention" and any(name.endswith(f".self_attn.{a}.weight")
                                                              for a in _MLA_FP8)


def glm_write(dst: Path, cfg, seed: int, max_shard_bytes: int) -> Path:
    """Write the random checkpoint of `cfg` into the empty directory `dst`, one tensor at a time
    (the parts written so far are removed on any failure), with its config.json."""
    from ..models.deepseek_v4.convert import ShardWriter
    dst.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(dst, max_shard_bytes)
    try:
        for key, value in glm_tensors(cfg, seed):
            writer.add(key, value)
        writer.finish()
    except BaseException:
        for part in dst.glob(".part-*.safetensors"):
            part.unlink()
        raise
    config = dict(cfg.to_hf_dict(), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def glm_tensors(cfg, seed: int) -> Iterator[tuple[str, Any]]:
    """(checkpoint key, stored tensor) of every tensor of a random `cfg` model, one at a time."""
    import torch

    from ..models.glm5.model import Glm5Model
    shapes = Glm5Model(cfg, dtype=torch.float32, device="meta").state_dict(keep_vars=True)
    for name, t in sorted(shapes.items()):
        for key, shape in _checkpoint_keys(name, tuple(t.shape)):
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
            value = _value(name, shape, g)
            if stored_fp8(name, cfg):
                q, scale = quantize_fp8_blocks(value, FP8_BLOCK)
                yield key, q
                yield key + "_scale_inv", scale
            elif value.dim() == 2 or name.endswith("norm.weight"):
                yield key, value.to(torch.bfloat16)
            else:
                yield key, value


def _checkpoint_keys(name: str, shape: tuple[int, ...]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors that fill model tensor `name`: per-expert halves of stacked experts,
    `.weight`-suffixed conv taps, else the name itself."""
    if name.endswith(".experts.gate_up_proj"):
        stem, (e, two_i, h) = name[:-len("gate_up_proj")], shape
        for j in range(e):
            yield f"{stem}{j}.gate_proj.weight", (two_i // 2, h)
            yield f"{stem}{j}.up_proj.weight", (two_i // 2, h)
    elif name.endswith(".experts.down_proj"):
        stem, (e, h, i) = name[:-len("down_proj")], shape
        for j in range(e):
            yield f"{stem}{j}.down_proj.weight", (h, i)
    elif name.endswith("_conv1d"):
        yield name + ".weight", shape
    else:
        yield name, shape


def _value(name: str, shape: tuple[int, ...], g):
    import torch
    r = torch.randn(shape, generator=g)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1 + 0.1 * r
    if "embed_tokens" in name:
        return r
    if name.endswith(("A_log", "dt_bias")):
        return 0.5 * r
    if name.endswith("_hc.scale"):
        return 1 + 0.2 * r
    if name.endswith(("_hc.base", "bias")):
        return 0.1 * r
    if "conv1d" in name:
        return 0.4 * r
    return r / math.sqrt(shape[-1]) if len(shape) >= 2 else 0.1 * r


def quantize_fp8_blocks(w, block: tuple[int, int]):
    """(float8_e4m3fn codes, fp32 scale_inv [ceil(R/br), ceil(C/bc)]): per block scale_inv = amax / 448
    (1 for an all-zero block) and codes = e4m3(w / scale_inv), edge blocks cropped."""
    import torch
    (r, c), (br, bc) = w.shape, block
    nr, nc = -(-r // br), -(-c // bc)
    padded = torch.nn.functional.pad(w.float(), (0, nc * bc - c, 0, nr * br - r))
    tiles = padded.view(nr, br, nc, bc)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:r, :c].contiguous(), scale.contiguous()

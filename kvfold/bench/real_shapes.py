"""Bench checkpoints at a released model's real widths, truncated to a few layers (issue 42).

`glm53-flash` (GLM-5.3-Flash) is written by real_shapes_glm.py; the rest of this docstring is V4's.

`v4-flash`: DeepSeek-V4-Flash's release config (kvfold/assets/configs/deepseek_v4_flash.json):
hidden 4096, 64 heads of 512, 256 routed experts of 2048 (top 6) + 1 shared, the 129,280-token
vocabulary, its embedding and head, cut to its first N layers (default 4: two sliding-window
layers, one CSA and one HCA; three hash-routed MoE layers and one score-routed), without the MTP
block. The toy configs (configs.py) fit in a cache; these do not, so their weights stream from
DRAM, as a real model's do.

The checkpoint is random and written in the release's layout and formats, one tensor at a time,
never holding the model (`convert.write_official`): FP8 128x128 blocks where the release has
them, bf16 embedding, head, norms and the other unquantized weights, fp32 where the release keeps
fp32. Float weights are drawn as `tiny.init_random_` draws them (N(0, 1/fan_in), norms near 1)
and quantized. Routed experts, 97% of the bytes, are drawn directly as FP4: uniform e2m1 codes
under a per-block power-of-two scale whose spread matches N(0, 1/fan_in), since drawing 26 G
normals and rounding them would take many minutes. It runs with `weights="quantized"`: read as
stored, about the checkpoint's bytes in memory. Cached like the other bench checkpoints, keyed
by the config, the seed and `GENERATOR_VERSION`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from ..paths import cache_root
from .configs import cached_build
from .real_shapes_glm import glm_real_config, glm_write

GENERATOR_VERSION = 1
RELEASES = {"v4-flash": "deepseek_v4_flash.json", "glm53-flash": "glm5_3_flash.json"}
DEFAULT_LAYERS = {"v4-flash": 4, "glm53-flash": 4}
SHARD_BYTES = 2 << 30  # the writer holds at most one shard (plus the tensor being made)


def real_config(name: str, layers: int | None = None):
    """The release config of `name` cut to its first `layers` layers (default DEFAULT_LAYERS), no MTP."""
    from ..models.deepseek_v4.config import config_from_dict
    path = Path(__file__).resolve().parents[1] / "assets" / "configs" / RELEASES[name]
    n = DEFAULT_LAYERS[name] if layers is None else layers
    if name == "glm53-flash":
        return glm_real_config(path, n)
    cfg = config_from_dict(json.loads(path.read_text()))
    if not 1 <= n <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be 1..{cfg.num_hidden_layers} for {name}, got {n}")
    return dataclasses.replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                               compress_ratios=cfg.compress_ratios[:n], mlp_layer_types=cfg.mlp_layer_types[:n],
                               num_nextn_predict_layers=0)


def checkpoint_dir(name: str, layers: int | None, cache_dir: str | Path | None = None) -> Path:
    n = DEFAULT_LAYERS[name] if layers is None else layers
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / f"bench-{name}-{n}l"


def ensure_real_checkpoint(name: str, layers: int | None = None, cache_dir: str | Path | None = None,
                           seed: int = 0, log: Callable[[str], None] | None = None) -> Path:
    """Directory of the random real-shape checkpoint (release layout and formats), written on first
    use and reused while its key matches."""
    cfg = real_config(name, layers)
    target = checkpoint_dir(name, cfg.num_hidden_layers, cache_dir)
    key = hashlib.sha256(json.dumps({"config": name, "fingerprint": cfg.fingerprint(), "seed": seed,
                                     "generator": GENERATOR_VERSION}, sort_keys=True).encode()).hexdigest()[:16]
    meta = {"key": key, "config": name, "layers": cfg.num_hidden_layers, "seed": seed,
            "generator": GENERATOR_VERSION, "fingerprint": cfg.fingerprint(), "layout": "official"}

    def write(tmp: Path) -> None:
        from ..models.deepseek_v4.convert import write_official
        if log:
            log(f"writing random {name} checkpoint ({cfg.num_hidden_layers} layers, seed {seed}, release formats) "
                f"to {target}")
        if name == "glm53-flash":
            glm_write(tmp, cfg, seed, SHARD_BYTES)
        else:
            write_official(tmp, cfg, random_tensors(cfg, seed), SHARD_BYTES)
    return cached_build(target, meta, write)


def random_tensors(cfg, seed: int) -> Iterator[tuple[str, str, Any]]:
    """(official key, parameter name, value) of every tensor of a random `cfg` model, one at a time:
    a float tensor, or (FP4 codes, e8m0 exponents) for a routed expert's matrix."""
    import torch

    from ..models.deepseek_v4.model import Dsv4Model
    from ..models.deepseek_v4.names import official_quant_kind, to_official_names
    from ..numerics.quant_formats import FP4
    shapes = Dsv4Model(cfg, dtype=torch.float32, device="meta").state_dict(keep_vars=True)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    for name, t in sorted(shapes.items()):
        for key, expert, part in to_official_names(name, cfg.n_routed_experts):
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
            if expert is None:
                yield key, name, _value(name, tuple(t.shape), t.dtype, cfg, g)
                continue
            shape = (hidden, inter) if part == "w2" else (inter, hidden)
            if official_quant_kind(name) == FP4:
                yield key, name, _fp4(shape, g)
            else:
                yield key, name, torch.randn(shape, generator=g) / math.sqrt(shape[1])


def _value(name: str, shape: tuple[int, ...], dtype, cfg, g):
    """One non-expert tensor, drawn as tiny.init_random_ draws it."""
    import torch
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        return torch.argsort(torch.rand(shape[0], cfg.n_routed_experts, generator=g), dim=1)[:, :shape[1]].to(dtype)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if leaf in ("sinks", "position_bias", "base", "hc_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if leaf in ("scale", "hc_scale"):
        return 1 + 0.2 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])


# e2m1 magnitudes (codes 0..7); a uniform code's RMS is sqrt(mean of their squares)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_RMS = math.sqrt(sum(v * v for v in _E2M1) / len(_E2M1))


def _fp4(shape: tuple[int, int], g):
    """(packed codes [R, C/2] int8, e8m0 exponents [R, C/32] uint8): uniform codes, and per 1x32
    block a power-of-two scale at the exponent that gives an RMS of 1/sqrt(C), give or take one."""
    import torch

    from ..numerics.quant import E8M0_BIAS, FP4_BLOCK
    rows, cols = shape
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    k = round(math.log2(1 / (_E2M1_RMS * math.sqrt(cols))))
    exps = torch.randint(k - 1, k + 2, (rows, cols // FP4_BLOCK), generator=g, dtype=torch.int32) + E8M0_BIAS
    return codes, exps.to(torch.uint8)

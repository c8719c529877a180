"""`kvfold plan`: size a model on paper, per tensor-parallel rank, from its config.json alone (with
`--gpu-memory-gib G --host-memory-gib H`: placed on one accelerator plus host memory, plan_placement.py).

The model is built on the meta device (shapes, no memory). Per rank:
* resident weight bytes: every tensor at its share under TP (each family's sharding.py, the rules
  `load_model(..., tp=N)` loads by), in the chosen weight format;
* state bytes per sequence of `max_seq_len` tokens (the model's own `state_layout`, the engine's
  admission formula; replicated under TP, except GLM-5.3's KDA state, split with its heads);
* how many such sequences fit in the device memory left after the weights.

Weight formats, as the releases store them: `bf16` every matrix in 2 bytes; `fp8` the projection
and expert matrices in float8 with one scale per 128x128 block (embedding, lm_head, norms, router,
mHC, in DeepSeek-V4 the compressors' and the indexer's projections but its q_b_proj, and in GLM-5.3
the KDA projections stay bf16 or fp32 as stored); `fp4` the routed experts in
e2m1 with one e8m0 scale per 32 values (0.53125 bytes each), the rest as fp8.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .parallel import TensorParallel, skips_shared_expert

WEIGHT_FORMATS = ("bf16", "fp8", "fp4")
_FP8 = 1 + 4 / (128 * 128)  # a byte per value and a 4-byte scale per block (DeepSeek-V4's ue8m0: 1 byte)
_FP4 = 0.5 + 1 / 32


@dataclass
class RankPlan:
    rank: int
    weight_bytes: int
    state_bytes: int  # one sequence of max_seq_len tokens
    fits: int  # sequences of max_seq_len that fit beside the weights


def _meta_model(config: dict):
    from .models.glm5.config import is_glm5_config
    if is_glm5_config(config):
        from .models.glm5.config import glm5_config_from_dict
        from .models.glm5.model import Glm5Model
        return "glm5_next", Glm5Model(glm5_config_from_dict(config), dtype=torch.bfloat16, device="meta")
    from .models.deepseek_v4.config import config_from_dict
    from .models.deepseek_v4.model import Dsv4Model
    return "deepseek_v4", Dsv4Model(config_from_dict(config), dtype=torch.bfloat16, device="meta")


def _glm_share(name: str, cfg, r: TensorParallel) -> float:
    from .models.glm5.sharding import tp_slice
    if skips_shared_expert(name, r):
        return 0.0
    return 1.0 / r.size if tp_slice(name, cfg, r) is not None else 1.0


def _v4_share(name: str, cfg, r: TensorParallel) -> float:
    from .models.deepseek_v4.sharding import tp_slice
    if skips_shared_expert(name, r):
        return 0.0
    return 1.0 / r.size if tp_slice(name, cfg, r) is not None else 1.0


def _bytes_per_value(family: str, name: str, param: torch.Tensor, quantizable: set[str], fmt: str) -> float:
    if name not in quantizable or fmt == "bf16":
        return 2.0 if param.dtype == torch.bfloat16 else param.element_size()
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        return 2.0  # bf16 in both releases, though their modules can hold quantized weights
    if family == "deepseek_v4":
        from .models.deepseek_v4.names import official_quant_kind
        if official_quant_kind(name) is None:
            return 2.0  # the compressors' and the indexer's projections: bf16 in the release (docs/checkpoints.md)
    if family == "glm5_next" and ".self_attn." in name and not any(
            s in name for s in (".q_a_proj.", ".q_b_proj.", ".kv_a_proj", ".kv_b_proj.", ".o_proj.", ".indexer.")):
        return 2.0  # KDA projections stay bf16 in the release
    if fmt == "fp4" and ".mlp.experts." in name:
        return _FP4
    return _FP8


def _quantizable(model) -> set[str]:
    """Full names of the tensors whose modules declare them quantizable (what the release quantizes)."""
    return {f"{mod_name}.{attr}" if mod_name else attr for mod_name, mod in model.named_modules()
            for attr in getattr(mod, "quantizable", ())}


def weight_tensors(config: dict, weights: str = "bf16") -> tuple[str, object, list[tuple[str, torch.Tensor, float]]]:
    """(family, meta model, [(name, meta tensor, bytes per value in `weights`)]) of every parameter and
    buffer, unsharded: the accounting `plan` does at tp=1, for callers that group it otherwise
    (placement across one accelerator and host memory, plan_placement.py)."""
    if weights not in WEIGHT_FORMATS:
        raise ConfigError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    family, model = _meta_model(config)
    quantizable = _quantizable(model)
    params = list(model.named_parameters()) + list(model.named_buffers())
    return family, model, [(n, p, _bytes_per_value(family, n, p, quantizable, weights)) for n, p in params]


def plan(config: dict, tp: int = 1, weights: str = "bf16", kv_dtype: str | None = None, max_seq_len: int = 65536,
         device_memory_bytes: int = 80 * 2 ** 30, max_rewind: int = 0) -> tuple[str, int, list[RankPlan]]:
    """(family, total parameters, one RankPlan per distinct rank: rank 0 and, when it differs, rank 1)."""
    if weights not in WEIGHT_FORMATS:
        raise ConfigError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    family, model = _meta_model(config)
    cfg = model.config
    from .parallel import check_divides
    if family == "deepseek_v4":
        from .models.deepseek_v4.sharding import tp_counts
        counts, share = tp_counts(cfg), _v4_share
    else:
        from .models.glm5.sharding import tp_counts
        counts, share = tp_counts(cfg), _glm_share
    check_divides(counts, tp)
    quantizable = _quantizable(model)
    params = list(model.named_parameters()) + list(model.named_buffers())
    fixed, pools = model.state_layout(max_rewind, kv_dtype)
    per_seq_pools = sum(-(-max_seq_len // r) * row for r, row in pools)
    out = []
    for rank in sorted({0, min(1, tp - 1)}):
        r = TensorParallel(rank, tp)  # its shares only: no process group is needed
        w = sum(p.numel() * share(n, cfg, r) * _bytes_per_value(family, n, p, quantizable, weights) for n, p in params)
        state_fixed = fixed // tp if family == "glm5_next" else fixed  # GLM-5.3's fixed state is its KDA state
        state = state_fixed + per_seq_pools
        fits = max(0, (device_memory_bytes - int(w)) // state) if state else 0
        out.append(RankPlan(rank, int(math.ceil(w)), state, fits))
    return family, sum(p.numel() for _, p in model.named_parameters()), out


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def run_plan(args) -> int:
    """The per-rank table (`kvfold plan` without --gpu-memory-gib: plan_placement.run_plan_command)."""
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    family, total, ranks = plan(config, tp=args.tp, weights=args.weights, kv_dtype=args.kv_dtype,
                                max_seq_len=args.max_seq_len, device_memory_bytes=int(args.device_memory_gib * 2 ** 30),
                                max_rewind=args.max_rewind)
    print(f"{family}: {total / 1e9:.1f}B parameters, tp={args.tp}, weights {args.weights}, kv "
          f"{args.kv_dtype or 'model dtype'}, sequences of {args.max_seq_len} tokens, "
          f"{args.device_memory_gib:g} GiB per device")
    print("| rank | weights | state per sequence | sequences that fit |")
    print("|---|---|---|---|")
    for rp in ranks:
        label = "0" if rp.rank == 0 else f"1..{args.tp - 1}"
        print(f"| {label} | {_gib(rp.weight_bytes)} | {_gib(rp.state_bytes)} | {rp.fits} |")
    if args.max_running is not None:
        need = max(rp.weight_bytes + args.max_running * rp.state_bytes for rp in ranks)
        print(f"max-running {args.max_running}: {_gib(need)} per device")
    return 0


def add_plan_parser(sub):
    from .argtypes import pos_int
    p = sub.add_parser("plan", help="size a model per tensor-parallel rank from its config.json (no weights read)")
    p.add_argument("--config", required=True, help="a checkpoint's config.json")
    p.add_argument("--tp", type=pos_int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16", help="weight format (default bf16)")
    p.add_argument("--kv-dtype", choices=("fp8",), default=None, help="KV rows in FP8")
    p.add_argument("--max-seq-len", type=pos_int, default=65536, help="tokens per sequence (default 65536)")
    p.add_argument("--max-running", type=pos_int, default=None, help="also print the bytes of this many sequences "
                   "(with --gpu-memory-gib: the sequences the placement must hold, default 1)")
    p.add_argument("--max-rewind", type=int, default=0, help="speculative draft length the states allow (default 0)")
    p.add_argument("--device-memory-gib", type=float, default=80.0, help="memory per device (default 80 GiB)")
    return p

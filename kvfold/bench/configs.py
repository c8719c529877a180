"""Benchmark model configurations and their random checkpoints.

`bench` is a small model with every V4 layer kind at production-like head shapes (long contexts
are affordable on a CPU); `medium` is weight-dominated (~0.9 GB fp32, 16 experts top-2) for
comparing decode with the memory-bandwidth bound; `tiny-bench` is a test-only micro model.

Checkpoints are written once per (config, seed, generator version) into a cache directory and
reused. Only torch-free code runs at import time.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

from ..paths import cache_root

# Bump when the way random weights are made changes: cached checkpoints are then rebuilt.
GENERATOR_VERSION = 2

PUBLIC_CONFIGS = ("bench", "medium")
REAL_CONFIGS = ("v4-flash", "glm53-flash")  # a release's widths, cut to a few layers (real_shapes.py)
TEST_CONFIGS = ("tiny-bench",)


def _bench_config():
    from ..models.deepseek_v4.config import CSA, HCA, SLIDING, YarnParams
    from ..models.deepseek_v4.tiny import tiny_config
    return tiny_config(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=128,
        layer_types=(SLIDING, CSA, HCA, CSA), compress_ratios=(0, 4, 128, 4),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        index_n_heads=4, index_head_dim=64, index_topk=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_yarn=YarnParams(factor=16, original_max_position_embeddings=65536),
        max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    )


def _medium_config():
    from ..models.deepseek_v4.config import CSA, HCA, SLIDING, YarnParams
    from ..models.deepseek_v4.tiny import tiny_config
    return tiny_config(
        vocab_size=16384, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=256, sliding_window=128,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA), compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4),
        mlp_layer_types=("hash_moe",) + ("moe",) * 7,
        index_n_heads=8, index_head_dim=64, index_topk=64,
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=384,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_yarn=YarnParams(factor=16, original_max_position_embeddings=65536),
        max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    )


def _tiny_bench_config():
    from ..models.deepseek_v4.config import CSA, HCA, SLIDING, YarnParams
    from ..models.deepseek_v4.tiny import tiny_config
    return tiny_config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=(SLIDING, CSA, HCA, CSA), compress_ratios=(0, 4, 16, 4),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        index_n_heads=2, index_head_dim=16, index_topk=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        compress_yarn=YarnParams(factor=16, original_max_position_embeddings=4096),
        max_position_embeddings=65536, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    )


_BUILDERS: dict[str, Callable[[], Any]] = {
    "bench": _bench_config, "medium": _medium_config, "tiny-bench": _tiny_bench_config,
}

# Prompt length of the kvfold-vs-transformers logits check: past index_topk * 4 so CSA's top-k
# really selects, short enough that the indexer's top-k margins stay far above fp32 noise.
SANITY_TOKENS = {"bench": 320, "medium": 320, "tiny-bench": 24}


def config_names(include_test: bool = True) -> tuple[str, ...]:
    return PUBLIC_CONFIGS + REAL_CONFIGS + (TEST_CONFIGS if include_test else ())


def build_config(name: str):
    """The `Dsv4Config` of a named benchmark configuration (a real-shape one's: real_shapes.py)."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ValueError(f"unknown bench config {name!r}; choose one of {', '.join(PUBLIC_CONFIGS)}") from None


def default_cache_root() -> Path:
    return cache_root()


def checkpoint_key(name: str, seed: int) -> str:
    cfg = build_config(name)
    blob = json.dumps({"config": name, "fingerprint": cfg.fingerprint(), "seed": seed,
                       "generator": GENERATOR_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _pair_indexer_heads_(model) -> None:
    """Make indexer head h + n/2 the negation of head h (query projection rows).

    Index score = sum_h w_h * ReLU(q_h . k). With a few independent random heads, q_h . k <= 0 for
    all heads in ~1/2^n of the (query, entry) pairs, which then score exactly 0; exact ties at the
    top-k cut are then common, and kvfold (ties -> lower index) and torch.topk (unspecified) pick
    different entries: logits that disagree for no fault of either. Paired heads see +/- the same
    projection, so a score is 0 only when q . k == 0 exactly. Same trick as tests/hf_oracle.py.
    """
    import torch
    cfg = model.config
    n, d = cfg.index_n_heads, cfg.index_head_dim
    half = n // 2
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("indexer.q_b_proj.weight"):
                w = p.view(n, d, -1)
                w[half:2 * half] = -w[:half]


def cached_build(target: Path, meta: dict[str, Any], write: Callable[[Path], None],
                 matches: Callable[[dict], bool] | None = None) -> Path:
    """`target`, reused when its bench-meta.json `matches` (default: the same "key" as `meta`);
    else `write(tmp)` fills a fresh temporary directory beside it, `meta` is written there, and
    it replaces `target` in one rename, so a reader never sees a half-written checkpoint."""
    try:
        made = json.loads((target / "bench-meta.json").read_text())
        if (matches or (lambda m: m.get("key") == meta["key"]))(made):
            return target
    except (OSError, json.JSONDecodeError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    (tmp / "bench-meta.json").write_text(json.dumps(meta, indent=2))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def ensure_checkpoint(name: str, cache_dir: str | Path | None = None, seed: int = 0,
                      log: Callable[[str], None] | None = None) -> Path:
    """Directory of the random checkpoint of config `name` (config.json + model.safetensors in the
    transformers layout), written on first use and reused while its key matches."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"bench-{name}"
    cfg = build_config(name)
    meta = {"key": checkpoint_key(name, seed), "config": name, "seed": seed, "generator": GENERATOR_VERSION,
            "fingerprint": cfg.fingerprint()}

    def write(tmp: Path) -> None:
        import torch
        from ..models.deepseek_v4.checkpoint import save_checkpoint
        from ..models.deepseek_v4.model import Dsv4Model
        from ..models.deepseek_v4.tiny import init_random_
        if log:
            log(f"writing random checkpoint {name!r} (seed {seed}) to {target}")
        model = Dsv4Model(cfg, dtype=torch.float32)
        init_random_(model, seed)
        _pair_indexer_heads_(model)
        save_checkpoint(model, tmp)
        meta["parameters"] = model.num_parameters()

    def complete(made: dict) -> bool:
        return made.get("key") == meta["key"] and (target / "model.safetensors").exists() \
            and (target / "config.json").exists()
    return cached_build(target, meta, write, complete)


_OFFICIAL_FLOATS = "bfloat16"  # the unquantized matrices of the official checkpoint, as the release


def ensure_official_checkpoint(checkpoint: Path, log: Callable[[str], None] | None = None) -> Path:
    """`checkpoint` converted by `kvfold convert --to official --floats bfloat16` (the release's
    formats: FP8 / FP4, and bf16 for its unquantized matrices) into `<checkpoint>-official`, written
    on first use and reused while it was made from this checkpoint in these formats."""
    checkpoint = Path(checkpoint)
    target = checkpoint.with_name(checkpoint.name + "-official")
    meta = dict(json.loads((checkpoint / "bench-meta.json").read_text()), layout="official", floats=_OFFICIAL_FLOATS)

    def write(tmp: Path) -> None:
        import torch

        from ..models.deepseek_v4.convert import convert
        if log:
            log(f"converting {checkpoint} to the official layout (FP8 / FP4, bf16 floats) in {target}")
        convert(checkpoint, tmp, "official", floats=torch.bfloat16)
    return cached_build(target, meta, write,
                        lambda made: made.get("key") == meta["key"] and made.get("floats") == _OFFICIAL_FLOATS)


_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_tensor_sizes(directory: str | Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """{name: (shape, nbytes)} of every tensor in the checkpoint, read from the safetensors
    headers only (nothing is loaded)."""
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            start, end = v["data_offsets"]
            out[k] = (tuple(v["shape"]), end - start)
    return out


def decode_bytes_per_token(cfg, tensors: dict[str, tuple[tuple[int, ...], int]], context: int,
                           state_elem_bytes: int = 4) -> dict[str, float]:
    """Bytes one decode token must read at `context` tokens of history, {term: bytes} plus the
    sums "attention", "weights_total", "state" and "total": every weight except the embedding (one
    row) and the routed experts (only the top-k of E), plus the state the attention reads in
    `state_elem_bytes`-byte values. The terms and their formulas: decode_bytes.decode_terms."""
    from .decode_bytes import decode_terms, totals
    return totals(decode_terms(cfg, tensors, context, state_elem_bytes))

"""`kvfold.load_model`: a checkpoint directory or a built-in name -> a ready model of its family, with its tokenizer.

The family comes from the directory's `config.json` (`model_type` / `architectures`): the first
entry of FAMILIES whose test accepts it. DeepSeek-V4 is last and takes the rest, including the
official release layout, whose config lives in `inference/config.json`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from ..errors import ConfigError
from .deepseek_v4.checkpoint import WEIGHT_RESIDENCIES
from .deepseek_v4.loader import load_dsv4, load_tiny
from .glm5.checkpoint import load_glm5
from .glm5.config import is_glm5_config


class Family(NamedTuple):
    name: str
    accepts: Callable[[dict[str, Any]], bool]  # the parsed config.json
    load: Callable[..., Any]  # (directory, device=, dtype=, numerics=, weights=) -> model


FAMILIES = (Family("glm5_next", is_glm5_config, load_glm5), Family("deepseek_v4", lambda d: True, load_dsv4))


def _config_json(directory: Path) -> dict[str, Any]:
    f = directory / "config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None


def family_of(directory: str | Path) -> Family:
    d = _config_json(Path(directory))
    return next(f for f in FAMILIES if f.accepts(d))


TINY_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny"  # written by tools/train_tiny.py
# Built-in model names: "tiny" is a small DeepSeek-V4 trained on Python's documentation (shipped in
# TINY_DIR); "tiny-random" is the random one with a byte-level tokenizer that tests and benches use.
BUILT_IN = ("tiny", "tiny-random")


def checkpoint_dir(name: str | Path) -> Path | None:
    """The directory a model name reads: TINY_DIR for "tiny", None for "tiny-random" (no files)."""
    if str(name) == "tiny-random":
        return None
    return TINY_DIR if str(name) == "tiny" else Path(name)


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         numerics: str = "hf", weights: str = "dequant", tp: int = 1, dot: str = "fp32"):
    """`weights`: "dequant" decodes FP8 / FP4 checkpoint weights into `dtype` at load; "quantized" keeps
    them in memory as stored (float8_e4m3fn / packed FP4 bytes + e8m0 scales) and decodes each one for
    the matmul that reads it (routed experts: only the experts a batch uses). Logits are bit-identical
    either way. Float checkpoint tensors (and "tiny") load as floats either way: nothing is quantized.
    `tp` > 1: this process's shard of the checkpoint over the current torch.distributed group of
    `tp` ranks (kvfold/parallel; what each rank holds: each family's sharding.py). `dot`: "fp32", or
    "bf16" for weights="quantized" on the CPU (`CausalLM.set_dot`)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if numerics not in ("hf", "reference"):
        raise ConfigError(f"numerics must be 'hf' or 'reference', got {numerics!r}")
    if weights not in WEIGHT_RESIDENCIES:
        raise ConfigError(f"weights must be one of {WEIGHT_RESIDENCIES}, got {weights!r}")
    if dot not in ("fp32", "bf16"):
        raise ConfigError(f"dot must be 'fp32' or 'bf16', got {dot!r}")
    if dot == "bf16" and weights != "quantized":
        raise ConfigError("dot='bf16' is the dot of weights held as stored: load with weights='quantized'")
    directory = checkpoint_dir(path)
    if tp != 1 and directory is None:
        raise ConfigError(f"tp={tp}: tensor parallelism shards checkpoint directories (the built-in 'tiny' "
                          f"included); {path} is not one")
    if directory is None:
        model = load_tiny(device=device, dtype=dtype, numerics=numerics)
    else:
        kw = {"tp": tp} if tp != 1 else {}
        model = family_of(directory).load(directory, device=device, dtype=dtype, numerics=numerics, weights=weights,
                                          **kw)
    if dot != "fp32":
        model.set_dot(dot)
    return model

"""Quantized checkpoint tensors: which stored tensor is a weight's block scale, what a quantized
tensor's logical shape is, and how it is decoded into a parameter. (Which weights a release stores
quantized is its model family's business: models/deepseek_v4/names.py.)

Stored formats recognised (by the weight's dtype, once a scale companion exists):
* FP8: `float8_e4m3fn` weight [.., R, C] + scale [.., ceil(R/br), ceil(C/bc)] (block br x bc, default
  128 x 128 or `quantization_config.weight_block_size`);
* FP4: packed `int8` / `uint8` / `float4_e2m1fn_x2` weight [.., R, C/2] + scale [.., R, ceil(C/32)].
Scale companions: `X.scale` (official), `X.weight_scale_inv` (transformers) for `X.weight`, and
`P_scale_inv` for a stacked-expert parameter `P` (transformers' fused FP8 experts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant import FP4_BLOCK, FP8_BLOCK, dequant_fp4_into, dequant_fp8_into

FP8, FP4 = "fp8", "fp4"
BF16 = "bf16"  # a float tensor held as the release stores it (`QuantizedWeight`), not quantized
_FP8_STORED = {"F8_E4M3", "float8_e4m3fn"}
_FP4_STORED = {"I8", "U8", "F4", "int8", "uint8", "float4_e2m1fn_x2"}


@dataclass(frozen=True)
class QuantSettings:
    fp8_block: tuple[int, int] = FP8_BLOCK
    fp4_block: int = FP4_BLOCK
    expert_dtype: str | None = None  # "fp4" / "fp8" / None (as declared by the config, informational)

    @classmethod
    def from_config_dict(cls, d: dict) -> "QuantSettings":
        q = d.get("quantization_config") or {}
        block = q.get("weight_block_size") or d.get("weight_block_size") or FP8_BLOCK
        if len(block) != 2 or any(int(b) < 1 for b in block):
            raise ValueError(f"weight_block_size must be two positive ints, got {block}")
        fmt = q.get("fmt")
        if fmt not in (None, "e4m3"):
            raise ValueError(f"quantization_config fmt {fmt!r} is not supported (only e4m3)")
        scale_fmt = q.get("scale_fmt", d.get("scale_fmt"))
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"scale_fmt {scale_fmt!r} is not supported (ue8m0, or float scales)")
        expert = q.get("expert_dtype", d.get("expert_dtype"))
        return cls((int(block[0]), int(block[1])), FP4_BLOCK, expert)


def scale_key_of(key: str, keys) -> str | None:
    """The key of `key`'s block-scale companion among `keys`, if it has one."""
    cands = []
    if key.endswith(".weight"):
        stem = key[: -len(".weight")]
        cands += [stem + ".scale", key + "_scale_inv"]
    else:
        cands += [key + "_scale_inv"]
    for c in cands:
        if c in keys:
            return c
    return None


def scale_keys(keys) -> dict[str, str]:
    """{weight key: scale key} for every weight in `keys` that has a scale companion."""
    keys = set(keys)
    out = {}
    for k in keys:
        s = scale_key_of(k, keys)
        if s is not None:
            out[k] = s
    return out


def stored_format(dtype: str | torch.dtype) -> str | None:
    """FP8 / FP4 for a quantized stored dtype (a safetensors dtype string or a torch dtype), else None."""
    name = str(dtype).removeprefix("torch.")
    if name in _FP8_STORED:
        return FP8
    if name in _FP4_STORED:
        return FP4
    return None


def logical_shape(stored_shape, stored_dtype: str, fmt: str | None) -> tuple[int, ...]:
    """The dequantized shape of a stored tensor; safetensors already reports F4 in fp4 elements."""
    shape = tuple(int(s) for s in stored_shape)
    if fmt == FP4 and str(stored_dtype) not in ("F4", "float4_e2m1fn_x2"):
        return shape[:-1] + (2 * shape[-1],)
    return shape


def expected_scale_shape(shape, fmt: str, settings: QuantSettings) -> tuple[int, ...]:
    *lead, r, c = shape
    if fmt == FP8:
        br, bc = settings.fp8_block
        return (*lead, math.ceil(r / br), math.ceil(c / bc))
    return (*lead, r, math.ceil(c / settings.fp4_block))


@torch.no_grad()
def dequant_into(dest: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, settings: QuantSettings) -> None:
    """Decode a stored quantized tensor and its scale straight into the parameter slice `dest`."""
    fmt = stored_format(weight.dtype)
    weight, scale = weight.to(dest.device), scale.to(dest.device)  # the small quantized bytes travel, not floats
    if fmt == FP8:
        dequant_fp8_into(dest, weight, scale, settings.fp8_block)
    elif fmt == FP4:
        dequant_fp4_into(dest, weight, scale, settings.fp4_block)
    else:
        # a float weight with a scale (e.g. an upcast copy): multiply per block like FP8
        dequant_fp8_into(dest, weight, scale, settings.fp8_block)

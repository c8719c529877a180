"""Interleaved partial RoPE on the trailing dims, with the YaRN frequency blend V4 uses on
compressed layers (no mscale: cos/sin are never scaled)."""
from __future__ import annotations

import math

import torch

from .backend import Backend, KernelError
from .native_abi import RopeArgs
from .rows import unary


def rope_inv_freq(rope_dim: int, theta: float, yarn=None) -> torch.Tensor:
    """Inverse frequencies f_i = theta^(-2i/rope_dim), optionally YaRN-blended, fp32 [rope_dim/2]."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return inv

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 keeps the original frequency (extrapolate), ramp 1 divides it by the factor (interpolate)
    return (inv / yarn.factor) * ramp + inv * (1 - ramp)


class RopeTable:
    """cos/sin for given positions, computed in fp32 from a fixed inv_freq (exact for any position,
    so no table needs to grow with the context)."""

    def __init__(self, rope_dim: int, theta: float, yarn=None, device: torch.device | str = "cpu"):
        self.rope_dim = rope_dim
        self.inv_freq = rope_inv_freq(rope_dim, theta, yarn).to(device)

    def cos_sin(self, ops: Backend, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin of p * f for every position: `unary`'s, so that in batch-invariant mode a
        row's values do not depend on the other positions of the call (a vectorised loop
        computes its tail with other code than its body)."""
        freqs = torch.outer(positions.to(self.inv_freq.device, torch.float32), self.inv_freq)
        return unary(ops, "cos", freqs), unary(ops, "sin", freqs)


def apply_rope(ops: Backend, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
               ) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] dims of x as interleaved (even, odd) pairs.

    cos/sin are [T, rope_dim/2]; x is [T, ..., D] and they broadcast over the middle dims.
    Each pair is one complex number multiplied by e^{i p f} (a few fused kernels instead of a
    dozen small ones); `inverse` uses the conjugate (de-rotation of V4's attention output).
    """
    half = cos.shape[-1]
    rd = 2 * half
    c = ops.rope
    if c.rows is None and c.native is None:
        return _torch_rope(x, cos, sin, inverse, half)
    if x.dim() < 2 or cos.dim() != 2 or x.shape[0] != cos.shape[0] or x.shape[-1] < rd:
        raise KernelError(f"rope kernels take x [T, ..., D >= {rd}] and cos/sin [T, {half}], "
                          f"got {tuple(x.shape)} and {tuple(cos.shape)}")
    if c.rows is not None:  # batch-invariant mode off the CPU: per row in Triton
        return c.rows.rope(x, cos, sin, inverse)
    if x.dtype != torch.float32 or not x.is_cpu:
        raise KernelError(f"kv_rope reads fp32 CPU rows, got {x.dtype} on {x.device}")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    t, d = x.shape[0], x.shape[-1]
    c.native.kv_rope(RopeArgs(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t,
                              x.numel() // (t * d) if t * d else 0, d, half, int(inverse)))
    return out


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, half: int) -> torch.Tensor:
    rd = 2 * half
    if x.dtype == torch.float32:  # rotate the pairs in place in a copy: no cat, no casts
        out = x.clone() if x.is_contiguous() else x.contiguous()
        pairs = torch.view_as_complex(out.view(*x.shape[:-1], x.shape[-1] // 2, 2))[..., -half:]
        pairs.mul_(_rotation(cos, sin, inverse, x.dim()))
        return out
    e = _rotation(cos, sin, inverse, x.dim())
    pairs = torch.view_as_complex(x[..., -rd:].float().reshape(*x.shape[:-1], half, 2).contiguous())
    rotated = torch.view_as_real(pairs * e).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


# e^{+-i p f} of the last cos/sin pair seen, per direction and rank of x: one forward reads the
# same cos/sin tensors in every layer (q, kv, indexer q, the output's de-rotation)
_ROTATIONS: dict[tuple[int, bool, int], tuple] = {}
_ROTATIONS_KEPT = 16  # a forward alternates two rope tables over q, kv, indexer q and de-rotation


def _rotation(cos: torch.Tensor, sin: torch.Tensor, inverse: bool, dim: int) -> torch.Tensor:
    """[T, 1.., half] complex rotations shaped to broadcast against an x of rank `dim`."""
    key = (id(cos), inverse, dim)
    hit = _ROTATIONS.get(key)
    # entries hold cos/sin, so a live id is the same object (same values: cos/sin are never edited)
    if hit is not None and hit[0] is cos and hit[1] is sin:
        return hit[2]
    e = torch.complex(cos, -sin if inverse else sin)
    if dim != 2:
        e = e.view(cos.shape[0], *([1] * (dim - 2)), cos.shape[-1])
    if len(_ROTATIONS) >= _ROTATIONS_KEPT:
        del _ROTATIONS[next(iter(_ROTATIONS))]  # oldest first
    _ROTATIONS[key] = (cos, sin, e)
    return e

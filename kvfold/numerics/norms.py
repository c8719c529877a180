"""RMSNorm: x * rsqrt(mean(x^2) + eps), times a weight where there is one.

The torch functions are the reference; fp32 CPU tensors take native.c's kv_rms_norm (the same
formula, one row at a time, the mean of squares accumulated in float64), and batch-invariant mode
off the CPU the Triton row kernel (rows.py's `fixed_kernels`).
"""
import torch
import torch.nn.functional as F

from . import native
from .rows import fixed_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, multiplied by the (fp32) weight, cast once to the input dtype."""
    kernels = fixed_kernels(x)
    if kernels is not None:
        return kernels.norm(x, weight, eps)
    lib = native.library_for(x, weight)
    if lib is not None:
        return _native_norm(lib, x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMS normalisation without a weight (V4's per-head q norm and mHC input norm)."""
    kernels = fixed_kernels(x)
    if kernels is not None:
        return kernels.norm(x, None, eps)
    lib = native.library_for(x)
    if lib is not None:
        return _native_norm(lib, x, None, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def _native_norm(lib, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    d = x.shape[-1]
    lib.kv_rms_norm(x.data_ptr(), None if weight is None else weight.data_ptr(), out.data_ptr(),
                    x.numel() // d if d else 0, d, eps)
    return out

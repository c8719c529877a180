"""RMSNorm: x * rsqrt(mean(x^2) + eps), times a weight where there is one.

The torch formulas are the reference; an fp32 model on the CPU runs native.c's kv_rms_norm (the
same formula, one row at a time, the mean of squares accumulated in float64), batch-invariant mode
off the CPU the Triton row kernel: the model's `ops.rms_norm` (backend.py) says which.
"""
import torch
import torch.nn.functional as F

from .backend import Backend, KernelError


def rms_norm(ops: Backend, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, multiplied by the (fp32) weight, cast once to the input dtype."""
    c = ops.rms_norm
    if c.rows is not None:
        return c.rows.norm(x, weight, eps)
    if c.native is not None:
        return _native_norm(c.native, x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(ops: Backend, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMS normalisation without a weight (V4's per-head q norm and mHC input norm)."""
    c = ops.rms_norm
    if c.rows is not None:
        return c.rows.norm(x, None, eps)
    if c.native is not None:
        return _native_norm(c.native, x, None, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def _native_norm(lib, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32 or not x.is_cpu or (weight is not None and weight.dtype != torch.float32):
        raise KernelError(f"kv_rms_norm reads fp32 CPU rows and weights, got {x.dtype} on {x.device}")
    x = x.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    lib.kv_rms_norm(x.data_ptr(), None if weight is None else weight.data_ptr(), out.data_ptr(),
                    x.numel() // d if d else 0, d, eps)
    return out

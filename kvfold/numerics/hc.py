"""mHC (manifold-constrained hyper-connection): hc_mult residual streams collapse into one sub-block
input and the sub-block's output expands back into the streams.

For one row of streams X [hc, d], with x = flat(X) [hc*d] and r = 1 / rms(x):
    mix  = (x @ fn^T) * r                                   (the norm folded into the matmul's output)
    pre  = sigmoid(mix[:hc] * s0 + b[:hc]) + eps              collapse weights
    post = 2 sigmoid(mix[hc:2hc] * s1 + b[hc:2hc])            expand weights of the sub-block output
    comb = Sinkhorn(softmax_rows(mix[2hc:] * s2 + b[2hc:]) + eps)   stream-mixing matrix [hc, hc]
    collapse: sum_k pre_k X_k;   expand: X'_k = post_k * out + sum_j comb[j, k] X_j
Sinkhorn: a column normalisation, then iters-1 rounds of (rows, columns), each sum + eps. The
weights are computed in float64 after the fp32 matmul and rounded to fp32 once (more accurate
than fp32 throughout); the collapse sums in fp32 and rounds once, the expand runs in the streams'
dtype.

These torch functions are the reference; for fp32 models on the CPU the native kernels (native.c:
kv_hc_collapse, kv_hc_head, kv_hc_expand) compute the same formulas, each row alone, and so do
the Triton row kernels in batch-invariant mode off the CPU (the model's `ops.hc`, backend.py).
"""
from __future__ import annotations

import torch

from .backend import Backend, KernelError
from .native_abi import HcParams
from .rows import row_mm

# The native collapse computes the mixing matmul row by row on one thread. With several torch
# threads, large calls (prefill chunks) keep the threaded GEMM, except in batch-invariant mode,
# where every row takes the native kernel (a row's bits must not depend on its batch).
_NATIVE_SERIAL_MACS = 1 << 24


def native_collapse_serves(ops: Backend, t: int, fn: torch.Tensor) -> bool:
    """Whether a collapse of t rows with this fn takes the native kernel (see above)."""
    return ops.batch_invariant or torch.get_num_threads() == 1 or t * fn.numel() <= _NATIVE_SERIAL_MACS


def _mix(ops: Backend, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(flat(streams) @ fn^T) / rms(flat(streams)) in float64, [T, fn rows]."""
    flat = streams.reshape(streams.shape[0], -1).float()
    return normalised_mix(row_mm(ops, flat, fn.float()), flat, norm_eps)


def normalised_mix(mix: torch.Tensor, flat: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """mix [T, n] (the fp32 matmul) / rms(flat [T, K]), in float64."""
    return mix.double() * torch.rsqrt(flat.double().pow(2).mean(-1, keepdim=True) + norm_eps)


def _fixed_mix(ops: Backend, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """flat(streams) @ fn^T [T, fn rows] fp32 by the fixed-order matmul (batch-invariant mode)."""
    return row_mm(ops, streams.reshape(streams.shape[0], -1).float(), fn.float())


HC_MAX = 16  # native.c's HC_MAX: the most streams its kernels take


def _fp32_cpu(streams: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """The streams contiguous, after checking that every operand is what native.c reads."""
    for t in (streams, *others):
        if t.dtype != torch.float32 or not t.is_cpu:
            raise KernelError(f"native.c's mHC kernels read fp32 CPU tensors, got {t.dtype} on {t.device}")
    return streams.contiguous()


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """A column normalisation, then iters-1 rounds of (rows, columns), each sum + eps."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_weights(ops: Backend, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, d] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), fp32 (module docstring)."""
    pre, post, comb = weights_of_mix(_mix(ops, streams, fn, norm_eps), streams.shape[1], base, scale, iters, hc_eps)
    return pre.float(), post.float(), comb.float()


def weights_of_mix(mix: torch.Tensor, hc: int, base: torch.Tensor, scale: torch.Tensor, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) in float64 from the normalised mix [T, hc * (2 + hc)] (module docstring)."""
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(mix[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = mix[:, 2 * hc:].reshape(-1, hc, hc) * s[2] + b[2 * hc:].view(hc, hc)
    return pre, post, sinkhorn(torch.softmax(logits, dim=-1) + hc_eps, iters, hc_eps)


def hc_head_weights(ops: Backend, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse weights: pre [T, hc] = sigmoid(mix * s + b) + eps."""
    mix = _mix(ops, streams, fn, norm_eps)
    return (torch.sigmoid(mix * scale.double() + base.double()) + hc_eps).float()


def weighted_streams(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_k pre[:, k] * streams[:, k]: fp32 weights times the streams, summed in fp32 and rounded
    to the streams' dtype once, as transformers' and the release's collapse and head do in bf16
    (rounding the weights, each product and each partial sum to bf16 instead moves a bf16 model's
    logits by twice transformers' own bf16 error). fp32 streams: the same ops as ever."""
    return (pre[..., None] * streams.float()).sum(dim=1).to(streams.dtype)


def hc_collapse(ops: Backend, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                iters: int, hc_eps: float, norm_eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, d] -> (sum_k pre_k * stream_k [T, d], post [T, hc], comb [T, hc, hc])."""
    t, hc, d = streams.shape
    c = ops.hc
    if c.rows is not None:
        return c.rows.hc_collapse(streams, _fixed_mix(ops, streams, fn), base, scale, iters, hc_eps, norm_eps)
    if c.native is not None and native_collapse_serves(ops, t, fn):
        lib, streams = c.native, _fp32_cpu(streams, fn, base, scale)
        out = torch.empty(t, d, dtype=torch.float32)
        post = torch.empty(t, hc, dtype=torch.float32)
        comb = torch.empty(t, hc, hc, dtype=torch.float32)
        params = HcParams(fn.data_ptr(), base.data_ptr(), scale.data_ptr(), iters, hc_eps, norm_eps)
        if lib.kv_hc_collapse(params, streams.data_ptr(), t, hc, d, out.data_ptr(), post.data_ptr(),
                              comb.data_ptr()) != 0:
            raise KernelError(f"kv_hc_collapse takes 1..{HC_MAX} streams, got {hc}")
        return out, post, comb
    pre, post, comb = hc_weights(ops, streams, fn, base, scale, iters, hc_eps, norm_eps)
    return weighted_streams(pre, streams), post, comb


def hc_head(ops: Backend, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse sum_k pre_k * stream_k [T, d], pre from `hc_head_weights`."""
    t, hc, d = streams.shape
    c = ops.hc
    if c.rows is not None:
        return c.rows.hc_collapse(streams, _fixed_mix(ops, streams, fn), base, scale, 0, hc_eps, norm_eps, head=True)
    if c.native is not None and native_collapse_serves(ops, t, fn):
        lib, streams = c.native, _fp32_cpu(streams, fn, base, scale)
        out = torch.empty(t, d, dtype=torch.float32)
        params = HcParams(fn.data_ptr(), base.data_ptr(), scale.data_ptr(), 0, hc_eps, norm_eps)
        if lib.kv_hc_head(params, streams.data_ptr(), t, hc, d, out.data_ptr()) != 0:
            raise KernelError(f"kv_hc_head takes 1..{HC_MAX} streams, got {hc}")
        return out
    return weighted_streams(hc_head_weights(ops, streams, fn, base, scale, hc_eps, norm_eps), streams)


def stream_mean(streams: torch.Tensor) -> torch.Tensor:
    """GLM-5.3's final collapse (no learned head weights): the mean of [T, hc, d] over its hc
    streams, summed left to right: elementwise IEEE adds, so a row's bits never depend on its batch
    (a reduction kernel may split the sum by tensor size). Summed in fp32 and rounded once, as
    torch's mean over bf16 streams (transformers' head) does."""
    acc = streams[:, 0].float()  # (a no-op on fp32 streams)
    for k in range(1, streams.shape[1]):
        acc = acc + streams[:, k]
    return (acc / streams.shape[1]).to(streams.dtype)


def hc_expand(ops: Backend, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
              ) -> torch.Tensor:
    """X'_k = post_k * out + sum_j comb[j, k] X_j, in the streams' dtype."""
    c = ops.hc
    if c.rows is not None:
        return c.rows.hc_expand(streams, out, post, comb)
    if c.native is not None:
        lib, streams = c.native, _fp32_cpu(streams, out, post, comb)
        out, post, comb = out.contiguous(), post.contiguous(), comb.contiguous()
        t, hc, d = streams.shape
        res = torch.empty_like(streams)
        lib.kv_hc_expand(streams.data_ptr(), out.data_ptr(), post.data_ptr(), comb.data_ptr(), t, hc, d,
                         res.data_ptr())
        return res
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.bmm(comb.to(dt).transpose(1, 2), streams)

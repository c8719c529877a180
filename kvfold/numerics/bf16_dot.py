"""The bf16 dot product (a model loaded with dot="bf16"), written once in torch: the definition
native.c's kernels compute (native_bf16dot.h, whose header states it), step by step.

    x @ w^T where x and w are first rounded to bf16 (to nearest even; below bf16's smallest
    normal, a zero of its sign), k padded with zeros to a multiple of 32; 16 float32 lanes, lane
    j taking values 2j+1 then 2j of each step of 32, each a fused multiply-add whose subnormal
    result is flushed to a zero of its sign; then lane j + j+8, +4, +2, +1.

A fused multiply-add of two bf16 values (8 significant bits each) into a float32 is one float32
addition of their exact product (16 bits, a float32 when it is normal): here the product is
formed in float64, where it is exact, and the sum rounded to float64 then to float32, which
rounds as once, since float64 carries more than twice float32's bits plus two (Figueroa's
double-rounding condition for addition). So this equals the kernels wherever every product is
a normal float32, as it is for any weights and activations a model holds; it is slow (a loop
over the steps), for tests.
"""
from __future__ import annotations

import torch

_TINY = 2.0 ** -126  # float32's (and bf16's) smallest normal


def flushed(x: torch.Tensor) -> torch.Tensor:
    """x with every subnormal value a zero of its sign."""
    return torch.where(x.abs() < _TINY, x * 0.0, x)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (torch's conversion: to nearest even on the bits), flushed, as float32."""
    return flushed(x.float().to(torch.bfloat16).float())


def bf16_dot_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (float32 values) by the bf16 dot's definition -> float32 [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    kp = -(-k // 32) * 32
    xs = torch.zeros(m, kp, dtype=torch.float64)
    ws = torch.zeros(n, kp, dtype=torch.float64)
    xs[:, :k], ws[:, :k] = round_bf16(x).double(), round_bf16(w).double()
    xs, ws = xs.view(m, kp // 32, 16, 2), ws.view(n, kp // 32, 16, 2)
    lanes = torch.zeros(m, n, 16, dtype=torch.float32)
    for s in range(kp // 32):
        for e in (1, 0):
            prod = xs[:, None, s, :, e] * ws[None, :, s, :, e]
            lanes = flushed((lanes.double() + prod).float())
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0]

"""Weight holders named like the checkpoint: `Linear.weight`, `Norm.weight`."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics import rms_norm
from ..numerics.quant import act_quant_fp8


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T with no bias. The input is cast to the weight dtype (fp32 weights compute in fp32).

    `act_quant` (reference numerics, on the release's FP8 GEMMs) rounds the input per token to
    FP8 in 1x128 blocks first, as the official kernels quantize activations."""

    act_quant = False

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant:
            x = act_quant_fp8(x, 128)
        return x.to(self.weight.dtype) @ self.weight.t()


class Norm(nn.Module):
    """RMSNorm with an fp32 weight."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

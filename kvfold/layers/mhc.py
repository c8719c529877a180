"""mHC: collapse hc_mult residual streams into one sub-block input and expand the output back."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics import hc_head_weights, hc_weights
from .basic import _param


class HyperConnection(nn.Module):
    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        self.iters, self.hc_eps, self.norm_eps = iters, hc_eps, norm_eps
        n = (2 + hc) * hc
        self.fn = _param(n, hc * hidden, dtype=torch.float32, device=device)
        self.base = _param(n, dtype=torch.float32, device=device)
        self.scale = _param(3, dtype=torch.float32, device=device)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, d] -> (sub-block input [T, d], post, comb)."""
        p = self._parameters
        pre, post, comb = hc_weights(streams, p["fn"], p["base"], p["scale"], self.iters, self.hc_eps, self.norm_eps)
        return _weighted_sum(pre, streams), post, comb

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'_k = post_k * out + sum_j comb[j, k] X_j."""
        dt = streams.dtype
        if dt == torch.float32 and out.dtype == dt:  # one fused op: post x out + comb^T @ streams
            return torch.baddbmm(post.unsqueeze(2) * out.unsqueeze(1), comb.transpose(1, 2), streams)
        return post.to(dt)[..., None] * out[:, None, :] + torch.bmm(comb.to(dt).transpose(1, 2), streams)


class HyperHead(nn.Module):
    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = _param(hc, hc * hidden, dtype=torch.float32, device=device)
        self.hc_base = _param(hc, dtype=torch.float32, device=device)
        self.hc_scale = _param(1, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        p = self._parameters
        pre = hc_head_weights(streams, p["hc_fn"], p["hc_base"], p["hc_scale"], self.hc_eps, self.norm_eps)
        return _weighted_sum(pre, streams)


def _weighted_sum(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_k pre[:, k] * streams[:, k] (fp32 weights) in the streams' dtype: one bmm for fp32."""
    if streams.dtype == torch.float32:
        return torch.bmm(pre.unsqueeze(1), streams).squeeze(1)
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)

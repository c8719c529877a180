"""mHC: collapse hc_mult residual streams into one sub-block input and expand the output back."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics.backend import Backend
from ..numerics.hc import hc_collapse, hc_expand, hc_head
from .basic import _param


class HyperConnection(nn.Module):
    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        self.iters, self.hc_eps, self.norm_eps = iters, hc_eps, norm_eps
        n = (2 + hc) * hc
        self.fn = _param(n, hc * hidden, dtype=torch.float32, device=device)
        self.base = _param(n, dtype=torch.float32, device=device)
        self.scale = _param(3, dtype=torch.float32, device=device)

    def collapse(self, streams: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, d] -> (sub-block input [T, d], post, comb)."""
        p = self._parameters
        return hc_collapse(ops, streams, p["fn"], p["base"], p["scale"], self.iters, self.hc_eps, self.norm_eps)

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, ops: Backend
               ) -> torch.Tensor:
        """X'_k = post_k * out + sum_j comb[j, k] X_j."""
        return hc_expand(ops, streams, out, post, comb)


class HyperHead(nn.Module):
    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = _param(hc, hc * hidden, dtype=torch.float32, device=device)
        self.hc_base = _param(hc, dtype=torch.float32, device=device)
        self.hc_scale = _param(1, dtype=torch.float32, device=device)

    def forward(self, streams: torch.Tensor, ops: Backend) -> torch.Tensor:
        p = self._parameters
        return hc_head(ops, streams, p["hc_fn"], p["hc_base"], p["hc_scale"], self.hc_eps, self.norm_eps)

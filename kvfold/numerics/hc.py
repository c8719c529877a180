"""mHC (manifold-constrained hyper-connection) mixing weights, fp32, with Sinkhorn projection."""
import numpy as np
import torch

from .norms import unweighted_rms_norm
from .rows import row_mm


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, d] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), all fp32.

    comb is made doubly stochastic: softmax rows + eps, a column normalisation, then
    iters-1 rounds of (rows, columns), each with eps added to the sum.
    """
    t, hc, _ = streams.shape
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mix = row_mm(flat, fn.float())  # [T, (2 + hc) * hc]
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = mix[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + hc_eps, iters, hc_eps)
    return pre, post, comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """A column normalisation, then iters-1 rounds of (rows, columns), each sum + eps.

    On the CPU the 4x4 matrices are tiny and the loop is all per-op overhead, so it runs
    in numpy (same float32 arithmetic, ~3x less overhead per decode token)."""
    if comb.device.type == "cpu":
        a = comb.numpy().copy()
        e = np.float32(eps)
        a /= a.sum(axis=-2, keepdims=True) + e
        for _ in range(iters - 1):
            a /= a.sum(axis=-1, keepdims=True) + e
            a /= a.sum(axis=-2, keepdims=True) + e
        return torch.from_numpy(a)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_head_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse weights: pre [T, hc] = sigmoid(mix * s + b) + eps."""
    t = streams.shape[0]
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mix = row_mm(flat, fn.float())
    return torch.sigmoid(mix * scale.float() + base.float()) + hc_eps

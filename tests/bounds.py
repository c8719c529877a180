"""Rounding-error bounds derived from the numbers involved (Higham, Accuracy and Stability of
Numerical Algorithms, ch. 3), for tests that compare two floating-point evaluations."""
import math

import torch


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = eps / 2 the unit roundoff of `dtype`: a sum of n
    terms, or a dot product of length n (n - 1 additions and the products), in any order and with
    or without FMA, is within gamma_n * sum |terms| of the exact value."""
    u = torch.finfo(dtype).eps / 2
    assert n * u < 1
    return n * u / (1 - n * u)


def matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fl(x @ w.T) - x @ w.T| for one evaluation in x's dtype with a
    K-length accumulation in that dtype (K = x.shape[-1]): gamma_K * (|x| @ |w|.T), with
    |x| @ |w|.T formed in float64 so that the bound carries no rounding of its own."""
    return gamma(x.shape[-1], x.dtype) * (x.double().abs() @ w.double().abs().t())


def log_softmax_rounding(logits: torch.Tensor) -> float:
    """Bound on the rounding of one float32 log_softmax of rows of `logits` (V = logits.shape[-1],
    M = max|logit|), in units of u = 2^-24, to first order: x_v - m rounds once (2M u absolute),
    which exp turns into a 2M u relative error of each term, plus one ulp (2u) of exp itself; the
    V-term sum of positive terms adds gamma_V (V u) relative; log turns the sum's relative error
    into an absolute one and adds one ulp of log S <= log V (2 log V u); x_t - m rounds once
    (2M u) and the last subtraction once (|result| <= 2M + log V). Together
    (V + 6M + 3 log V + 2) u."""
    v, m = logits.shape[-1], logits.abs().max().item()
    return (v + 6 * m + 3 * math.log(v) + 2) * torch.finfo(torch.float32).eps / 2

"""The release's order of operations, for numerics="reference" (DeepSeek-V4).

Each function restates one step of the official inference code in torch, with the same roundings
in the same places; which release file and function each follows, and which revision, is cited in
one place: the table in docs/checkpoints.md ("Numerics"). Nothing here runs in the default ("hf")
numerics.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

RELEASE_ATTN_BLOCK = 64  # key columns per online-softmax step of the release's sparse attention


def _exp(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp through float64 (correctly rounded but for ~1e-8 of inputs): the same bits for an
    element whatever the tensor's size, where torch's fp32 exp takes a scalar path for the tail
    that a vector loop leaves (a last-bit difference that a later bf16 cast can turn into a step)."""
    return torch.exp(x.double()).float()


def _sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """An fp32 sum through float64 (its rounding to fp32 is the correctly rounded sum but for
    ~1e-8 of sums, whatever the order): the same bits for a row whatever the shape around it,
    where torch's reductions change order, and so their last bit, with the shape."""
    return x.double().sum(dim).float()


def release_q_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head q norm: q *= rsqrt(q.square().mean(-1) + eps), every op in the
    activation dtype (bf16): the square rounded, the mean accumulated in fp32 and rounded, eps
    added and rsqrt taken in bf16, the product rounded."""
    sq = q.square()
    mean = (_sum(sq, -1) / q.shape[-1]).to(q.dtype)[..., None]
    # rsqrt through float64 (torch's vector and scalar-tail rsqrt differ in the last bit)
    return q * torch.rsqrt((mean + eps).double()).float().to(q.dtype)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """fp32 silu through float64, for the same reason as `_exp`."""
    return F.silu(x.double()).float()


def release_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """An expert's SwiGLU: gate and up (the GEMMs' outputs, in the model dtype) taken to
    fp32, clamped when limit > 0, silu(gate) * up in fp32, times the routing weight (fp32, [n, 1])
    when given; fp32 result (the caller casts it to the model dtype before w2's act_quant)."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = torch.clamp(u, min=-limit, max=limit)
        g = torch.clamp(g, max=limit)
    h = _silu(g) * u
    return h if weight is None else weight * h


def release_sparse_attn(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                        scale: float, block: int = RELEASE_ATTN_BLOCK) -> torch.Tensor:
    """The sparse attention kernel: one query row's attention over its gathered key columns
    in the release's column order, in blocks of `block` columns with a running max:

        s = (q . k) * scale (fp32);  m' = max(m, max s);  p = exp(s - m')   (fp32)
        l = l * exp(m - m') + sum p (fp32 p);  acc = acc * exp(m - m') + bf16(p) @ v
        out = acc / (l + exp(sink - m))

    The unnormalised p is cast to bf16 before it weights the values (`T.copy(acc_s, acc_s_cast)`),
    the normaliser sums the fp32 p. q [n, h, d] and keys [n, K, d] (K = V) are float tensors holding
    the bf16 values; valid [n, K] (False: a -1 index); sinks [h] fp32. Returns fp32 [n, h, d]
    (the kernel then stores it as bf16). Every block is padded to `block` columns, as the kernel
    pads it, so a row's sums run in the same order whatever K and the other rows are."""
    n, h, d = q.shape
    f32 = torch.float32
    q = q.to(f32)
    keys = keys.to(f32)
    pad = (-keys.shape[1]) % block
    if pad:
        keys = F.pad(keys, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    m = torch.full((n, h), float("-inf"), dtype=f32, device=q.device)
    l = torch.zeros(n, h, dtype=f32, device=q.device)
    acc = torch.zeros(n, h, d, dtype=f32, device=q.device)
    for b0 in range(0, keys.shape[1], block):
        kb = keys[:, b0:b0 + block]
        s = torch.bmm(q, kb.transpose(1, 2)) * scale
        s = s.masked_fill(~valid[:, None, b0:b0 + block], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        if bool(torch.isneginf(m_new).any()):  # nothing valid yet in some row: keep it empty
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        else:
            m_safe = m_new
        alpha = _exp(m - m_safe)
        p = _exp(s - m_safe[..., None])
        l = l * alpha + _sum(p, -1)
        acc = acc * alpha[..., None] + torch.bmm(p.to(torch.bfloat16).to(f32), kb)
        m = m_new
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    l = l + _exp(sinks.to(f32)[None, :] - m_safe)
    return acc / l[..., None]


def release_index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Index scores: einsum("shd,td->sht") in bf16, relu, times the head weights
    (bf16, already carrying d^-1/2 H^-1/2), summed over heads in bf16. q [n, H, d], keys [E, d],
    w [n, H], all bf16 -> bf16 [n, E]."""
    bf16 = torch.bfloat16
    s = torch.relu(q.to(bf16) @ keys.to(bf16).t())  # [n, H, E]
    return _sum(s * w.to(bf16)[..., None], 1).to(bf16)  # fp32 accumulation, one rounding


def topk_descending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The release's `scores.topk(k)[1]` order (descending score) with a defined tie rule: among
    equal scores the lower index first (torch.topk leaves it open). Entries scored -inf come back
    as -1, last."""
    k = min(k, scores.shape[-1])
    values, order = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    values, order = values[..., :k], order[..., :k]
    return order.masked_fill(values == float("-inf"), -1)

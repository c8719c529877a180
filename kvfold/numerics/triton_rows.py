"""Fixed-order row kernels in Triton: what batch-invariant mode runs off the CPU (numerics/rows.py).

They are the token-parallel ops native.c serves on the CPU, with the same promise: a row's bits
do not depend on which other rows share the call. That holds by construction of the programs,
not by a measured property of a library:
  * every program owns whole outputs and writes each once: no split-K, no atomics;
  * the tile sizes are this module's constants (or functions of the row length alone), never
    chosen from the number of rows;
  * the row kernels run one program per row over blocks of constexpr size, so an element sits at
    the same place in its block (its column) alone and in any batch;
  * a reduction runs over the row's own blocks in ascending order (a per-lane running sum), then
    `tl.sum` over a constexpr-sized axis, a tree whose shape depends on the block size only; the
    matmul sums each output's K blocks in ascending order, each block by such a tree.
Inputs may be fp32 or bf16; the arithmetic is fp32 (the mHC weights float64, as the torch
formulas in hc.py). Checked against those formulas and for batch invariance on the CPU, under
`TRITON_INTERPRET=1` (tests/test_gpu_invariance.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MM_TILE = (8, 32, 32)  # rows, outputs, K per step: fixed, whatever the shapes
ROW_BLOCK = 1024  # the longest block a row kernel takes (shorter rows: the next power of two)


def _block(d: int) -> int:
    return min(ROW_BLOCK, 1 << max(0, (int(d) - 1).bit_length()))


@triton.jit
def _mm_kernel(x, w, out, m, n, k, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # 64-bit offsets: a vocab-sized weight
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, k, BK):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < m) & (kk[None, :] < k),
                    other=0.0).to(tl.float32)
        b = tl.load(w + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < k),
                    other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
    tl.store(out + rm[:, None] * som + rn[None, :], acc, mask=(rm[:, None] < m) & (rn[None, :] < n))


@triton.jit
def _sum_squares(x, d, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, d, BLOCK):
        v = tl.load(x + d0 + cols, mask=d0 + cols < d, other=0.0).to(tl.float32)
        acc += v * v
    return tl.sum(acc, axis=0)


@triton.jit
def _norm_kernel(x, w, out, d, eps, HAS_W: tl.constexpr, L2: tl.constexpr, BLOCK: tl.constexpr):
    """RMSNorm x * (1 / sqrt(mean(x^2) + eps)) [* w], or L2 x / sqrt(sum(x^2) + eps), per row."""
    row = tl.program_id(0).to(tl.int64)
    ss = _sum_squares(x + row * d, d, BLOCK)
    if L2:
        inv = 1.0 / tl.sqrt_rn(ss + eps)
    else:
        inv = 1.0 / tl.sqrt_rn(ss / d + eps)
    cols = tl.arange(0, BLOCK)
    for d0 in range(0, d, BLOCK):
        c = d0 + cols
        v = tl.load(x + row * d + c, mask=c < d, other=0.0).to(tl.float32) * inv
        if HAS_W:
            v = tl.load(w + c, mask=c < d, other=0.0).to(tl.float32) * v
        tl.store(out + row * d + c, v.to(out.dtype.element_ty), mask=c < d)


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _softplus(v):
    """log(1 + e^v), linear past 20; log1p's compensated form (u = 1 + e, log u - ((u - 1) - e) / u)."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    return tl.where(v > 20.0, v, tl.where(u == 1.0, e, tl.log(u) - ((u - 1.0) - e) / u))


@triton.jit
def _unary_kernel(x, out, d, OP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for d0 in range(0, d, BLOCK):
        c = d0 + cols
        v = tl.load(x + row * d + c, mask=c < d, other=0.0).to(tl.float32)
        if OP == 0:
            y = _sigmoid(v)
        elif OP == 1:
            y = v * _sigmoid(v)
        elif OP == 2:
            y = _softplus(v)
        elif OP == 3:  # in float64 (libdevice on CUDA, no fast approximation), rounded once:
            y = tl.cos(v.to(tl.float64))  # rope angles reach 1e5 radians
        else:
            y = tl.sin(v.to(tl.float64))
        tl.store(out + row * d + c, y.to(out.dtype.element_ty), mask=c < d)


@triton.jit
def _swiglu_kernel(gate, up, out, d, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for d0 in range(0, d, BLOCK):
        c = d0 + cols
        g = tl.minimum(tl.load(gate + row * d + c, mask=c < d, other=0.0).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.load(up + row * d + c, mask=c < d, other=0.0).to(tl.float32), -limit), limit)
        tl.store(out + row * d + c, (g * _sigmoid(g) * u).to(out.dtype.element_ty), mask=c < d)


@triton.jit
def _softmax_kernel(x, out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x + row * d + cols, mask=cols < d, other=float("-inf")).to(tl.float32)
    e = tl.exp(v - tl.max(v, axis=0))
    tl.store(out + row * d + cols, e / tl.sum(e, axis=0), mask=cols < d)


@triton.jit
def _rope_kernel(x, cos, sin, out, inner, d, half, INVERSE: tl.constexpr, BLOCK_I: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One row t of x [T, inner, d]: the trailing 2 * half dims of each of its `inner` rows as
    (even, odd) pairs times e^{+-i p f}, the leading ones copied; block element (j, i) is row j's
    pair i, alone or in any batch."""
    t = tl.program_id(0).to(tl.int64)
    lead = d - 2 * half
    rows = tl.arange(0, BLOCK_I)
    cols = tl.arange(0, BLOCK)
    for j0 in range(0, inner, BLOCK_I):
        j = j0 + rows
        base = (t * inner + j[:, None]) * d
        for d0 in range(0, lead, BLOCK):
            c = d0 + cols[None, :]
            m = (j[:, None] < inner) & (c < lead)
            tl.store(out + base + c, tl.load(x + base + c, mask=m), mask=m)
        for h0 in range(0, half, BLOCK):
            i = h0 + cols
            m = (j[:, None] < inner) & (i[None, :] < half)
            ev = tl.load(x + base + lead + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
            od = tl.load(x + base + lead + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
            c = tl.load(cos + t * half + i, mask=i < half, other=0.0)[None, :]
            s = tl.load(sin + t * half + i, mask=i < half, other=0.0)[None, :]
            if INVERSE:
                s = -s
            tl.store(out + base + lead + 2 * i[None, :], (ev * c - od * s).to(out.dtype.element_ty), mask=m)
            tl.store(out + base + lead + 2 * i[None, :] + 1, (ev * s + od * c).to(out.dtype.element_ty), mask=m)


@triton.jit
def _hc_kernel(streams, mix, base, scale, out, post_out, comb_out, d, iters, hc_eps, norm_eps,
               HC: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row of hc.py's collapse (or, HEAD, the final collapse): from mix = flat @ fn^T (the
    fixed-order matmul) and the row's mean square (float64, per-lane then a tree), the weights in
    float64, then out = sum_k pre_k X_k in fp32 (a tree of constexpr size HC)."""
    row = tl.program_id(0).to(tl.int64)
    n_mix = HC if HEAD else HC * (2 + HC)
    x = streams + row * HC * d
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for d0 in range(0, HC * d, BLOCK):
        v = tl.load(x + d0 + cols, mask=d0 + cols < HC * d, other=0.0).to(tl.float64)
        acc += v * v
    r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / (HC * d) + norm_eps)  # (float64)
    k = tl.arange(0, HC)
    mrow = mix + row * n_mix
    pre_l = tl.load(mrow + k).to(tl.float64) * r * tl.load(scale).to(tl.float64) + tl.load(base + k).to(tl.float64)
    pre = (_sigmoid(pre_l) + hc_eps).to(tl.float32)
    if not HEAD:
        post_l = tl.load(mrow + HC + k).to(tl.float64) * r * tl.load(scale + 1).to(tl.float64) \
            + tl.load(base + HC + k).to(tl.float64)
        tl.store(post_out + row * HC + k, (2.0 * _sigmoid(post_l)).to(tl.float32))
        cell = k[:, None] * HC + k[None, :]
        logits = tl.load(mrow + 2 * HC + cell).to(tl.float64) * r * tl.load(scale + 2).to(tl.float64) \
            + tl.load(base + 2 * HC + cell).to(tl.float64)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_out + row * HC * HC + cell, comb.to(tl.float32))
    for d0 in range(0, d, BLOCK):
        c = d0 + cols
        xs = tl.load(x + k[:, None] * d + c[None, :], mask=c[None, :] < d, other=0.0).to(tl.float32)
        tl.store(out + row * d + c, tl.sum(pre[:, None] * xs, axis=0).to(out.dtype.element_ty), mask=c < d)


@triton.jit
def _hc_expand_kernel(streams, y, post, comb, res, d, HC: tl.constexpr, BLOCK: tl.constexpr):
    """One row: X'_k = post_k * y + sum_j comb[j, k] X_j in fp32 (the sum over j a tree of
    constexpr size HC), rounded once."""
    row = tl.program_id(0).to(tl.int64)
    x = streams + row * HC * d
    k = tl.arange(0, HC)
    pst = tl.load(post + row * HC + k)
    cm = tl.load(comb + row * HC * HC + k[:, None] * HC + k[None, :])  # [j, k]
    cols = tl.arange(0, BLOCK)
    for d0 in range(0, d, BLOCK):
        c = d0 + cols
        xs = tl.load(x + k[:, None] * d + c[None, :], mask=c[None, :] < d, other=0.0).to(tl.float32)  # [j, c]
        mixed = tl.sum(cm[:, :, None] * xs[:, None, :], axis=0)  # [k, c]
        yv = tl.load(y + row * d + c, mask=c < d, other=0.0).to(tl.float32)
        tl.store(res + row * HC * d + k[:, None] * d + c[None, :],
                 (pst[:, None] * yv[None, :] + mixed).to(res.dtype.element_ty), mask=c[None, :] < d)


# ---- launchers ---------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous() if x.dim() else x.reshape(1, 1)


def mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T in fp32 -> [M, N] fp32 (into `out`, a [M, N] view with unit column
    stride, when given). x and w need unit stride along K; their row strides are read as given."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("the fixed-order matmul reads rows with unit stride along K")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        bm, bn, bk = MM_TILE
        _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](x, w, out, m, n, k, x.stride(0), w.stride(0),
                                                              out.stride(0), BM=bm, BN=bn, BK=bk)
    return out


def norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, l2: bool = False) -> torch.Tensor:
    """Per-row RMSNorm (times `weight`) or L2 normalisation of x's last dim, in x's dtype."""
    x2 = _rows(x)
    out = torch.empty_like(x2)
    d = x2.shape[-1]
    if x2.shape[0] and d:
        w = x2 if weight is None else weight.contiguous()
        _norm_kernel[(x2.shape[0],)](x2, w, out, d, eps, HAS_W=weight is not None, L2=l2, BLOCK=_block(d))
    return out.view(x.shape)


UNARY = {"sigmoid": 0, "silu": 1, "softplus": 2, "cos": 3, "sin": 4}


def unary(name: str, x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if x2.numel():
        _unary_kernel[(x2.shape[0],)](x2, out, x2.shape[-1], OP=UNARY[name], BLOCK=_block(x2.shape[-1]))
    return out.view(x.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty_like(g2)
    if g2.numel():
        _swiglu_kernel[(g2.shape[0],)](g2, u2, out, g2.shape[-1], limit, BLOCK=_block(g2.shape[-1]))
    return out.view(gate.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim (rows of up to ROW_BLOCK * 8 entries, one block each)."""
    x2 = _rows(x)
    d = x2.shape[-1]
    block = 1 << max(0, (d - 1).bit_length())
    if block > 8 * ROW_BLOCK:
        raise ValueError(f"the fixed-order softmax takes rows of up to {8 * ROW_BLOCK} entries, got {d}")
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.numel():
        _softmax_kernel[(x2.shape[0],)](x2, out, d, BLOCK=block)
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """rope.py's apply_rope for x [T, ..., D] and cos/sin [T, half] (fp32)."""
    t, d, half = x.shape[0], x.shape[-1], cos.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    inner = xc.numel() // (t * d) if t * d else 0
    if t and inner:
        _rope_kernel[(t,)](xc, cos.float().contiguous(), sin.float().contiguous(), out, inner, d, half,
                           INVERSE=inverse, BLOCK_I=min(16, _block(inner)), BLOCK=_block(max(half, d - 2 * half, 1)))
    return out


def hc_collapse(streams: torch.Tensor, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                hc_eps: float, norm_eps: float, head: bool = False):
    """hc.py's collapse of streams [T, hc, d] from mix [T, n_mix] fp32 (-> out, post, comb), or
    with `head` the final collapse (-> out)."""
    t, hc, d = streams.shape
    if hc & (hc - 1):
        raise ValueError(f"the fixed-order mHC kernels take a power-of-two stream count, got {hc}")
    xs = streams.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    if t:
        _hc_kernel[(t,)](xs, mix.contiguous(), base.contiguous(), scale.contiguous(), out, post, comb, d, iters,
                         hc_eps, norm_eps, HC=hc, HEAD=head, BLOCK=_block(hc * d))
    return out if head else (out, post, comb)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, hc, d = streams.shape
    if hc & (hc - 1):
        raise ValueError(f"the fixed-order mHC kernels take a power-of-two stream count, got {hc}")
    res = torch.empty(t, hc, d, dtype=streams.dtype, device=streams.device)
    if t:
        _hc_expand_kernel[(t,)](streams.contiguous(), y.contiguous(), post.float().contiguous(),
                                comb.float().contiguous(), res, d, HC=hc, BLOCK=_block(d))
    return res

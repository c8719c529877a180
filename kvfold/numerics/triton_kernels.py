"""Triton kernels for the sparse parts on CUDA: the compressor's window pooling, attention over a
query's window, selected compressed entries and sink, the indexer's scoring and top-k, and the
routed experts of a graph-decode step (each row's experts read where they lie, not gathered).

Each is checked against the torch formula it stands for (tests/test_triton_ops.py, on the CPU
under `TRITON_INTERPRET=1`). They are off by default and have not run on a GPU; a model's Backend
(backend.py) imports this module (and triton) only when its KernelSet turns them on.

Fixed-order arithmetic, no atomics: every output is computed by one program, which reduces its
slots, keys or heads in a fixed order, so a row's result does not depend on which other rows
share the launch (batch-invariant by construction). fp32 dots use `input_precision="ieee"` (no
TF32). The indexer's top-k is exact with the tie rule of `topk_lower_index` (higher score, then
lower index): each score becomes a 64-bit key, its order-preserving bits above the complement of
its index, so all keys differ; a bisection over the key bits finds the k-th largest, and the
entries at or above it are written out in ascending index order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


INDEX_BLOCK = 64  # entries per index-scores program


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _pool_windows_kernel(kv, score, out, c, c_total, ratio, n_slots, OVERLAP: tl.constexpr,
                         SLOTS: tl.constexpr, BLOCK_C: tl.constexpr):
    w = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, SLOTS)
    if OVERLAP:  # slots 0..r-1: the previous window's rows, first half; r..2r-1: its own, second half
        row = tl.where(s < ratio, w * ratio + s, (w + 1) * ratio + (s - ratio))
        col = tl.where(s < ratio, 0, c)
    else:
        row = w * ratio + s
        col = s * 0
    at = row[:, None] * c_total + col[:, None] + ch[None, :]
    mask = (s[:, None] < n_slots) & (ch[None, :] < c)
    sc = tl.load(score + at, mask=mask, other=float("-inf"))
    x = tl.load(kv + at, mask=mask, other=0.0)
    m = tl.max(sc, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(sc - m[None, :])
    z = tl.sum(e, axis=0)
    weights = tl.where(z[None, :] > 0, e / tl.where(z > 0, z, 1.0)[None, :], 0.0)  # a column of -inf: 0
    tl.store(out + w * c + ch, tl.sum(x * weights, axis=0), mask=ch < c)

@triton.jit
def _attend_part(q, keys, n_keys, idx_row, n_idx, d, m_i, l_i, acc, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax over the keys idx_row[0..n_idx) (-1 = none; an index past the n_keys rows
    reads nothing) for a block of heads; keys of any float dtype, read as their fp32 values."""
    dd = tl.arange(0, BLOCK_D)
    for m0 in range(0, n_idx, BLOCK_M):
        offs = m0 + tl.arange(0, BLOCK_M)
        idx = tl.load(idx_row + offs, mask=offs < n_idx, other=-1)
        valid = (idx >= 0) & (idx < n_keys)
        k = tl.load(keys + tl.where(valid, idx, 0).to(tl.int64)[:, None] * d + dd[None, :],
                    mask=valid[:, None] & (dd[None, :] < d), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(m_i - safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc

@triton.jit
def _sparse_attend_kernel(q, keys_w, rows_w, idx_w, n_w, keys_c, rows_c, idx_c, n_c, sinks, out, h, d,
                          BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    qmask = (hh[:, None] < h) & (dd[None, :] < d)
    qb = tl.load(q + (t * h + hh[:, None]) * d + dd[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_part(qb, keys_w, rows_w, idx_w + t * n_w, n_w, d, m_i, l_i, acc, BLOCK_M, BLOCK_D)
    m_i, l_i, acc = _attend_part(qb, keys_c, rows_c, idx_c + t * n_c, n_c, d, m_i, l_i, acc, BLOCK_M, BLOCK_D)
    sink = tl.load(sinks + hh, mask=hh < h, other=0.0)  # one more logit per head, with no value
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_f)
    denom = l_i * alpha + tl.exp(sink - m_f)
    o = acc * (alpha / denom)[:, None]
    tl.store(out + (t * h + hh[:, None]) * d + dd[None, :], o, mask=qmask)

@triton.jit
def _index_scores_kernel(q, w, keys, rows, visible, out, h, d, n, HAS_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """score[t, j] = sum_h w[t, h] relu(q[t, h] . key_j) for entries j < visible[t], else -inf;
    key_j = keys[j], or keys[rows[t, j]] with HAS_ROWS (each query's own rows of one table)."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    qb = tl.load(q + (t * h + hh[:, None]) * d + dd[None, :], mask=(hh[:, None] < h) & (dd[None, :] < d),
                 other=0.0)
    if HAS_ROWS:
        r = tl.load(rows + t * n + j, mask=j < n, other=0).to(tl.int64)
    else:
        r = j.to(tl.int64)
    k = tl.load(keys + r[:, None] * d + dd[None, :], mask=(j[:, None] < n) & (dd[None, :] < d),
                other=0.0).to(tl.float32)
    s = tl.maximum(tl.dot(qb, tl.trans(k), input_precision="ieee"), 0.0)
    wt = tl.load(w + t * h + hh, mask=hh < h, other=0.0)
    score = tl.sum(wt[:, None] * s, axis=0)
    vis = tl.load(visible + t)
    tl.store(out + t * n + j, tl.where(j < vis, score, float("-inf")), mask=j < n)

@triton.jit
def _order_keys(score, j):
    """Order-preserving 64-bit keys: the score's bits (sign folded; -0 as +0, which compare
    equal) above ~index."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    u = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.uint32, bitcast=True)
    return (u.to(tl.uint64) << 32) | (~j).to(tl.uint32, bitcast=True).to(tl.uint64)

@triton.jit
def _topk_kernel(scores, out, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    row = scores + t * n
    prefix = tl.zeros([1], tl.uint64)
    for i in range(64):  # the largest X with at least k keys >= X: the k-th largest key
        cand = prefix | (tl.full([1], 1, tl.uint64) << (63 - i))
        count = tl.zeros([1], tl.int32)
        for n0 in range(0, n, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            s = tl.load(row + j, mask=j < n, other=float("-inf"))
            keys = _order_keys(s, j)
            count += tl.sum(((keys >= cand) & (j < n)).to(tl.int32), axis=0)
        prefix = tl.where(count >= k, cand, prefix)
    written = tl.zeros([1], tl.int32)
    for n0 in range(0, n, BLOCK_N):  # the picks in ascending index; -inf entries are never picked
        j = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(row + j, mask=j < n, other=float("-inf"))
        pick = (_order_keys(s, j) >= prefix) & (j < n) & (s > float("-inf"))
        slot = written + tl.cumsum(pick.to(tl.int32), axis=0) - 1
        tl.store(out + t * k + slot, j.to(tl.int64), mask=pick)
        written += tl.sum(pick.to(tl.int32), axis=0)
    pad = tl.arange(0, BLOCK_K)
    tl.store(out + t * k + pad, tl.full([BLOCK_K], -1, tl.int64), mask=(pad >= written) & (pad < k))


@triton.jit
def _expert_rows_kernel(x, w, ids, out, n_out, k_in, n_slots, X_PER_SLOT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Outputs [n0, n0 + BLOCK_N) of one (row, slot): w[ids[row, slot]] @ x, x the row's (or, with
    X_PER_SLOT, the slot's own) input; fp32 products summed over K in one fixed order."""
    rs = tl.program_id(0)  # row * n_slots + slot
    x_row = rs if X_PER_SLOT else rs // n_slots
    e = tl.load(ids + rs).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = w + e * n_out * k_in  # int64: a stack of experts passes 2^31 elements
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + x_row * k_in + kk, mask=kk < k_in, other=0.0).to(tl.float32)
        wv = tl.load(base + cols[:, None].to(tl.int64) * k_in + kk[None, :],
                     mask=(cols[:, None] < n_out) & (kk[None, :] < k_in), other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(out + rs * n_out + cols, acc, mask=cols < n_out)


def expert_rows(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, per_slot: bool = False) -> torch.Tensor:
    """y[n, j] = w[ids[n, j]] @ x[n] (per_slot: x[n * k + j]) for a stack w [E, n_out, K], x in w's
    dtype, ids [N, k]: [N, k, n_out] fp32, each expert read in place (graph_step.py's `_moe` gathers
    copies of them instead). One program per (row, slot) and block of outputs."""
    n, k = ids.shape
    e, n_out, k_in = w.shape
    out = torch.empty(n, k, n_out, dtype=torch.float32, device=w.device)
    if n and k and n_out:
        block_n = min(64, _pow2(n_out))
        _expert_rows_kernel[(n * k, triton.cdiv(n_out, block_n))](
            x.contiguous(), w.contiguous(), ids.to(torch.int64).contiguous(), out, n_out, k_in, k,
            X_PER_SLOT=per_slot, BLOCK_N=block_n, BLOCK_K=min(128, _pow2(k_in)))
    return out


def pool_windows(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """numerics/fold.py's `pool_windows` (same arguments and result), one program per window and
    block of channels."""
    kv, score = kv.float().contiguous(), score.float().contiguous()
    c_total = kv.shape[-1]
    c = c_total // 2 if overlap else c_total
    n_w = max(kv.shape[0] // ratio - (1 if overlap else 0), 0)
    out = torch.empty(n_w, c, dtype=torch.float32, device=kv.device)
    if n_w and c:
        n_slots = 2 * ratio if overlap else ratio
        block_c = min(64, _pow2(c))
        _pool_windows_kernel[(n_w, triton.cdiv(c, block_c))](kv, score, out, c, c_total, ratio, n_slots,
                                                             OVERLAP=overlap, SLOTS=_pow2(n_slots), BLOCK_C=block_c)
    return out


def sparse_attend(q: torch.Tensor, keys_w: torch.Tensor, idx_w: torch.Tensor, keys_c: torch.Tensor | None,
                  idx_c: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """Each query's softmax over its window keys keys_w[idx_w[t]], its compressed entries
    keys_c[idx_c[t]] (-1 = none in either; an index past the keys reads nothing) and one sink
    logit per head (no value); K = V. The key tables are read in place, in their own dtype.
    q [T, H, D] fp32 (already scaled), idx_* [T, M] integer -> [T, H, D] fp32."""
    t, h, d = q.shape
    q, keys_w, sinks = q.float().contiguous(), keys_w.contiguous(), sinks.float().contiguous()
    idx_w = idx_w.to(torch.int32).contiguous()
    if keys_c is None or idx_c is None or idx_c.shape[1] == 0:
        keys_c, idx_c = keys_w, torch.full((t, 0), -1, dtype=torch.int32, device=q.device)
    keys_c, idx_c = keys_c.contiguous(), idx_c.to(torch.int32).contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    if t:
        block_h = max(16, min(64, _pow2(h)))  # tl.dot needs 16 rows at least
        _sparse_attend_kernel[(t, triton.cdiv(h, block_h))](
            q, keys_w, keys_w.shape[0], idx_w, idx_w.shape[1], keys_c, keys_c.shape[0], idx_c, idx_c.shape[1], sinks,
            out, h, d,
            BLOCK_H=block_h, BLOCK_M=32, BLOCK_D=max(16, _pow2(d)))
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's scores for T queries over n entries: sum_h w[t, h] relu(q[t, h] . keys[j]),
    -inf for entries j >= visible[t]. q [T, H, D], w [T, H], keys [n, D] -> [T, n] fp32. With
    `rows` [T, n]: entry j of query t is keys[rows[t, j]] (a graph-decode step's pages, read in
    place from the pool's storage)."""
    t, h, d = q.shape
    n = keys.shape[0] if rows is None else rows.shape[1]
    scores = torch.empty(t, n, dtype=torch.float32, device=q.device)
    if t and n:
        # a constant, not a function of n: a graph step's n follows the batch's context bound, and
        # the heads' sum per entry must not change with it (batch-invariant graph decode)
        block_n = INDEX_BLOCK
        _index_scores_kernel[(t, triton.cdiv(n, block_n))](
            q.float().contiguous(), w.float().contiguous(), keys.contiguous(),
            scores if rows is None else rows.to(torch.int64).contiguous(), visible.to(torch.int32).contiguous(),
            scores, h, d, n, HAS_ROWS=rows is not None,
            BLOCK_H=max(16, _pow2(h)), BLOCK_N=block_n, BLOCK_D=max(16, _pow2(d)))
    return scores


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """numerics/topk.py's `topk_lower_index` of fp32 scores [T, n]: [T, min(k, n)] long, ascending,
    -1 padded; one program per row."""
    t, n = scores.shape
    k = min(k, n)
    out = torch.empty(t, k, dtype=torch.long, device=scores.device)
    if t and k:
        _topk_kernel[(t,)](scores.float().contiguous(), out, n, k, BLOCK_N=min(1024, _pow2(n)), BLOCK_K=_pow2(k))
    return out


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's pick: `topk_lower_index(index_scores(...), k)`."""
    return topk_lower_index(index_scores(q, w, keys, visible), k)

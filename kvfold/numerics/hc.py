"""mHC (manifold-constrained hyper-connection) mixing weights, fp32, with Sinkhorn projection.

On the CPU the per-token part after the one matmul (sigmoids, a 4x4 softmax and 20 Sinkhorn
rounds) is pure per-op overhead, so it runs in float64 outside torch: straight-line Python for a
single row (decode), numpy for many; both do the same float64 operations in the same order and
round once to float32 at the end (more accurate than fp32 throughout; the difference is fp32
rounding noise). The rms normalisation of the flattened streams is folded into the matmul's
output: (x / rms(x)) @ fn^T == (x @ fn^T) / rms(x).
"""
from __future__ import annotations

import math
import weakref
from array import array

import numpy as np
import torch

from . import native
from .norms import unweighted_rms_norm
from .rows import row_mm, rows_invariant

# The native collapse computes the mixing matmul row by row on one thread. With several torch
# threads, large calls (prefill chunks) keep the threaded GEMM, except in batch-invariant mode,
# where every row takes the native kernel (a row's bits must not depend on its batch).
_NATIVE_SERIAL_MACS = 1 << 24


def _native_hc(t: int, fn: torch.Tensor) -> bool:
    return rows_invariant() or torch.get_num_threads() == 1 or t * fn.numel() <= _NATIVE_SERIAL_MACS


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, d] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), all fp32.

    comb is made doubly stochastic: softmax rows + eps, a column normalisation, then
    iters-1 rounds of (rows, columns), each with eps added to the sum.
    """
    t, hc, _ = streams.shape
    if streams.device.type == "cpu":
        packed = _hc_mix_cpu(streams, fn, base, scale, norm_eps, ("comb", hc, iters, hc_eps))
        n = (2 + hc) * hc  # rows of [pre | post | comb^T row-major]: each output is one strided view
        return (packed.as_strided((t, hc), (n, 1), 0), packed.as_strided((t, hc), (n, 1), hc),
                packed.as_strided((t, hc, hc), (n, 1, hc), 2 * hc))
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mix = row_mm(flat, fn.float())  # [T, (2 + hc) * hc]
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = mix[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + hc_eps, iters, hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                iters: int, hc_eps: float, norm_eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, d] -> (sum_k pre_k * stream_k [T, d], post [T, hc], comb [T, hc, hc]): the mHC
    weights (`hc_weights`) and the collapse in one native call where the kernels serve it."""
    t, hc, d = streams.shape
    lib = native.library()
    if lib is not None and native.fp32_cpu(streams, fn, base, scale) and _native_hc(t, fn):
        out = torch.empty(t, d, dtype=torch.float32)
        post = torch.empty(t, hc, dtype=torch.float32)
        comb = torch.empty(t, hc, hc, dtype=torch.float32)
        if lib.kv_hc_collapse(streams.data_ptr(), fn.data_ptr(), base.data_ptr(), scale.data_ptr(), t, hc, d,
                              iters, hc_eps, norm_eps, out.data_ptr(), post.data_ptr(), comb.data_ptr()) == 0:
            return out, post, comb
    pre, post, comb = hc_weights(streams, fn, base, scale, iters, hc_eps, norm_eps)
    return weighted_streams(pre, streams), post, comb


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse sum_k pre_k * stream_k [T, d], pre from `hc_head_weights`."""
    t, hc, d = streams.shape
    lib = native.library()
    if lib is not None and native.fp32_cpu(streams, fn, base, scale) and _native_hc(t, fn):
        out = torch.empty(t, d, dtype=torch.float32)
        if lib.kv_hc_head(streams.data_ptr(), fn.data_ptr(), base.data_ptr(), scale.data_ptr(), t, hc, d,
                          hc_eps, norm_eps, out.data_ptr()) == 0:
            return out
    return weighted_streams(hc_head_weights(streams, fn, base, scale, hc_eps, norm_eps), streams)


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * out + sum_j comb[j, k] X_j, in the streams' dtype."""
    dt = streams.dtype
    if dt == torch.float32 and out.dtype == dt:
        lib = native.library()
        if lib is not None and native.fp32_cpu(streams, out, post, comb):
            t, hc, d = streams.shape
            res = torch.empty_like(streams)
            lib.kv_hc_expand(streams.data_ptr(), out.data_ptr(), post.data_ptr(), comb.data_ptr(), t, hc, d,
                             res.data_ptr())
            return res
        # one fused op: post x out + comb^T @ streams
        return torch.baddbmm(post.unsqueeze(2) * out.unsqueeze(1), comb.transpose(1, 2), streams)
    return post.to(dt)[..., None] * out[:, None, :] + torch.bmm(comb.to(dt).transpose(1, 2), streams)


def weighted_streams(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_k pre[:, k] * streams[:, k] (fp32 weights) in the streams' dtype: one bmm for fp32."""
    if streams.dtype == torch.float32:
        return torch.bmm(pre.unsqueeze(1), streams).squeeze(1)
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def hc_head_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse weights: pre [T, hc] = sigmoid(mix * s + b) + eps."""
    t = streams.shape[0]
    if streams.device.type == "cpu":
        return _hc_mix_cpu(streams, fn, base, scale, norm_eps, ("head", hc_eps)).view(t, -1)
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mix = row_mm(flat, fn.float())
    return torch.sigmoid(mix * scale.float() + base.float()) + hc_eps


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """A column normalisation, then iters-1 rounds of (rows, columns), each sum + eps (fp32)."""
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


# ---- CPU: one matmul in torch, the rest in float64 -----------------------------------------------
def _hc_mix_cpu(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_eps: float, kind: tuple) -> torch.Tensor:
    """[T, n] fp32 weights (1-D [n] when T = 1) from mix = rms-normed flat streams @ fn^T. kind ("comb", hc, iters, hc_eps)
    packs [pre | post | comb^T row-major] per row (hc_weights); ("head", hc_eps) gives
    sigmoid(mix * scale + base) + hc_eps (hc_head_weights)."""
    t = streams.shape[0]
    flat = streams.reshape(t, -1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    mix = row_mm(flat, fn if fn.dtype == torch.float32 else fn.float())
    norm = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    inv_d = 1.0 / flat.shape[1]
    if t == 1:  # -> a 1-D tensor of the row
        m = mix.tolist()[0]
        ss = norm.tolist()[0][0]
        r = 1.0 / math.sqrt(ss * ss * inv_d + norm_eps)
        b, s = param_list(base), param_list(scale)
        if kind[0] == "head":
            row = _head_row(m, r, b, s[0], kind[1])
        else:
            row = _row_kernel(kind[1], kind[2])(m, r, b, s, kind[3])
        # array('f') rounds each float64 to float32 (as torch.tensor would, at a quarter of the cost)
        return torch.frombuffer(array("f", row), dtype=torch.float32)
    m = mix.double().numpy()
    ss = norm.double().numpy()
    r = 1.0 / np.sqrt(ss * ss * inv_d + norm_eps)
    b, s = base.double().numpy(), scale.double().numpy().tolist()
    if kind[0] == "head":
        out = _sigmoid_np(m * (r * s[0]) + b) + kind[1]
    else:
        out = _rows_np(m, r, b, s, *kind[1:])
    return torch.from_numpy(out.astype(np.float32))


_LISTS: dict[int, tuple] = {}


def param_list(t: torch.Tensor) -> list:
    """t.tolist() of a small parameter, cached until the tensor is modified in place or replaced."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter: no cache
        return t.tolist()
    hit = _LISTS.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    values = t.tolist()
    _LISTS[id(t)] = (weakref.ref(t), version, values)
    return values


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _sigmoid_np(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        pos = 1.0 / (1.0 + np.exp(-z))
        e = np.exp(z)
        neg = e / (1.0 + e)
    return np.where(z >= 0, pos, neg)


def _head_row(m: list, r: float, b: list, s0: float, hc_eps: float) -> list:
    rs = r * s0
    return [_sigmoid(mi * rs + bi) + hc_eps for mi, bi in zip(m, b)]


_KERNELS: dict = {}


def _row_kernel(hc: int, iters: int):
    """Straight-line Python for one row of hc_weights (hc x hc unrolled), generated once per shape."""
    k = _KERNELS.get((hc, iters))
    if k is None:
        k = _KERNELS[(hc, iters)] = _build_row_kernel(hc, iters)
    return k


def _build_row_kernel(hc: int, iters: int):
    R = range(hc)
    a = [[f"a{i}_{j}" for j in R] for i in R]
    L = ["def kernel(m, r, b, s, eps):",
         "    r0 = r * s[0]", "    r1 = r * s[1]", "    r2 = r * s[2]"]
    L.append("    pre = [sig(m[i] * r0 + b[i]) + eps for i in range(%d)]" % hc)
    L.append("    post = [2.0 * sig(m[i] * r1 + b[i]) for i in range(%d, %d)]" % (hc, 2 * hc))
    for i in R:  # row softmax of the comb logits, + eps
        o = 2 * hc + i * hc
        L.append("    " + ", ".join(f"l{j}" for j in R) + " = "
                 + ", ".join(f"m[{o + j}] * r2 + b[{o + j}]" for j in R))
        L.append("    mx = max(" + ", ".join(f"l{j}" for j in R) + ")")
        L.append("    " + ", ".join(f"e{j}" for j in R) + " = " + ", ".join(f"exp(l{j} - mx)" for j in R))
        L.append("    z = " + " + ".join(f"e{j}" for j in R))
        L.append("    " + ", ".join(a[i]) + " = " + ", ".join(f"e{j} / z + eps" for j in R))

    def cols() -> list:
        out = []
        for j in R:
            out.append(f"c = {' + '.join(a[i][j] for i in R)} + eps")
            out.append(", ".join(a[i][j] for i in R) + " = " + ", ".join(f"{a[i][j]} / c" for i in R))
        return out

    def rows() -> list:
        out = []
        for i in R:
            out.append(f"c = {' + '.join(a[i])} + eps")
            out.append(", ".join(a[i]) + " = " + ", ".join(f"{v} / c" for v in a[i]))
        return out

    L += ["    " + x for x in cols()]
    L.append(f"    for _ in range({iters - 1}):")
    L += ["        " + x for x in rows() + cols()]
    # comb^T row-major: element (k, j) is comb[j, k]
    L.append("    return pre + post + [" + ", ".join(a[j][k] for k in R for j in R) + "]")
    ns = {"sig": _sigmoid, "exp": math.exp}
    exec(compile("\n".join(L), f"<hc_row_kernel_{hc}_{iters}>", "exec"), ns)
    return ns["kernel"]


def _rows_np(m: np.ndarray, r: np.ndarray, b: np.ndarray, s: list, hc: int, iters: int,
             eps: float) -> np.ndarray:
    """hc_weights for T rows in float64 numpy: the row kernel's operations, vectorized over rows."""
    t = m.shape[0]
    pre = _sigmoid_np(m[:, :hc] * (r * s[0]) + b[:hc]) + eps
    post = 2.0 * _sigmoid_np(m[:, hc:2 * hc] * (r * s[1]) + b[hc:2 * hc])
    logits = (m[:, 2 * hc:] * (r * s[2]) + b[2 * hc:]).reshape(t, hc, hc)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    z = e[..., 0]
    for j in range(1, hc):
        z = z + e[..., j]
    a = e / z[..., None] + eps

    def norm(a: np.ndarray, axis: int) -> np.ndarray:  # explicit left-to-right sums, as the row kernel
        c = a.take(0, axis=axis)
        for j in range(1, hc):
            c = c + a.take(j, axis=axis)
        return a / np.expand_dims(c + eps, axis)

    a = norm(a, 1)
    for _ in range(iters - 1):
        a = norm(norm(a, 2), 1)
    return np.concatenate([pre, post, a.transpose(0, 2, 1).reshape(t, hc * hc)], axis=1)

"""Batch-invariant row arithmetic.

In batch-invariant mode a row's result must not depend on which other rows share a call: a
sequence's tokens must not change with the server's load, and a prefix-cache hit must be
bit-identical to a cold run. Third-party CPU kernels give no such promise: MKL and ATen pick
other GEMM kernels and blockings by row count, instruction set and thread count, and ATen's
vectorised elementwise and reduction kernels compute tails and thread chunks with other code
than the body. So in batch-invariant mode (`Backend.batch_invariant`) every token-parallel op (the ones that run on the
concatenated rows of several sequences) goes through native.c, whose arithmetic the program
fixes:
  * `row_mm` (projections, experts, router, lm_head, the grouped output projection): every
    output is native.c's one `dot`, a fixed sequence of roundings that depends on K only, not
    on the row count, the row's place in its tile, the thread count or the vector width;
  * `swiglu` and `route_rows` (the MoE's activations and routing), `unary` and `l2norm`
    (KDA's gates and normalisation): each row on its own, transcendental functions as scalar
    libm calls;
  * RMSNorm, rope and the mHC collapse, head and expand are native per-row kernels already.
The MoE combines its experts with elementwise IEEE adds and multiplies in ascending expert
order, which are exact whatever kernel runs them. What runs per sequence (compressor folds,
indexer, attention, KDA) sees only that sequence's rows. A decode row's per-sequence arithmetic
is native or exact copies; a chunk of several rows, whose attention runs torch's kernels, gets
its rows in a fresh buffer of the shape, strides and alignment it would have alone (`own_rows`:
MKL may take other code paths for other alignments).

Off the CPU the same ops take the Triton fixed-order row kernels instead (triton_rows.py, fp32
and bf16), as the model's Backend chose them at set-up (backend.py); the MoE routing composes
them with exact selection (`route_rows`). Every sequence's rows then reach the per-sequence ops
in a fresh buffer (`Backend.fresh_rows`), decode rows too: torch's kernels there run on the
sequence's own shapes, but may pick other code for another alignment.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import Backend, KernelError
from .native_abi import MatmulArgs, RouteParams

_F32 = torch.float32
_SERIAL_MACS = 1 << 17  # below this a matmul runs on one thread (the thread count changes no bits)


def _lib(choice):
    if choice.native is None:
        raise KernelError(f"{choice.op} runs {choice.kind} here ({choice.reason}), not native.c")
    return choice.native


def _threads(macs: int) -> int:
    return 1 if macs < _SERIAL_MACS else torch.get_num_threads()


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 [M, K] rows with unit stride along K (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or x2.device.type != "cpu":
        raise TypeError(f"batch-invariant matmul takes fp32 CPU rows, got {x2.dtype} on {x2.device}")
    return x2 if x2.stride(-1) == 1 and (x2.shape[0] <= 1 or x2.stride(0) >= x2.shape[1]) else x2.contiguous()


def invariant_mm(lib, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T with native.c's fixed-order dot for every output (`lib`: native.c)."""
    x2 = x if x.dim() == 2 and x.is_contiguous() and x.dtype is _F32 and x.is_cpu else _rows_of(x)
    w = weight if weight.is_contiguous() else weight.contiguous()
    if w.dtype is not _F32:
        raise TypeError(f"batch-invariant matmul takes fp32 weights, got {w.dtype}")
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=_F32)
    if m and n:
        lib.kv_matmul(MatmulArgs(x2.data_ptr(), x2.stride(0) if m > 1 else k, w.data_ptr(), out.data_ptr(), n, m,
                                    n, k, _threads(m * n * k)))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def row_mm(ops: Backend, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T, as `ops.row_mm` says: in batch-invariant mode the Triton
    fixed-order matmul off the CPU, else `invariant_mm`; in reference numerics `invariant_mm` for
    fp32 operands (the mHC mix, the router: a bf16 model's bf16 weights go through `weight_mm`);
    torch's GEMM otherwise."""
    c = ops.row_mm
    if c.rows is not None:
        out = c.rows.mm(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous())
        return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    if c.native is not None and (ops.batch_invariant or (x.dtype is _F32 and weight.dtype is _F32)):
        return invariant_mm(c.native, x, weight)
    return F.linear(x, weight)


def grouped_row_mm(ops: Backend, x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [T, G, in] -> [T, G*R] with group g's rows of weight [G*R, in] applied to x[:, g]; in
    batch-invariant mode (each group one `invariant_mm` into its columns)."""
    t, g, k = x.shape
    per = weight.shape[0] // groups
    x = x if x.is_contiguous() else x.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    c = ops.row_mm
    if c.rows is not None:  # each group's rows of w into its columns, reading x's group in place
        out = torch.empty(t, g * per, dtype=torch.float32, device=x.device)
        for i in range(groups):
            c.rows.mm(x[:, i], w[i * per:(i + 1) * per], out=out[:, i * per:(i + 1) * per])
        return out.to(x.dtype)
    out = torch.empty(t, g * per, dtype=torch.float32)
    lib = _lib(c)
    for i in range(groups):
        lib.kv_matmul(MatmulArgs(x.data_ptr() + 4 * i * k, g * k, w.data_ptr() + 4 * i * per * k,
                                 out.data_ptr() + 4 * i * per, g * per, t, per, k, _threads(t * per * k)))
    return out


def swiglu(ops: Backend, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L); in batch-invariant mode per row (`ops.swiglu`)."""
    c = ops.swiglu
    if c.kind == "torch":
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if c.rows is not None:
        return c.rows.swiglu(gate, up, limit)
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1 or g2.stride(0) != u2.stride(0) or g2.dtype != torch.float32:
        g2, u2 = g2.float().contiguous(), u2.float().contiguous()
    out = torch.empty(g2.shape[0], n, dtype=torch.float32)
    _lib(c).kv_swiglu(g2.data_ptr(), u2.data_ptr(), g2.stride(0) if g2.shape[0] > 1 else n, out.data_ptr(),
                     g2.shape[0], n, limit)
    return out.view(*gate.shape)


_UNARY = {"sigmoid": (0, torch.sigmoid), "silu": (1, F.silu),
          "softplus": (2, lambda x: torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))),
          "cos": (3, torch.cos), "sin": (4, torch.sin)}


def unary(ops: Backend, name: str, x: torch.Tensor) -> torch.Tensor:
    """sigmoid / silu / softplus (linear past 20) / cos / sin of x, elementwise; where `ops.unary`
    is native.c (batch-invariant mode, reference numerics), fp32 tensors in native.c with scalar
    libm, so no element depends on its place in the call (ATen computes a vectorised loop's tail
    with scalar code, whose rounding differs from the body's: a row's values would move with the
    call's length); a bf16 model's bf16 tensors keep torch's functions, which native.c does not
    define; in batch-invariant mode off the CPU, per row in Triton."""
    op, torch_fn = _UNARY[name]
    c = ops.unary
    if c.rows is not None:
        return c.rows.unary(name, x)
    if c.native is None or x.dtype != torch.float32:
        return torch_fn(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        c.native.kv_unary(x.data_ptr(), out.data_ptr(), x.numel(), op)
    return out


def l2norm(ops: Backend, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim; where `unary` runs natively, each row in
    native.c with a fixed order of additions, whatever the row count (see `unary`)."""
    c = ops.unary
    if c.rows is not None:
        return c.rows.norm(x, None, eps, l2=True)
    if c.native is None or x.dtype != torch.float32:
        return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    if x.numel():
        c.native.kv_l2norm(x.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def route_rows(ops: Backend, x: torch.Tensor, router_w: torch.Tensor, scoring: str, k: int, scale: float, *,
               bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
               token_ids: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               renorm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts in native.c (batch-invariant): -> (weights [T, k] fp32, ids [T, k]
    ascending per row). Hash routing (tid2eid[token]) or biased top-k (ties to the lower id,
    within the topk_group best of n_group groups); weights scores[ids] / sum * scale (float64),
    or scores[ids] * scale without `renorm`. Off the CPU (`ops.route` is triton_rows): `_route_fixed`."""
    c = ops.route
    if c.rows is not None:
        return _route_fixed(c.rows, x, router_w, scoring, k, scale, bias, tid2eid, token_ids, n_group, topk_group,
                            renorm)
    x2 = _rows_of(x).contiguous()
    t, h = x2.shape
    e = router_w.shape[0]
    ids = torch.empty(t, k, dtype=torch.int64)
    wts = torch.empty(t, k, dtype=torch.float32)
    args = [None if a is None else a.contiguous() for a in (router_w.float(), bias, tid2eid, token_ids)]
    w_ptr, bias_ptr, table_ptr, tok_ptr = (None if a is None else a.data_ptr() for a in args)
    router = RouteParams(h, e, k, n_group, topk_group, SCORING[scoring], int(renorm), scale, w_ptr, bias_ptr, table_ptr)
    rc = _lib(c).kv_route(router, x2.data_ptr(), t, tok_ptr, ids.data_ptr(), wts.data_ptr(), _threads(t * e * h))
    if rc != 0:
        raise ValueError(f"routing refused: k={k} of {e} experts, {n_group} groups (top {topk_group}), "
                         f"or an expert id out of range in tid2eid")
    return wts, ids


def _route_fixed(kernels, x, router_w, scoring, k, scale, bias, tid2eid, token_ids, n_group, topk_group, renorm):
    """`route_rows` from the Triton row kernels: the scores of the fixed-order matmul and per-row
    kernels, then only exact steps (a bias add, one add of a group's best two, stable sorts, the
    weights' sum in float64 left to right in ascending id), so no row depends on its batch."""
    logits = kernels.mm(x.reshape(-1, x.shape[-1]).float().contiguous(), router_w.float().contiguous())
    t, e = logits.shape
    if not (1 <= k <= e and n_group >= 1 and e % n_group == 0 and 1 <= topk_group <= n_group):
        raise ValueError(f"routing refused: k={k} of {e} experts, {n_group} groups (top {topk_group})")
    if scoring == "softmax":
        scores = kernels.softmax(logits)
    elif scoring == "sigmoid":
        scores = kernels.unary("sigmoid", logits)
    else:
        scores = kernels.unary("softplus", logits).sqrt()
    if tid2eid is not None:
        ids = tid2eid[token_ids.reshape(-1)].long()
        # checked where the host may read the device (not while a CUDA graph captures the step)
        if not _capturing() and bool(((ids < 0) | (ids >= e)).any()):
            raise ValueError(f"routing refused: an expert id out of range 0..{e - 1} in tid2eid")
    else:
        ids = biased_topk(scores + bias, k, n_group, topk_group)
    ids = ids.sort(dim=-1).values
    picked = scores.gather(1, ids).double()
    if not renorm:
        return (picked * scale).float(), ids
    total = picked[:, 0]
    for j in range(1, k):
        total = total + picked[:, j]
    return (picked / (total + 1e-20)[:, None] * scale).float(), ids


def biased_topk(choice: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """The k experts of highest `choice` [T, E] per row (ties to the lower id), among the
    topk_group of n_group groups whose best two sum highest: exact selection (sorts, and one add
    per group score), so a row's pick never depends on its batch."""
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values
        gscore = best[..., 0] + best[..., 1] if best.shape[-1] > 1 else best[..., 0]
        keep = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask[..., None].expand_as(grouped).reshape(t, e), float("-inf"))
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def combine_experts(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * per_slot[:, j] for per_slot [T, k, H] whose slots are in ascending
    expert order, left to right from the first term: elementwise IEEE operations, the same ones
    and in the same order as native.c's kv_moe_rows."""
    out = per_slot[:, 0] * weights[:, :1]
    for j in range(1, per_slot.shape[1]):
        out = out + per_slot[:, j] * weights[:, j:j + 1]
    return out


def own_rows(a: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """A sequence's rows of a batch tensor in a fresh buffer: the shape, strides and alignment it
    would have if the sequence ran alone (per-sequence kernels then see the same input)."""
    return (a if rows is None else a[rows]).clone(memory_format=torch.contiguous_format)

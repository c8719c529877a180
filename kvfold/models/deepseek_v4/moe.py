"""DeepSeek-V4 MoE: hash routing (tid2eid[token]) on the first layers, biased top-k elsewhere
(softmax, sigmoid or sqrt-softplus scores); the routed SwiGLU experts (layers/moe.py) and one
always-on shared expert. A few fp32 rows (decode, a decode batch, a draft's verify) run the whole
layer as one native call, which computes each row as it would alone and reads FP8 / FP4 experts
as stored (weights="quantized")."""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from ...layers.basic import _param, fp32_native_weights
from ...layers.native_cache import NativeCache
from ...layers.moe import Experts, SwiGluMLP
from ...numerics import native
from ...numerics.backend import Backend, KernelError
from ...numerics.native_abi import MoeLayer, RouteParams
from ...numerics.reference import release_swiglu
from ...numerics.rows import SCORING, biased_topk, route_rows, row_mm, unary
from .config import Dsv4Config


def _score(ops: Backend, logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return unary(ops, "softplus", logits).sqrt()
    if kind == "sigmoid":
        return unary(ops, "sigmoid", logits)
    return torch.softmax(logits, dim=-1)


class Router(nn.Module):
    def __init__(self, cfg: Dsv4Config, is_hash: bool, device=None):
        super().__init__()
        self.is_hash = is_hash
        self.k, self.scoring, self.scale = cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long, device=device))
        else:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] fp32, expert ids [T, k]; ascending per row in batch-invariant mode)."""
        if ops.batch_invariant:
            table = dict(tid2eid=self.tid2eid, token_ids=token_ids) if self.is_hash \
                else dict(bias=self.e_score_correction_bias)
            return route_rows(ops, x, self.weight, self.scoring, self.k, self.scale, **table)
        scores = _score(ops, row_mm(ops, x if x.dtype == torch.float32 else x.float(), self.weight), self.scoring)
        if self.is_hash:
            ids = self.tid2eid[token_ids].long()
        else:
            # the bias shifts which experts are chosen, never their weights; ties -> lower id
            ids = biased_topk(scores + self.e_score_correction_bias, self.k)
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


def SharedExpert(cfg: Dsv4Config, dtype: torch.dtype, device=None) -> SwiGluMLP:
    """The always-on shared expert (n_shared_experts of them fused into one MLP)."""
    return SwiGluMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit,
                     dtype, device)


class MoE(nn.Module):
    def __init__(self, cfg: Dsv4Config, layer_idx: int, dtype: torch.dtype, device=None, tp=None):
        """`tp` (kvfold.parallel.TensorParallel): hold this rank's contiguous range of routed experts
        (the router and hash table whole), the shared expert on rank 0 only; the output is the sum
        over ranks of each rank's routed part (plus rank 0's shared expert)."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        e0, e1 = self.tp.span(cfg.n_routed_experts) if self.tp is not None else (0, cfg.n_routed_experts)
        self.gate = Router(cfg, cfg.mlp_layer_types[layer_idx] == "hash_moe", device)
        self.experts = Experts(e1 - e0, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                               dtype, device, first=e0, total=cfg.n_routed_experts)
        keep_shared = cfg.n_shared_experts and (self.tp is None or self.tp.rank == 0)
        self.shared_experts = SharedExpert(cfg, dtype, device) if keep_shared else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, ops: Backend) -> torch.Tensor:
        """x [T, hidden]. Up to NATIVE_MOE_ROWS fp32 rows run as one native call, whose bits for
        each row equal the batch-invariant path's (native.c's kv_moe_rows, `ops.moe_rows`)."""
        if x.shape[0] <= NATIVE_MOE_ROWS and self.tp is None and ops.moe_rows.native is not None:
            y = self._native_rows(x, token_ids, ops)
            if y is not None:
                return y
        weights, ids = self.gate(x, token_ids, ops)
        y = self.experts(x, weights, ids, ops)  # the release's order in reference numerics (layers/moe.py)
        if self.shared_experts is not None:
            shared = self._shared_release(x, ops) if self.experts.act_quant else self.shared_experts(x, ops)
            y = y + (shared if shared.dtype == torch.float32 else shared.float())
        if self.tp is not None:
            y = self.tp.all_reduce_sum(y)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _shared_release(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Reference numerics: the shared expert as the release's later revision runs it
        (docs/checkpoints.md): clamped, silu(gate) * up in fp32, cast to the model dtype before w2."""
        sh = self.shared_experts
        h = release_swiglu(sh.gate_proj(x, ops), sh.up_proj(x, ops), sh.limit).to(x.dtype)
        return sh.down_proj(h, ops)

    def _native_rows(self, x: torch.Tensor, token_ids: torch.Tensor, ops: Backend) -> torch.Tensor | None:
        """The whole layer for a few fp32 rows in one native call (router, experts, shared expert;
        `ops.moe_rows` must be native.c), or None where the layer's weights are not what the kernel
        reads."""
        return _native_moe_rows(ops, self, x, token_ids)


def _native_weights(moe: MoE, lib) -> tuple | None:
    """What the native MoE reads (the router, its table, the expert stacks' and the shared
    expert's descriptors, made with `lib`, the backend's weight_mm library), or None when it cannot
    serve this layer (FP8 activations, an unknown scoring, a weight the kernels cannot read)."""
    gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
    if ex.act_quant or gate.scoring not in SCORING:
        return None
    table = gate.tid2eid if gate.is_hash else gate.e_score_correction_bias
    if not native.fp32_cpu(gate.weight) or not table.is_contiguous() \
            or table.dtype != (torch.int64 if gate.is_hash else torch.float32):
        return None
    lins = () if sh is None else (sh.gate_proj, sh.up_proj, sh.down_proj)
    if any(lin.act_quant for lin in lins):
        return None
    descs = [fp32_native_weights(w, lib) for w in (ex.gate_up_proj, ex.down_proj, *(lin.weight for lin in lins))]
    if any(d is None for d in descs):
        return None
    return (gate.weight, table, *descs, *([None] * (5 - len(descs))))


def _cached_native_weights(moe: MoE, lib) -> tuple | None:
    """`_native_weights`, rebuilt only when one of its weights is replaced, moved or loaded again.
    (The FP8-activation flags it also reads are set only by reference numerics, which bf16 models
    alone take, and this kernel reads fp32 models only.)"""
    cache = moe.__dict__.get("_native_cache")
    if cache is None:
        cache = moe.__dict__["_native_cache"] = NativeCache(moe, native_moe_paths(moe),
                                                            lambda: _native_weights(moe, cache.key))
    return cache.get(key=lib)


def native_moe_paths(moe: MoE) -> list[str]:
    """The weights (relative to `moe`) the native MoE layer points into."""
    paths = ["gate.weight", "gate.tid2eid" if moe.gate.is_hash else "gate.e_score_correction_bias",
             "experts.gate_up_proj", "experts.down_proj"]
    if moe.shared_experts is not None:
        paths += [f"shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return paths


def _native_moe_rows(ops: Backend, moe: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
    lib = ops.moe_rows.native
    if lib is None:
        raise KernelError(f"moe_rows runs {ops.moe_rows.kind} here ({ops.moe_rows.reason}), not native.c")
    if x.dtype != torch.float32 or not x.is_cpu or token_ids.dtype != torch.int64:
        raise KernelError(f"kv_moe_rows reads fp32 CPU rows and int64 token ids, got {x.dtype} on {x.device} "
                          f"and {token_ids.dtype}")
    x, token_ids = x.contiguous(), token_ids.contiguous()
    L = native_moe_layer(moe, ops.weight_mm.native)
    if L is None:  # FP8 activations, an unknown scoring, a weight the kernel cannot read
        return None
    m = x.shape[0]
    out = torch.empty(m, L.route.h, dtype=torch.float32)
    rc = lib.kv_moe_rows(L, x.data_ptr(), m, token_ids.data_ptr(), moe_threads(L, m), out.data_ptr())
    if rc != 0:
        raise ValueError(f"native MoE refused its rows (rc {rc}): an expert id out of range in tid2eid, "
                         f"or a buffer that could not be allocated")
    return out


def native_moe_layer(moe: MoE, lib) -> MoeLayer | None:
    """The layer as native.c reads it (its weights' descriptors kept alive by the cache), or None
    where the kernels cannot serve it; rebuilt only with `_cached_native_weights`. A layer whose
    experts a placement split between two devices (models/split_experts.py) runs op by op."""
    if type(moe.experts) is not Experts:
        return None
    ws = _cached_native_weights(moe, lib)
    if ws is None:
        return None
    hit = moe.__dict__.get("_native_layer")
    if hit is None or hit[0] is not ws:
        router, table, w13, w2, sg, su, sd = ws
        e, h = router.shape
        ptr = lambda d: None if d is None else ctypes.addressof(d[0])  # noqa: E731
        is_hash = moe.gate.is_hash
        route = RouteParams(h, e, moe.gate.k, 1, 1, SCORING[moe.gate.scoring], 1, moe.gate.scale, router.data_ptr(),
                            None if is_hash else table.data_ptr(), table.data_ptr() if is_hash else None)
        layer = MoeLayer(route, w2[2], 0 if sg is None else sg[1], moe.experts.limit, ptr(w13), ptr(w2), ptr(sg),
                         ptr(su), ptr(sd))
        hit = moe.__dict__["_native_layer"] = (ws, layer)
    return hit[1]


_SERIAL_BYTES = 1 << 20  # below this much fp32-equivalent weight per call, one thread (the count changes no bits)
# Up to this many rows (decode rows, verify rows, small batches) the layer is one native call,
# which gathers each expert's rows and reads its weights once for them (native.c's kv_moe_rows); past
# it, the grouped path of layers/moe.py does the same per op (native for 128-token prefill chunks
# was measured no faster: bench/RESULTS.md).
NATIVE_MOE_ROWS = 16


def moe_threads(L: MoeLayer, m: int) -> int:
    """The native MoE's thread count for m rows: one below _SERIAL_BYTES of weights, else torch's."""
    h, k = L.route.h, L.route.k
    return torch.get_num_threads() if 4 * m * h * (k * 3 * L.inter + 3 * L.shared_inter) > _SERIAL_BYTES else 1

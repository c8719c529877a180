"""V4 MoE: hash routing (tid2eid[token]) on the first layers, biased top-k elsewhere; SwiGLU
experts with clamps; one always-on shared expert."""
from __future__ import annotations

from array import array

import torch
import torch.nn.functional as F
from torch import nn

from ..models.deepseek_v4.config import Dsv4Config
from ..numerics import native
from ..numerics.quant import act_quant_fp8
from ..numerics.rows import SCORING, combine_experts, route_rows, row_mm, rows_invariant, swiglu
from .basic import Linear, QuantizedWeight, _param, matmul_weight


def _score(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if kind == "sigmoid":
        return torch.sigmoid(logits)
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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] fp32, expert ids [T, k]; ascending per row in batch-invariant mode)."""
        if rows_invariant():
            table = dict(tid2eid=self.tid2eid, token_ids=token_ids) if self.is_hash \
                else dict(bias=self.e_score_correction_bias)
            return route_rows(x, self.weight, self.scoring, self.k, self.scale, **table)
        scores = _score(row_mm(x if x.dtype == torch.float32 else x.float(), self.weight), self.scoring)
        if x.shape[0] == 1:
            return self._route_one(scores, token_ids)
        if self.is_hash:
            ids = self.tid2eid[token_ids].long()
        else:
            # the bias shifts which experts are chosen, never their weights; ties -> lower id
            biased = scores + self.e_score_correction_bias
            ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : self.k]
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, ids

    def _route_one(self, scores: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for one row in Python: the same choice on the same fp32 (biased) scores, ties
        to the lower id (a stable sort), the weights normalised in float64 and rounded to fp32."""
        if self.is_hash:
            ids_t = self.tid2eid[token_ids]
            sc, ids = scores.tolist()[0], ids_t.tolist()[0]
        else:
            sc, biased = torch.cat([scores, scores + self.e_score_correction_bias]).tolist()
            ids = sorted(range(len(sc)), key=biased.__getitem__, reverse=True)[:self.k]
            ids_t = torch.frombuffer(array("q", ids), dtype=torch.int64).unsqueeze(0)
        w = [sc[e] for e in ids]
        total = sum(w) + 1e-20
        w_t = torch.frombuffer(array("f", [wi / total * self.scale for wi in w]), dtype=torch.float32)
        return w_t.unsqueeze(0), ids_t


class Experts(nn.Module):
    """Stacked routed experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    Either may be a `QuantizedWeight`: then only the experts a batch routes to are decoded, one
    expert and one matmul at a time."""

    act_quant = False  # reference numerics: FP8 activations into the FP4 expert GEMMs
    quantizable = ("gate_up_proj", "down_proj")

    def __init__(self, cfg: Dsv4Config, dtype: torch.dtype, device=None):
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = _param(e, 2 * i, h, dtype=dtype, device=device)
        self.down_proj = _param(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each row's k experts of weight * expert(row), fp32 [T, hidden]."""
        k = ids.shape[1]
        invariant = rows_invariant()
        if x.shape[0] == 1 and not invariant:
            return self._forward_one(x, sorted(zip(ids.tolist()[0], weights.tolist()[0])))
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        # batch-invariant: each (row, slot) output kept apart, then combined in slot order (ascending ids)
        per_slot = torch.empty(ids.numel(), x.shape[1], dtype=torch.float32, device=x.device) if invariant else None
        out = None if invariant else torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        offset = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[offset:offset + n]
            rows = slots // k
            ye = self._expert(e, x[rows])
            if invariant:
                per_slot[slots] = ye
            else:
                out.index_add_(0, rows, ye * weights.reshape(-1)[slots, None])
            offset += n
        return combine_experts(per_slot.view(*ids.shape, -1), weights) if invariant else out

    def _expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """Expert e on rows xe [n, hidden] -> fp32 [n, hidden]."""
        if self.act_quant:
            xe = act_quant_fp8(xe, 128)
        w13 = matmul_weight(self.gate_up_proj, e)
        gate, up = row_mm(xe.to(w13.dtype), w13).chunk(2, dim=-1)
        h = swiglu(gate, up, self.limit)
        if self.act_quant:
            h = act_quant_fp8(h, 128)
        w2 = matmul_weight(self.down_proj, e)
        ye = row_mm(h.to(w2.dtype), w2)
        return ye if ye.dtype == torch.float32 else ye.float()

    def _forward_one(self, x: torch.Tensor, routes: list[tuple[int, float]]) -> torch.Tensor:
        """`forward` for one row x [1, H], experts in ascending id order, each read as a view of the
        stacked weights (nothing sorted, counted or gathered)."""
        w13s, w2s = self._expert_views("gate_up_proj"), self._expert_views("down_proj")
        out = None
        for e, wt in routes:
            xe = act_quant_fp8(x, 128) if self.act_quant else x
            w13 = w13s[e] if w13s is not None else matmul_weight(self.gate_up_proj, e)
            gu = F.linear(xe if xe.dtype == w13.dtype else xe.to(w13.dtype), w13)
            lo, hi = self._swiglu_bounds(gu)
            gate, up = gu.clamp_(lo, hi).chunk(2, dim=-1)  # = swiglu's two clamps, in one op
            h = F.silu(gate) * up
            if self.act_quant:
                h = act_quant_fp8(h, 128)
            w2 = w2s[e] if w2s is not None else matmul_weight(self.down_proj, e)
            h = h if h.dtype == w2.dtype else h.to(w2.dtype)
            if out is not None and w2.dtype == torch.float32:
                out = torch.addmm(out, h, w2.t(), alpha=wt)  # out + wt * (h @ w2^T)
                continue
            ye = F.linear(h, w2)
            ye = (ye if ye.dtype == torch.float32 else ye.float()) * wt
            out = ye if out is None else out + ye
        return out if out is not None else torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)

    def _expert_views(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """Per-expert views of a stacked float weight (None for a `QuantizedWeight`), made once and
        rebuilt if the weight is replaced or moved to other storage."""
        w = getattr(self, name)
        if isinstance(w, QuantizedWeight):
            return None
        hit = self.__dict__.get("_views_" + name)
        if hit is not None and hit[0] is w and hit[1] == w.data_ptr():
            return hit[2]
        with torch.inference_mode(False):  # plain views of the parameter, usable in any mode
            views = w.unbind(0)
        self.__dict__["_views_" + name] = (w, w.data_ptr(), views)
        return views

    def _swiglu_bounds(self, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column clamp bounds of [gate | up]: gate <= L, -L <= up <= L."""
        key = (gu.shape[-1], gu.dtype, gu.device)
        hit = self.__dict__.get("_bounds")
        if hit is not None and hit[0] == key:
            return hit[1]
        i, lim = gu.shape[-1] // 2, self.limit
        with torch.inference_mode(False):
            lo = torch.full((2 * i,), -lim, dtype=gu.dtype, device=gu.device)
            lo[:i] = float("-inf")
            hi = torch.full((2 * i,), lim, dtype=gu.dtype, device=gu.device)
        self.__dict__["_bounds"] = (key, (lo, hi))
        return lo, hi


class SwiGluMLP(nn.Module):
    """down(silu(min(gate x, L)) * clamp(up x, -L, L)): the shared expert, and dense MLP layers."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(hidden, inter, dtype, device)
        self.up_proj = Linear(hidden, inter, dtype, device)
        self.down_proj = Linear(inter, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def SharedExpert(cfg, dtype: torch.dtype, device=None) -> SwiGluMLP:
    """The always-on shared expert (n_shared_experts of them fused into one MLP)."""
    return SwiGluMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit,
                     dtype, device)


class MoE(nn.Module):
    def __init__(self, cfg: Dsv4Config, layer_idx: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate = Router(cfg, cfg.mlp_layer_types[layer_idx] == "hash_moe", device)
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = SharedExpert(cfg, dtype, device) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]. A lone fp32 row runs as one native call, whose bits equal the
        batch-invariant path's (native.c's kv_moe_one)."""
        if x.shape[0] == 1:
            y = self._native_one(x, token_ids)
            if y is not None:
                return y
        weights, ids = self.gate(x, token_ids)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            y = y + (shared if shared.dtype == torch.float32 else shared.float())
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _native_one(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The whole layer for one fp32 row in one native call (router, experts, shared expert), or
        None where the kernels cannot serve it."""
        return _native_moe_one(self, x, token_ids)


_NATIVE_MAX_BYTES = 4 << 20  # past this much weight per token, several threads' GEMVs win


def _native_weights(moe: MoE) -> tuple | None:
    """The fp32 weights the native one-row MoE reads, or None when it cannot serve this layer
    (quantized or non-fp32 weights, FP8 activations, an unknown scoring)."""
    gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
    if ex.act_quant or gate.scoring not in SCORING:
        return None
    w13, w2 = ex._parameters.get("gate_up_proj"), ex._parameters.get("down_proj")
    tables = [gate.weight, w13, w2, gate.tid2eid if gate.is_hash else gate.e_score_correction_bias]
    shared = (None, None, None)
    if sh is not None:
        lins = (sh.gate_proj, sh.up_proj, sh.down_proj)
        if any(lin.act_quant for lin in lins):
            return None
        shared = tuple(lin._parameters.get("weight") for lin in lins)
        tables += list(shared)
    if any(t is None for t in tables):
        return None
    if not native.fp32_cpu(*tables[:3], *tables[4:]) or not tables[3].is_contiguous() \
            or tables[3].dtype != (torch.int64 if gate.is_hash else torch.float32):
        return None
    return (gate.weight, w13, w2, tables[3], *shared)


def _cached_native_weights(moe: MoE) -> tuple | None:
    """`_native_weights`, recomputed only when a weight tensor or its storage is replaced."""
    gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
    parts = [gate._parameters["weight"], ex._parameters.get("gate_up_proj"), ex._parameters.get("down_proj"),
             gate._buffers["tid2eid" if gate.is_hash else "e_score_correction_bias"]]
    if sh is not None:
        parts += [lin._parameters.get("weight") for lin in (sh.gate_proj, sh.up_proj, sh.down_proj)]
    key = tuple((id(t), t.data_ptr()) if t is not None else None for t in parts)
    key += (ex.act_quant, sh is not None and any(lin.act_quant for lin in (sh.gate_proj, sh.up_proj, sh.down_proj)))
    hit = moe.__dict__.get("_native_weights")
    if hit is not None and hit[0] == key:
        return hit[1]
    ws = _native_weights(moe)
    moe.__dict__["_native_weights"] = (key, ws)
    return ws


def _native_moe_one(moe: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
    lib = native.library()
    if lib is None or not native.fp32_cpu(x) or token_ids.dtype != torch.int64 or not token_ids.is_contiguous():
        return None
    ws = _cached_native_weights(moe)
    if ws is None:
        return None
    router, w13, w2, table, sg, su, sd = ws
    e, h = router.shape
    k, inter = moe.gate.k, w2.shape[2]
    s_inter = 0 if sg is None else sg.shape[0]
    if torch.get_num_threads() > 1 and 4 * (k * 3 * inter * h + 3 * s_inter * h) > _NATIVE_MAX_BYTES:
        return None  # several threads' GEMMs win (in batch-invariant mode with the same bits)
    out = torch.empty(1, h, dtype=torch.float32)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    is_hash = moe.gate.is_hash
    rc = lib.kv_moe_one(x.data_ptr(), h, router.data_ptr(), e, SCORING[moe.gate.scoring],
                        None if is_hash else table.data_ptr(), table.data_ptr() if is_hash else None,
                        token_ids.data_ptr(), k, moe.gate.scale, 1, 1, 1, w13.data_ptr(), w2.data_ptr(), inter,
                        moe.experts.limit, ptr(sg), ptr(su), ptr(sd), s_inter, out.data_ptr())
    return out if rc == 0 else None

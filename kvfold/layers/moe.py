"""Routed experts and SwiGLU MLPs, shared by the model families: stacked SwiGLU experts with
clamps, computed per expert over the rows routed to it, and the plain SwiGLU MLP (dense layers and
shared experts). Routing is each family's own (models/*/moe.py, models/glm5/model.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics.backend import Backend
from ..numerics.quant import act_quant_fp8
from ..numerics.reference import release_swiglu
from ..numerics.rows import combine_experts, row_mm, swiglu
from .basic import Linear, QuantizedWeight, _param, matmul_weight, weight_mm


class Experts(nn.Module):
    """Stacked routed experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    Either may be a `QuantizedWeight`: then only the experts a batch routes to are decoded, one
    expert and one matmul at a time."""

    act_quant = False  # reference numerics: FP8 activations into the FP4 expert GEMMs
    quantizable = ("gate_up_proj", "down_proj")

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float, dtype: torch.dtype, device=None,
                 first: int = 0, total: int | None = None):
        """`first`, `total`: these are experts [first, first + n_experts) of `total` (a tensor-parallel
        rank's share); a row routed to another rank's expert gets nothing from this one."""
        super().__init__()
        e, i, h = n_experts, inter, hidden
        self.first, self.partial = first, total is not None and (first != 0 or n_experts != total)
        self.limit = limit
        self.gate_up_proj = _param(e, 2 * i, h, dtype=dtype, device=device)
        self.down_proj = _param(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: Backend) -> torch.Tensor:
        """sum over each row's k experts of weight * expert(row), fp32 [T, hidden]."""
        if self.act_quant:  # set by numerics="reference" only
            return self._forward_release(x, weights, ids, ops)
        if ops.batch_invariant:  # each (row, slot) output kept apart, then combined in slot order (ascending ids)
            return combine_experts(self.slot_outputs(x, ids, ops).view(*ids.shape, -1), weights)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e, slots, rows in self._groups(ids):
            out.index_add_(0, rows, self._expert(e, x[rows], ops) * weights.reshape(-1)[slots, None])
        return out

    def slot_outputs(self, x: torch.Tensor, ids: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Each (row, slot)'s expert output, fp32 [T * k, hidden] in the order of ids.reshape(-1);
        zero for a slot whose expert this module does not hold (`first`, `total`)."""
        alloc = torch.zeros if self.partial else torch.empty
        per_slot = alloc(ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
        for e, slots, rows in self._groups(ids):
            per_slot[slots] = self._expert(e, x[rows], ops)
        return per_slot

    def subset(self, experts: list[int]) -> "Experts":
        """These experts (global ids, ascending) as a stack of their own, its weights copied in
        the format held: local expert j is `experts[j]`; ids past the stack run nothing there."""
        sub = Experts.__new__(Experts)
        nn.Module.__init__(sub)
        sub.first, sub.partial, sub.limit, sub.act_quant = 0, True, self.limit, self.act_quant
        index = torch.tensor(experts, dtype=torch.long, device=self.gate_up_proj.device)
        for name in self.quantizable:
            w = getattr(self, name)
            setattr(sub, name, w.take(index) if isinstance(w, QuantizedWeight)
                    else nn.Parameter(w.detach().index_select(0, index), requires_grad=False))
        return sub

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: Backend) -> torch.Tensor:
        """`forward` with no host-side grouping, for a step a CUDA graph captures: one matmul per
        (row, slot) with that slot's expert, outputs in the weights' dtype as `_expert`'s, combined
        in slot order (`combine_experts`). Torch gathers copies of each row's experts; the Triton
        kernel (`ops.moe_rows`, off by default) reads them in place. Plain stacks only."""
        w13, w2 = self.gate_up_proj, self.down_proj  # [E, 2I, H], [E, H, I]
        kernels = ops.moe_rows.triton
        if kernels is not None:
            gate, up = kernels.expert_rows(x.to(w13.dtype), w13, ids).to(w13.dtype).chunk(2, dim=-1)
            act = swiglu(ops, gate, up, self.limit).to(w2.dtype)  # [N, k, I]
            per_slot = kernels.expert_rows(act.reshape(-1, act.shape[-1]), w2, ids, per_slot=True)
            per_slot = per_slot.to(w2.dtype).float()
        else:
            slots = []
            for j in range(ids.shape[1]):
                w13_j, w2_j = w13[ids[:, j]], w2[ids[:, j]]  # [N, 2I, H], [N, H, I]
                gate, up = torch.bmm(w13_j, x.to(w13.dtype)[:, :, None])[..., 0].chunk(2, dim=-1)
                y = torch.bmm(w2_j, swiglu(ops, gate, up, self.limit).to(w2.dtype)[:, :, None])[..., 0]
                slots.append(y.float())
            per_slot = torch.stack(slots, dim=1)
        return combine_experts(per_slot, weights)

    def _groups(self, ids: torch.Tensor):
        """(expert e, its (row, slot) indices into ids.reshape(-1), their rows) for each expert
        that has rows, in ascending id."""
        k, n_local = ids.shape[1], self.gate_up_proj.shape[0]
        flat_ids = ids.reshape(-1)
        if self.partial:  # this rank's experts as 0..n_local-1, every other one as n_local (never run)
            flat_ids = flat_ids - self.first
            flat_ids = torch.where((flat_ids >= 0) & (flat_ids < n_local), flat_ids, n_local)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=n_local).tolist()[:n_local]
        offset = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[offset:offset + n]
                yield e, slots, slots // k
            offset += n

    def _expert(self, e: int, xe: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Expert e on rows xe [n, hidden] -> fp32 [n, hidden]."""
        gate, up = weight_mm(ops, xe, self.gate_up_proj, e).chunk(2, dim=-1)
        ye = weight_mm(ops, swiglu(ops, gate, up, self.limit), self.down_proj, e)
        return ye if ye.dtype == torch.float32 else ye.float()

    def _forward_release(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: Backend
                         ) -> torch.Tensor:
        """The DeepSeek-V4 release's order (docs/checkpoints.md, reference numerics): per expert
        in ascending id, gate and up from FP8 activations into the GEMM (outputs in the model
        dtype), silu(gate) * up and the routing weight in fp32, cast to the model dtype, FP8
        activations into w2; the w2 outputs (model dtype) summed in fp32, ascending expert order."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_w = weights.reshape(-1).float()
        for e, slots, rows in self._groups(ids):
            xe = act_quant_fp8(x[rows], 128)
            w13 = matmul_weight(self.gate_up_proj, e)
            gate, up = row_mm(ops, xe.to(w13.dtype), w13).to(x.dtype).chunk(2, dim=-1)
            h = release_swiglu(gate, up, self.limit, flat_w[slots, None]).to(x.dtype)
            w2 = matmul_weight(self.down_proj, e)
            ye = row_mm(ops, act_quant_fp8(h, 128).to(w2.dtype), w2).to(x.dtype)
            out.index_add_(0, rows, ye.float())
        return out


class SwiGluMLP(nn.Module):
    """down(silu(min(gate x, L)) * clamp(up x, -L, L)): the shared expert, and dense MLP layers."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(hidden, inter, dtype, device)
        self.up_proj = Linear(hidden, inter, dtype, device)
        self.down_proj = Linear(inter, hidden, dtype, device)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        return self.down_proj(swiglu(ops, self.gate_proj(x, ops), self.up_proj(x, ops), self.limit), ops)

"""The lightning indexer of CSA layers: its own overlapping compressor at `index_head_dim`, and
per-query top-k selection of compressed entries.

score(q, j) = sum_h w_h(q) * ReLU(qI_h(q) . kI_j) for visible entries j < (q+1)//r; the top
`index_topk` are kept with ties going to the lower entry index; missing picks are -1.
Scoring runs in blocks of queries so no [T, all entries] tensor beyond a fixed budget exists.
"""
from __future__ import annotations

import torch
from torch import nn

from ...numerics import apply_rope, native, topk_lower_index
from ...numerics.backend import Backend, KernelError
from ...numerics.native_abi import IndexQuery
from ...numerics.quant import fp4_e2m1_simulate, hadamard
from ...numerics.reference import release_index_scores, topk_descending
from .state import CompressorState
from ...state.kv_rows import plain_rows
from ...layers.basic import Linear
from .compressor import Compressor

_SCORE_BUDGET = 1 << 24  # floats per scoring block


class Scorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weights_proj = Linear(hidden, n_heads, torch.float32, device)


class Indexer(Compressor):
    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, ratio: int,
                 rope_dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__(hidden, head_dim, ratio, True, rope_dim, eps, device)
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.q_b_proj = Linear(q_lora_rank, n_heads * head_dim, dtype, device)
        self.scorer = Scorer(hidden, n_heads, dtype, device)

    def queries(self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-parallel half of selection: index queries [T, H, d] and head weights [T, H], in
        the scoring dtype. In fp32 the weights carry both scales: sum_h (w_h / sqrt(H) / sqrt(d))
        ReLU(q_h . k); the reference numerics' bf16 scores apply 1/sqrt(d) separately."""
        t = x.shape[0]
        f32 = torch.float32
        q = self.q_b_proj(q_lora, ops).view(t, self.n_heads, self.head_dim)
        if self.entry_sim == "hadamard_fp4":
            return self._queries_release(x, q, cos, sin, ops)
        q = apply_rope(ops, q if q.dtype == f32 else q.float(), cos, sin)
        w = self.scorer.weights_proj(x, ops)
        w = w if w.dtype == f32 else w.float()
        return q, w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)

    def _queries_release(self, x: torch.Tensor, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference numerics (docs/checkpoints.md): rope on the bf16 queries, Hadamard
        (`rotate_activation`), FP4 simulation in blocks of 32, all in bf16; head weights from the
        bf16 weights_proj times d^-1/2 H^-1/2, rounded to bf16."""
        bf16 = torch.bfloat16
        q = fp4_e2m1_simulate(hadamard(apply_rope(ops, q.to(bf16), cos, sin)), 32)
        weight = self.scorer.weights_proj.weight
        weight = weight.dequant() if not isinstance(weight, torch.Tensor) else weight
        w = torch.nn.functional.linear(x.to(bf16), weight.to(bf16))
        return q, w * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

    def select(self, q: torch.Tensor, w: torch.Tensor, start: int, st: CompressorState, ops: Backend
               ) -> torch.Tensor:
        """One sequence's half: entries chosen for each of its T queries (from `queries`) at
        positions start..start+T-1: [T, k] long, ascending, -1 padded (reference numerics: in the
        release's topk order, see `_select_release`). Call after `step`/`fold` so entries
        completed by these tokens exist."""
        t = q.shape[0]
        r = self.ratio
        n_entries = (start + t) // r
        k = min(self.topk, n_entries)
        if k == 0:
            return torch.empty(t, 0, dtype=torch.long, device=q.device)
        if self.entry_sim == "hadamard_fp4":
            return self._select_release(q, w, start, st, n_entries, k)
        f32 = torch.float32
        kernels = ops.index_topk.triton  # off by default (KernelSet.triton)
        if kernels is not None:
            visible = (torch.arange(start, start + t, device=q.device) + 1) // r
            return kernels.index_topk(q, w, st.pool[:n_entries], visible, k)
        if t == 1 and ops.index_topk.native is not None:  # one fp32 query (decode) in one native call of the same rule
            out = _native_topk_one(ops, q, w, self.n_heads, self.head_dim, st.pool, n_entries, k)
            if out is not None:
                return out
        keys = st.pool[:n_entries]  # [E, d]
        if keys.dtype != q.dtype:
            keys = keys.to(q.dtype)
        visible = (torch.arange(start, start + t, device=q.device) + 1) // r  # entries < this are visible
        entry_ids = torch.arange(n_entries, device=q.device)
        block = max(1, _SCORE_BUDGET // max(1, self.n_heads * n_entries))
        out = torch.empty(t, k, dtype=torch.long, device=q.device)
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            scores = index_scores(q[b0:b1], w[b0:b1], keys)
            if b1 - b0 > 1 or b1 < t:  # the chunk's last query sees every entry
                scores = scores.masked_fill(entry_ids[None, :] >= visible[b0:b1, None], float("-inf"))
            out[b0:b1] = topk_lower_index(scores if scores.dtype == f32 else scores.float(), k)
        return out

    def _select_release(self, q: torch.Tensor, w: torch.Tensor, start: int, st: CompressorState, n_entries: int,
                        k: int) -> torch.Tensor:
        """Reference numerics (docs/checkpoints.md): bf16 scores (numerics/reference.py
        `release_index_scores`), invisible entries -inf, then `topk`: [T, k] in descending score
        order, ties to the lower entry index (torch.topk's own choice among ties is unspecified),
        -1 for picks past the visible entries."""
        t = q.shape[0]
        keys = st.pool[:n_entries]
        visible = (torch.arange(start, start + t, device=q.device) + 1) // self.ratio
        entry_ids = torch.arange(n_entries, device=q.device)
        block = max(1, _SCORE_BUDGET // max(1, self.n_heads * n_entries))
        out = torch.empty(t, k, dtype=torch.long, device=q.device)
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            scores = release_index_scores(q[b0:b1], keys, w[b0:b1])
            scores = scores.masked_fill(entry_ids[None, :] >= visible[b0:b1, None], float("-inf"))
            out[b0:b1] = topk_descending(scores, k)
        return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's score of every entry for each query: sum_h w[h] * relu(q[h] . key),
    [B, E]. q [B, H, d], w [B, H]; keys [E, d] (every query's) or [B, E, d] (one set per query,
    the graph step's). The torch reference of `ops.index_topk`'s kernels, the forward's and the
    graph step's alike."""
    s = torch.relu(q @ keys.transpose(-1, -2))  # [B, H, E]
    return torch.bmm(w[:, None, :], s)[:, 0]


def _native_topk_one(ops: Backend, q: torch.Tensor, w: torch.Tensor, n_heads: int, head_dim: int, pool,
                     n_entries: int, k: int) -> torch.Tensor | None:
    """`Indexer.select` of one fp32 query over every entry in one native call (`ops.index_topk`),
    else None where the pool is not what the kernel reads (not plain fp32 rows)."""
    lib = ops.index_topk.native
    if not native.fp32_cpu(q, w):
        raise KernelError(f"kv_index_topk_one reads a contiguous fp32 CPU query and head weights, got {q.dtype}, "
                          f"{w.dtype}")
    source = plain_rows(pool)
    if source is None:
        return None
    data, phys = source
    out = torch.empty(1, k, dtype=torch.long)
    scratch = torch.empty(n_entries, dtype=torch.float32)
    lib.kv_index_topk_one(IndexQuery(q.data_ptr(), w.data_ptr(), n_heads, head_dim), data.data_ptr(),
                          None if phys is None else phys.data_ptr(), n_entries, k, out.data_ptr(), scratch.data_ptr(),
                          torch.get_num_threads())
    return out

"""Indexed MLA of GLM-5.3 DSA layers: NoPE attention over the DSA-selected tokens.

  q_resid = RMSNorm(q_a_proj x)                       (also feeds the indexer)
  q_h     = (q_b_proj q_resid)[h]                     [qk_nope] per head
  c_t     = RMSNorm(kv_a_proj_with_mqa x_t)           [kv_lora] latent, the only per-token MLA cache
  o_h     = sum_{t in S(q)} softmax_t(q_h . K_h,t * qk_head_dim^-0.5) V_h,t,  y = o_proj(concat o_h)

computed in the absorbed form: q~_h = W_UK,h^T q_h scores against the latent c_t directly, and W_UV,h
is applied to the attention-pooled latent (same math; a cache of kv_lora values per token). The two
products run per head on kv_b_proj as held, FP8 codes read as stored (absorb.py).
S(q) is the indexer's selection read as a set (-1, out-of-range and duplicate entries ignored). A
"full" layer runs its own indexer over a `Glm5NextDsaState`; a "shared" layer reuses the selection of
the most recent full layer (raw positions, valid in every DSA layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...numerics import rms_norm
from ...numerics.backend import Backend
from ...numerics.rows import row_mm
from .dsa_select import dsa_select
from ...numerics.quant import e4m3_saturate
from .absorb import absorbed_q, absorbed_v
from .indexer_state import KV_FP8
from ...layers.basic import Linear, _param

_GATHER_BUDGET = 1 << 24  # floats of gathered latent rows per query block


def _selected_rows(sel: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection [T, W] read as a set per query: (row ids safe to gather, valid mask). -1 and
    out-of-range entries and repeats of a row are invalid (the selection is a set)."""
    s = torch.where((sel >= 0) & (sel < kv_len), sel.long(), torch.full_like(sel, -1, dtype=torch.long))
    s, _ = torch.sort(s, dim=-1)
    valid = s >= 0
    valid[:, 1:] &= s[:, 1:] != s[:, :-1]
    return s.clamp(min=0), valid


class GlmRMSNorm(nn.Module):
    """GLM RMSNorm: normalise in fp32, cast to the input dtype, then multiply by the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return rms_norm(ops, x, self.weight, self.eps)  # the same formula: one per-row native kernel on the CPU
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerNormWB(nn.Module):
    """LayerNorm with weight and bias (the indexer's k_norm, eps 1e-6)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)
        self.bias = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class DsaIndexer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, device=None):
        super().__init__()
        d, nh = cfg.index_head_dim, cfg.index_n_heads
        self.d, self.nh = d, nh
        self.topk, self.kpool, self.tail = cfg.index_topk, cfg.index_kpool, cfg.index_kpool_always_select_tail
        self.wq_b = Linear(cfg.q_lora_rank, nh * d, dtype, device)
        self.wk = Linear(cfg.hidden_size, d, dtype, device)
        self.k_norm = LayerNormWB(d, 1e-6, dtype, device)
        self.weights_proj = Linear(cfg.hidden_size, nh, dtype, device)
        self.index_kpool_compress_ape = _param(self.kpool, d, dtype=dtype, device=device)
        self.index_kpool_compress_gate = _param(d, cfg.hidden_size, dtype=dtype, device=device)

    def rows(self, x: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rows the state stores: (k_normed [T, d], gate [T, d])."""
        k = self.k_norm(self.wk(x, ops))
        # a token-parallel GEMM like the others: in batch-invariant mode native.c's fixed-order dot
        gate = row_mm(ops, x.to(self.index_kpool_compress_gate.dtype), self.index_kpool_compress_gate)
        return k, gate

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, dsa, ops: Backend) -> torch.Tensor:
        """Selection [T, width] for the last T rows of `dsa` (already written and advanced)."""
        t = x.shape[0]
        q = self.wq_b(q_resid, ops).view(t, self.nh, self.d)
        w = self.weights_proj(x, ops).float() * self.nh ** -0.5
        ape = self.index_kpool_compress_ape
        return dsa_select(q, w, *dsa.readable(), ape, topk=self.topk, kpool=self.kpool, select_tail=self.tail,
                          pooled=dsa.pooled(ape, self.kpool))


class IndexedMLA(nn.Module):
    def __init__(self, cfg, full: bool, dtype: torch.dtype, device=None, tp=None):
        """`tp`: hold this rank's heads (q_b, kv_b rows, o_proj columns; sharding.py); the latent,
        the indexer and its selection are whole on every rank, the output the sum over ranks."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        h, nh = cfg.hidden_size, cfg.num_attention_heads // (tp.size if self.tp else 1)
        self.nh, self.dn, self.dv, self.lat = nh, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        self.q_a_proj = Linear(h, cfg.q_lora_rank, dtype, device)
        self.q_a_layernorm = GlmRMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device)
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * self.dn, dtype, device)
        self.kv_a_proj_with_mqa = Linear(h, self.lat, dtype, device)
        self.kv_a_layernorm = GlmRMSNorm(self.lat, cfg.rms_norm_eps, dtype, device)
        self.kv_b_proj = Linear(self.lat, nh * (self.dn + self.dv), dtype, device)
        self.o_proj = Linear(nh * self.dv, h, dtype, device)
        self.indexer = DsaIndexer(cfg, dtype, device) if full else None

    def forward(self, x: torch.Tensor, start: int, latent, dsa, prev_sel: torch.Tensor | None, ops: Backend):
        """x [T, hidden] at positions start..start+T-1; `latent` [capacity, kv_lora] rows (written
        here at [start, start+T); float8_e4m3fn in an FP8 KV state); `dsa` this full layer's
        Glm5NextDsaState (len == start on entry, advanced by T here) or None for a shared layer,
        which reads `prev_sel`. Returns (y [T, hidden], selection [T, width]).

        Every query reads the latent rows (its chunk's own included) back from `latent`, so with
        FP8 storage a row attends as it will in any later call: the chunking changes nothing."""
        t = x.shape[0]
        if dsa is not None:
            dsa.ensure_room(t)  # the seed's writer rule: before anything is computed or written
        q_resid, q, c = self.project(x, ops)
        latent[start:start + t] = e4m3_saturate(c) if latent.dtype == KV_FP8 else c
        if self.indexer is not None:
            k, gate = self.indexer.rows(x, ops)
            dsa.write_rows(start, k, gate)
            dsa.advance(t)
            sel = self.indexer.select(x, q_resid, dsa, ops)
        else:
            sel = prev_sel
        seq = start + t
        q_lat = absorbed_q(self, q, ops)  # [T, H, lat]
        rows, valid = _selected_rows(sel, seq)  # [T, W] each query's distinct selected rows
        pooled = torch.empty_like(q_lat)
        # gather only the selected latent rows (sparse for real), a block of queries at a time
        block = max(1, _GATHER_BUDGET // max(1, rows.shape[1] * self.lat))
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            pooled[b0:b1] = self.pool_latent(q_lat[b0:b1], latent[rows[b0:b1]], valid[b0:b1])
        return self.output(pooled, ops), sel

    def project(self, x: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-parallel: (q_resid [T, q_lora], q [T, H, dn], latent rows c [T, kv_lora])."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x, ops), ops)
        q = self.q_b_proj(q_resid, ops).view(x.shape[0], self.nh, self.dn)
        return q_resid, q, self.kv_a_layernorm(self.kv_a_proj_with_mqa(x, ops), ops)

    def pool_latent(self, q_lat: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each query's softmax over its latent rows keys [b, W, lat] (valid [b, W]): [b, H, lat]."""
        keys = keys.to(q_lat.dtype)
        scores = torch.bmm(q_lat, keys.transpose(1, 2)) * self.scale  # [b, H, W]
        scores = scores.masked_fill(~valid[:, None, :], torch.finfo(scores.dtype).min)
        p = torch.softmax(scores.float(), dim=-1).to(q_lat.dtype)
        return torch.bmm(p, keys.to(p.dtype))

    def output(self, pooled: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Token-parallel: W_UV on the pooled latents [T, H, lat], then o_proj: [T, hidden]."""
        o = absorbed_v(self, pooled, ops)
        y = self.o_proj(o.reshape(pooled.shape[0], self.nh * self.dv), ops)
        return y if self.tp is None else self.tp.all_reduce_sum(y)

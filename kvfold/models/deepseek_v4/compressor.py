"""The V4 compressor: token rows -> one pooled entry per `ratio` tokens (CSA overlapping, HCA not).

Per token: kv = wkv.x, score = wgate.x + ape[p mod r] (fp32). Entry w is emitted in the step of
position (w+1)r - 1, pooled with a per-channel softmax, RMS-normed, rotated at position w*r, and
written to row w of the pool. The rows of a window still open at the end of a chunk stay in the
state's position ring, so the next chunk (of any length, decode included) continues mid-window.
"""
from __future__ import annotations

import torch
from torch import nn

from ...numerics import RopeTable, apply_rope, pool_windows
from ...numerics.backend import Backend
from ...numerics.quant import fp4_e2m1_simulate, fp8_e4m3_simulate, hadamard
from .state import CompressorState
from ...layers.basic import Linear, Norm, _param


class Compressor(nn.Module):
    # reference numerics: how the official code rounds an emitted entry before storing it
    entry_sim = None  # None | "fp8" (attention compressor: nope dims) | "hadamard_fp4" (indexer)

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, rope_dim: int, eps: float, device=None):
        super().__init__()
        m = 2 if overlap else 1
        self.ratio, self.overlap, self.width, self.rope_dim = ratio, overlap, width, rope_dim
        # compressor projections, ape and norm stay fp32 whatever the model dtype (as REF keeps them)
        self.kv_proj = Linear(hidden, m * width, torch.float32, device)
        self.gate_proj = Linear(hidden, m * width, torch.float32, device)
        self.position_bias = _param(ratio, m * width, dtype=torch.float32, device=device)
        self.kv_norm = Norm(width, eps, device)

    def step(self, x: torch.Tensor, start: int, st: CompressorState, rope: RopeTable, ops: Backend) -> None:
        """Consume the rows of positions [start, start + T) (x: [T, hidden])."""
        positions = None if x.shape[0] == 1 else torch.arange(start, start + x.shape[0], device=x.device)
        self.fold(*self.project(x, positions, start, ops), start, st, rope, ops)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None, first: int | None, ops: Backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-parallel half: (kv, score) rows [T, m * width] fp32 for x [T, hidden] at `positions`
        (a single row may give its position as `first` instead, else None)."""
        kv = self.kv_proj(x, ops)
        score = self.gate_proj(x, ops)
        kv = kv if kv.dtype == torch.float32 else kv.float()
        score = score if score.dtype == torch.float32 else score.float()
        if x.shape[0] == 1 and first is not None:
            return kv, score + self.position_bias[first % self.ratio]
        return kv, score + self.position_bias[positions % self.ratio]

    def fold(self, kv: torch.Tensor, score: torch.Tensor, start: int, st: CompressorState,
             rope: RopeTable, ops: Backend) -> None:
        """One sequence's half: take the (kv, score) rows of positions [start, start + T); emit every
        entry whose window completes inside them into `st.pool`; leave the open rows in the ring."""
        t = kv.shape[0]
        r = self.ratio
        first_w, end_w = start // r, (start + t) // r
        if end_w > first_w:
            base = first_w * r - (r if self.overlap else 0)  # first position the fold reads
            need_end = end_w * r
            parts_kv, parts_sc = [], []
            if base < 0:  # window 0 has no previous window: empty slots, weight 0
                parts_kv.append(kv.new_zeros(-base, kv.shape[1]))
                parts_sc.append(kv.new_full((-base, kv.shape[1]), float("-inf")))
            old_from = max(base, 0)
            parts_kv.append(st.kv.read(old_from, start))
            parts_sc.append(st.score.read(old_from, start))
            parts_kv.append(kv[: need_end - start])
            parts_sc.append(score[: need_end - start])
            pooled = pool_windows(ops, torch.cat(parts_kv), torch.cat(parts_sc), r, self.overlap)
            entries = self.kv_norm(pooled.to(st.pool.dtype), ops)  # cast to the activation dtype, then norm
            cos, sin = rope.cos_sin(ops, torch.arange(first_w, end_w, device=kv.device) * r)
            st.pool[first_w:end_w] = self._simulate(apply_rope(ops, entries, cos, sin))
        st.kv.write(start, kv)
        st.score.write(start, score)

    def _simulate(self, entries: torch.Tensor) -> torch.Tensor:
        if self.entry_sim == "fp8":
            return simulate_kv_fp8(entries, self.width - self.rope_dim)
        if self.entry_sim == "hadamard_fp4":
            return fp4_e2m1_simulate(hadamard(entries), 32)
        return entries


def simulate_kv_fp8(kv: torch.Tensor, nope: int) -> torch.Tensor:
    """REF target: FP8-e4m3 simulation of the non-rope dims in blocks of 64, power-of-two scales."""
    return torch.cat([fp8_e4m3_simulate(kv[..., :nope], 64), kv[..., nope:]], dim=-1)

"""DeepSeek-V4's multi-token-prediction (MTP) block, used as a speculative drafter.

At position t it reads the main model's final streams H_t and the embedding of token t+1 and
predicts token t+2:  X_k = e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(H_t,k)); then one
full block (sliding-window attention with the plain-theta RoPE, score-routed MoE), its own
hc_head and norm, and the shared `lm_head`. It keeps its own sliding-window state, which
rewinds like the main one. `checkpoint.py` loads the `mtp.0.*` tensors (official layout or
transformers block names) straight into this module.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .config import SLIDING, Dsv4Config
from ...layers.basic import Linear, Norm
from ...layers.mhc import HyperHead
from ...layers.rows import RowBatch
from ...numerics.backend import Backend
from .state import Dsv4State, LayerState
from ...state.rings import PositionRing

DECODE_ROWS = 8  # the most rows an update runs as decode rows


def mtp_block_config(cfg: Dsv4Config) -> Dsv4Config:
    """The MTP block is one sliding-window layer with score-routed MoE."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(SLIDING,), compress_ratios=(0,),
                               mlp_layer_types=("moe",))


class MtpModule(nn.Module):
    def __init__(self, cfg: Dsv4Config, dtype: torch.dtype, device: torch.device, tp=None):
        super().__init__()
        from .model import Block  # the same block code as the main model (sharded the same way under tp)
        self.cfg = mtp_block_config(cfg)
        self.dtype, self.device = dtype, device
        h = cfg.hidden_size
        self.e_proj = Linear(h, h, dtype, device)
        self.h_proj = Linear(h, h, dtype, device)
        self.enorm = Norm(h, cfg.rms_norm_eps, device)
        self.hnorm = Norm(h, cfg.rms_norm_eps, device)
        self.norm = Norm(h, cfg.rms_norm_eps, device)
        self.hc_head = HyperHead(cfg.hc_mult, h, cfg.hc_eps, cfg.rms_norm_eps, device)
        self.block = Block(self.cfg, 0, dtype, device, tp)
        self.fingerprint = "mtp-" + self.cfg.fingerprint()[:12]

    def new_state(self, capacity: int, max_rewind: int) -> Dsv4State:
        ring = PositionRing(self.cfg.sliding_window + max_rewind, self.cfg.head_dim, self.dtype, self.device)
        return Dsv4State([LayerState(window=ring)], window=self.cfg.sliding_window, capacity=capacity,
                         max_rewind=max_rewind, fingerprint=self.fingerprint, device=self.device, dtype=self.dtype)

    def state_bytes(self, capacity: int, max_rewind: int) -> int:
        """`new_state(capacity, max_rewind).nbytes`, from the config: one window ring."""
        return (self.cfg.sliding_window + max_rewind) * self.cfg.head_dim * self.dtype.itemsize

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: Dsv4State, embed,
                lm_head: nn.Module, rope, ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hc, d] (main streams at positions pos..pos+T-1), next_ids [T] (the tokens one
        position later) -> (logits [T, vocab] predicting two positions ahead, output streams [T, hc, d]),
        with the kernels of `ops` (the main model's Backend)."""
        from ...errors import CapacityError
        state.check_usable(self.fingerprint, self.device, self.dtype)
        t = next_ids.numel()
        if state.pos + t > state.capacity:
            raise CapacityError(f"MTP state capacity {state.capacity} exceeded at pos {state.pos} + {t}")
        e = self.e_proj(self.enorm(embed(next_ids), ops), ops)
        x = e[:, None, :] + self.h_proj(self.hnorm(hidden.to(self.dtype), ops), ops)
        # a few rows (a step's accepted tokens) as decode rows, one after another: they take the
        # decode step's one native call (native_block.py); a long catch-up as one chunk
        rowwise = frozenset((id(state),)) if t <= DECODE_ROWS else frozenset()
        batch = RowBatch.build([(next_ids, state)], self.device, ops, decode_rows=rowwise)
        batch.rope[SLIDING] = (rope, *rope.cos_sin(ops, batch.positions))
        if batch.rows > t:  # pad rows (see layers/rows.py)
            x = torch.cat([x, x.new_zeros(batch.rows - t, *x.shape[1:])])
        streams = self.block(x, batch)[:t]
        state.pos = state.written_until = state.pos + t
        logits = lm_head(self.norm(self.hc_head(streams, ops), ops), ops).float()
        return logits, streams

    def step(self, main: nn.Module, hidden: torch.Tensor, token_ids, state: Dsv4State, ops: Backend
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the embedding, lm_head and RoPE of `main`, the Dsv4Model this block
        belongs to (the body of `Dsv4Model.mtp_step`), and `ops`, a Backend of `main`;
        `token_ids`: a list or a LongTensor."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=main.device)
        return self(hidden, ids, state, main._embed_at_head, main.lm_head, main.rope_main, ops)


def official_mtp_weights(mtp: MtpModule) -> dict[str, torch.Tensor]:
    """The module's weights under the official `mtp.0.*` names (how checkpoints carry MTP)."""
    from .names import to_official_names
    out = {}
    inter = mtp.cfg.moe_intermediate_size
    for name, t in mtp.state_dict().items():
        for key, expert, part in to_official_names("mtp." + name, mtp.cfg.n_routed_experts):
            if expert is None:
                out[key] = t
            elif part == "w2":
                out[key] = t[expert]
            else:
                out[key] = t[expert, :inter] if part == "w1" else t[expert, inter:]
    return {k: v.contiguous().clone() for k, v in out.items()}

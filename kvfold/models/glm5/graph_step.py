"""A GLM-5.3 decode step that a CUDA graph can capture: one token for each of N sequences.

As DeepSeek-V4's (models/deepseek_v4/graph_step.py, whose docstring says why): every shape
follows from N and the step's `context` bound, every changing value is read from a device tensor
(tokens, positions, slots, the arena's page tables), and nothing is read back to the host.
  * KDA: each row's conv state and recurrent state are its slot's, at its position (the arena
    holds them at max_rewind 0: no base to replay from). The recurrence is `kda_chunked` itself,
    one single-token chunk per row (`torch.vmap`); the conv and gates are the layer's own.
  * Full DSA layers: each row's indexer rows [0, context) of its slot, those at or past its
    sequence length masked (`dsa_select_last`), and the MLA over the latent rows selected.
  * Shared DSA layers reuse the last full layer's selection, as in the forward.
The MoE gathers each row's experts (`Experts.gathered`). The cursors move on the host afterwards
(`Glm5State.after_graph_step`: the indexer states' `sync_to`, the KDA base).
"""
from __future__ import annotations

import torch

from ...layers.basic import QuantizedWeight
from ...layers.mhc import HyperConnection
from ...layers.moe import SwiGluMLP
from ...state.arena import ArenaRows, RingSpec, SlotArena
from ...state.pages import LATENT
from .config import KDA, Glm5Config
from .dsa_select import dsa_select_last
from .kda import kda_chunked
from .mla import _selected_rows


def arena_specs(cfg: Glm5Config, dtype: torch.dtype, kda_heads: int, dsa_rows: int) -> list[RingSpec]:
    """Every buffer a GLM-5.3 state holds outside its paged latent rows, at max_rewind 0, as
    `new_state` sizes and fills them: per KDA layer the conv and recurrent states, per full DSA
    layer the indexer rows (`dsa_rows` of them: the capacity in whole k-pools)."""
    specs = []
    c, dk = kda_heads * cfg.linear_head_dim, cfg.linear_head_dim
    for i, kind in enumerate(cfg.layer_types):
        if kind == KDA:
            specs += [RingSpec((i, "conv"), cfg.linear_conv_kernel_dim - 1, 3 * c, dtype),
                      RingSpec((i, "rec"), kda_heads * dk, dk, torch.float32)]
        elif cfg.indexer_types[i] == "full":
            specs += [RingSpec((i, "dsa_k"), dsa_rows, cfg.index_head_dim, dtype),
                      RingSpec((i, "dsa_gate"), dsa_rows, cfg.index_head_dim, dtype),
                      RingSpec((i, "dsa_valid"), dsa_rows, 1, torch.uint8)]
    return specs


def graph_unsupported(model) -> str | None:
    """Why `decode_step` cannot run this model (None: it can)."""
    if model.tp is not None:
        return "graph decode runs one rank's whole model; tensor parallelism is not supported"
    if getattr(model, "batch_invariant", False):
        return ("graph decode runs torch's kernels, which promise no batch invariance; "
                "set_batch_invariant(False) (Engine(batch_invariant=False))")
    for layer in model.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if ex is not None and any(isinstance(w, QuantizedWeight) for w in (ex.gate_up_proj, ex.down_proj)):
            return "graph decode gathers each row's experts from plain stacks; load the model with weights='dequant'"
    return None


@torch.no_grad()
def decode_step(model, arena: SlotArena, tokens: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, context: int | None = None) -> torch.Tensor:
    """Row n: the token tokens[n] at position positions[n] of the state in arena slot slots[n].
    Writes each row's KDA states, latent and indexer rows, and returns (logits [N, vocab] fp32,
    the final streams [N, hc, hidden]).
    `context`: a bound on every position + 1 (default the arena's capacity)."""
    from .model import stream_mean
    cfg = model.config
    rows = ArenaRows(arena, positions, slots, arena.capacity if context is None else context)
    streams = model.model.embed_tokens(tokens)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    sel = None  # the last full DSA layer's selection, shared down the layers
    for i, block in enumerate(model.model.layers):
        x, post, comb = block.attn_hc.collapse(streams)
        x = block.input_layernorm(x)
        if block.kind == KDA:
            y = _kda(block.self_attn, x, rows, i)
        else:
            y, sel = _mla(block.self_attn, x, rows, i, sel)
        streams = HyperConnection.expand(streams, y, post, comb)
        x, post, comb = block.ffn_hc.collapse(streams)
        x = block.post_attention_layernorm(x)
        y = block.mlp(x) if isinstance(block.mlp, SwiGluMLP) else _moe(block.mlp, x)
        streams = HyperConnection.expand(streams, y, post, comb)
    return model.lm_head(model.model.norm(stream_mean(streams))).float(), streams


def _single_chunk(q, k, v, g, beta, s0):
    return kda_chunked(q, k, v, g, beta, s0, starts=[0])[:2]


def _kda(attn, x: torch.Tensor, rows: ArenaRows, i: int) -> torch.Tensor:
    """KdaAttention.forward of one token per row from its slot's states, which it then replaces."""
    n = x.shape[0]
    conv_all, rec_all = rows.arena.rings[(i, "conv")], rows.arena.rings[(i, "rec")]
    conv = conv_all.index_select(0, rows.slots)  # [N, K-1, 3C]
    rec = rec_all.index_select(0, rows.slots).view(n, attn.nh, attn.dk, attn.dk)
    full = torch.cat([conv.to(x.dtype), attn.mixed(x)[:, None, :]], dim=1)  # [N, K, 3C]
    q, k, v, g, beta = attn.recurrence_inputs(x, full)  # [N, H, .]: one token of each sequence
    o, s = torch.vmap(_single_chunk)(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], rec.float())
    conv_all[rows.slots] = full[:, 1:].to(conv_all.dtype)
    rec_all[rows.slots] = s.reshape(n, -1, attn.dk)
    return attn.output(x, o[:, 0])


def _mla(mla, x: torch.Tensor, rows: ArenaRows, i: int, prev_sel: torch.Tensor | None):
    """IndexedMLA.forward of one token per row: its latent row into the pages, its indexer row
    into its slot (full layers), the selection, the attention over the selected latent rows."""
    p = rows.positions
    q_resid, q, c = mla.project(x)
    latent, per = rows.pool(i, LATENT, 1)
    latent[rows.entry_rows(p[:, None], per)[:, 0]] = c.to(latent.dtype)
    seq = p + 1
    if mla.indexer is not None:
        ix = mla.indexer
        k_rows, gate_rows = ix.rows(x)
        bufs = [rows.arena.rings[(i, part)] for part in ("dsa_k", "dsa_gate", "dsa_valid")]
        bufs[0][rows.slots, p] = k_rows.to(bufs[0].dtype)
        bufs[1][rows.slots, p] = gate_rows.to(bufs[1].dtype)
        bufs[2][rows.slots, p] = 1
        span = min(bufs[0].shape[1], rows.context)  # the rows a position below `context` may select
        k_all, gate_all, valid_all = (b.index_select(0, rows.slots)[:, :span] for b in bufs)
        qi = ix.wq_b(q_resid).view(x.shape[0], ix.nh, ix.d)
        w = ix.weights_proj(x).float() * ix.nh ** -0.5
        sel = dsa_select_last(qi, w, k_all, gate_all, valid_all[..., 0], ix.index_kpool_compress_ape, seq,
                              topk=ix.topk, kpool=ix.kpool, select_tail=ix.tail)
    else:
        sel = prev_sel
    w_uk, w_uv = mla.absorbed()
    q_lat = torch.einsum("thd,hdl->thl", q, w_uk.to(q.dtype))
    sel_rows, valid = _selected_rows(sel, seq[:, None])
    keys = latent[rows.entry_rows(sel_rows, per)]  # [N, W, lat]
    return mla.output(mla.pool_latent(q_lat, keys, valid), w_uv), sel


def _moe(moe, x: torch.Tensor) -> torch.Tensor:
    """Glm5MoE.forward with no host-side grouping (`Experts.gathered`)."""
    weights, ids = moe.gate(x)
    y = moe.experts.gathered(x, weights, ids)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x).float()
    return y.to(x.dtype)

"""A GLM-5.3 decode step that a CUDA graph can capture: one token for each of N sequences.

As DeepSeek-V4's (models/deepseek_v4/graph_step.py, whose docstring says why): every shape
follows from N and the step's `context` bound, every changing value is read from a device tensor
(tokens, positions, slots, the arena's page tables), and nothing is read back to the host.
  * KDA runs the plan a forward of the sequence's rows would (`Glm5State.graph_inputs`, from
    `_kda_begin`): the state at the start replayed from the base over the held inputs, then the
    rows one after another, each a single-token chunk of `kda_chunked` itself (`torch.vmap`),
    the loops masked to each sequence's counts; then the inputs are stored and the state at the
    new base kept, as `_kda_forward` does. The conv and gates are the layer's own.
  * Full DSA layers: each row's indexer rows [0, context) of its slot, those at or past its
    sequence length masked (`dsa_select_last`), and the MLA over the latent rows selected.
  * Shared DSA layers reuse the last full layer's selection, as in the forward.
A sequence may bring several rows at consecutive positions (a verify step), at most max_rewind
+ 1. The MoE gathers each row's experts (`Experts.gathered`). The cursors move on the host
afterwards (`Glm5State.after_graph_step`: the indexer states' `sync_to`, the KDA plan's commit).
"""
from __future__ import annotations

import torch

from ...layers.mhc import HyperConnection
from ...layers.moe import SwiGluMLP
from ...numerics.backend import Backend
from ...numerics.hc import stream_mean
from ...state.arena import ArenaRows, RingSpec, SlotArena
from ...state.pages import LATENT
from .config import KDA, Glm5Config
from .absorb import absorbed_q
from .dsa_select import dsa_select_last
from .kda import kda_chunked
from .mla import _selected_rows
from .state import kda_ring_sizes


def arena_specs(cfg: Glm5Config, dtype: torch.dtype, kda_heads: int, dsa_rows: int, max_rewind: int
                ) -> list[RingSpec]:
    """Every buffer a GLM-5.3 state holds outside its paged latent rows, as `new_state` sizes and
    fills them: per KDA layer the conv and recurrent states at the base and, with max_rewind, the
    rings of the recurrence's inputs and the pre-conv rows (state.py); per full DSA layer the
    indexer rows (`dsa_rows` of them: the capacity in whole k-pools)."""
    specs = []
    c, dk = kda_heads * cfg.linear_head_dim, cfg.linear_head_dim
    n_in, n_mix = kda_ring_sizes(max_rewind, cfg.linear_conv_kernel_dim)
    for i, kind in enumerate(cfg.layer_types):
        if kind == KDA:
            specs += [RingSpec((i, "conv"), cfg.linear_conv_kernel_dim - 1, 3 * c, dtype),
                      RingSpec((i, "rec"), kda_heads * dk, dk, torch.float32)]
            if n_in:
                specs += [RingSpec((i, "k"), n_in, c, torch.float32), RingSpec((i, "g"), n_in, c, torch.float32),
                          RingSpec((i, "v"), n_in, c, dtype), RingSpec((i, "beta"), n_in, kda_heads, torch.float32),
                          RingSpec((i, "mixed"), n_mix, 3 * c, dtype)]
        elif cfg.indexer_types[i] == "full":
            specs += [RingSpec((i, "dsa_k"), dsa_rows, cfg.index_head_dim, dtype),
                      RingSpec((i, "dsa_gate"), dsa_rows, cfg.index_head_dim, dtype),
                      RingSpec((i, "dsa_valid"), dsa_rows, 1, torch.uint8)]
    return specs


@torch.no_grad()
def decode_step(model, ops: Backend, arena: SlotArena, tokens: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, context: int | None = None, extras: torch.Tensor | None = None):
    """Row n: the token tokens[n] at position positions[n] of the state in arena slot slots[n].
    Writes each row's KDA states, latent and indexer rows, and returns (logits [N, vocab] fp32,
    the final streams [N, hc, hidden]). `ops`: the model's Backend for the step's mode, passed to
    every layer and op as the forward does.
    `context`: a bound on every position + 1 (default the arena's capacity). `extras` [N, 4]: each
    row's sequence's KDA plan (`Glm5State.graph_inputs`: start, base, new base, end); None: one
    row a sequence, at max_rewind 0."""
    cfg = model.config
    rows = ArenaRows(arena, positions, slots, arena.capacity if context is None else context)
    streams = model.model.embed_tokens(tokens)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    sel = None  # the last full DSA layer's selection, shared down the layers
    for i, block in enumerate(model.model.layers):
        x, post, comb = block.attn_hc.collapse(streams, ops)
        x = block.input_layernorm(x, ops)
        if block.kind == KDA:
            y = _kda(ops, block.self_attn, x, rows, i, extras)
        else:
            y, sel = _mla(ops, block.self_attn, x, rows, i, sel)
        streams = HyperConnection.expand(streams, y, post, comb, ops)
        x, post, comb = block.ffn_hc.collapse(streams, ops)
        x = block.post_attention_layernorm(x, ops)
        y = block.mlp(x, ops) if isinstance(block.mlp, SwiGluMLP) else _moe(ops, block.mlp, x)
        streams = HyperConnection.expand(streams, y, post, comb, ops)
    return model.lm_head(model.model.norm(stream_mean(streams), ops), ops).float(), streams


def _single_chunk(q, k, v, g, beta, s0):
    return kda_chunked(q, k, v, g, beta, s0, starts=[0])[:2]


def _single_state(k, v, g, beta, s0):
    return kda_chunked(None, k, v, g, beta, s0, starts=[0])[1]


def _kda(ops: Backend, attn, x: torch.Tensor, rows: ArenaRows, i: int, extras: torch.Tensor | None
         ) -> torch.Tensor:
    """KdaAttention.forward of each row's token, as `Glm5State._kda_forward` runs the planned
    forward of a sequence's rows: the state at its start replayed from the base over the inputs
    held (single-token chunks, masked to the plan's count), the rows one after another, then the
    inputs stored and the state at the new base kept."""
    ring = {part: rows.arena.rings[(i, part)] for part in ("conv", "rec", "k", "g", "v", "beta", "mixed")
            if (i, part) in rows.arena.rings}
    n, km1, h, dk = x.shape[0], attn.kw - 1, attn.nh, attn.dk
    p, sl = rows.positions, rows.slots
    start, base, nb, end = extras.unbind(1) if extras is not None else (p, p, p + 1, p + 1)
    offset = p - start
    col = lambda t: t[:, None, None, None]  # noqa: E731  (a row mask over states [N, H, dk, dv])
    mixed = attn.mixed(x, ops)
    full = torch.cat([_conv_rows(ring, rows, mixed, p, start, base, km1), mixed[:, None, :]], dim=1)
    q, k, v, g, beta = attn.recurrence_inputs(x, full, ops)
    rec = ring["rec"].index_select(0, sl).view(n, h, dk, dk)
    kept = rec  # the state at the new base where that is at or below the start
    n_in = ring["k"].shape[1] if "k" in ring else 0
    for j in range(n_in):  # replay: the base's state up to the start
        at = base + j
        held = [ring[part][sl, at % n_in].view(n, -1, dk).float() for part in ("k", "v", "g")]
        beta_at = ring["beta"][sl, at % n_in].float()
        after = torch.vmap(_single_state)(*(t[:, None] for t in held), beta_at[:, None], rec)
        live = at < start
        rec = torch.where(col(live), after, rec)
        kept = torch.where(col(live & (at + 1 == nb)), after, kept)
    out = torch.zeros(n, h, dk, dtype=torch.float32, device=x.device)
    state = rec
    for j in range(n_in + 1):  # the rows, one after another (row j of a sequence follows row j - 1)
        prev = torch.where(col(offset == 0), rec, torch.cat([state[:1], state[:-1]]))
        o, after = torch.vmap(_single_chunk)(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], prev)
        now = offset == j
        state = torch.where(col(now), after, state)
        out = torch.where(now[:, None, None], o[:, 0], out)
    # keep: the inputs of the last n_in positions, the pre-conv rows, the state at the new base
    scratch = rows.arena.scratch
    if n_in:
        into = torch.where(p >= end - n_in, sl, scratch), p % n_in
        for part, t in (("k", k), ("g", g), ("v", v), ("beta", beta)):
            ring[part][into] = t.reshape(n, -1).to(ring[part].dtype)
        ring["mixed"][sl, p % ring["mixed"].shape[1]] = mixed.to(ring["mixed"].dtype)
    below = nb <= start
    writer = (below & (offset == 0)) | (~below & (p + 1 == nb))
    at_nb = torch.where(below[:, None, None], _conv_rows(ring, rows, mixed, nb, start, base, km1), full[:, 1:])
    target = torch.where(writer, sl, scratch)
    ring["conv"][target] = at_nb.to(ring["conv"].dtype)
    ring["rec"][target] = torch.where(col(below), kept, state).reshape(n, -1, dk)
    return attn.output(x, out, ops)


def _conv_rows(ring: dict, rows: ArenaRows, mixed: torch.Tensor, at: torch.Tensor, start: torch.Tensor,
               base: torch.Tensor, km1: int) -> torch.Tensor:
    """The pre-conv rows of positions at - K + 1 .. at - 1 [N, K-1, 3C], as `Glm5State._kda_conv`
    finds them: this step's rows (positions >= start; a sequence's rows are consecutive), the
    `mixed` ring (>= the base) or the base's conv state."""
    n, sl = mixed.shape[0], rows.slots
    here = torch.arange(n, device=mixed.device)
    parts = []
    for j in range(km1):
        pos = at - km1 + j
        own = mixed[(here - (rows.positions - pos)).clamp(min=0, max=n - 1)]
        old = ring["conv"][sl, (pos - base + km1).clamp(min=0, max=km1 - 1)]
        if "mixed" in ring:
            held = ring["mixed"][sl, pos % ring["mixed"].shape[1]]
            old = torch.where((pos >= base)[:, None], held, old)
        parts.append(torch.where((pos >= start)[:, None], own, old.to(mixed.dtype)))
    return torch.stack(parts, dim=1)


def _mla(ops: Backend, mla, x: torch.Tensor, rows: ArenaRows, i: int, prev_sel: torch.Tensor | None):
    """IndexedMLA.forward of one token per row: its latent row into the pages, its indexer row
    into its slot (full layers), the selection, the attention over the selected latent rows."""
    p = rows.positions
    q_resid, q, c = mla.project(x, ops)
    latent, per = rows.pool(i, LATENT, 1)
    latent[rows.entry_rows(p[:, None], per)[:, 0]] = c.to(latent.dtype)
    seq = p + 1
    if mla.indexer is not None:
        ix = mla.indexer
        k_rows, gate_rows = ix.rows(x, ops)
        bufs = [rows.arena.rings[(i, part)] for part in ("dsa_k", "dsa_gate", "dsa_valid")]
        bufs[0][rows.slots, p] = k_rows.to(bufs[0].dtype)
        bufs[1][rows.slots, p] = gate_rows.to(bufs[1].dtype)
        bufs[2][rows.slots, p] = 1
        span = min(bufs[0].shape[1], rows.context)  # the rows a position below `context` may select
        k_all, gate_all, valid_all = (b.index_select(0, rows.slots)[:, :span] for b in bufs)
        qi = ix.wq_b(q_resid, ops).view(x.shape[0], ix.nh, ix.d)
        w = ix.weights_proj(x, ops).float() * ix.nh ** -0.5
        sel = dsa_select_last(qi, w, k_all, gate_all, valid_all[..., 0], ix.index_kpool_compress_ape, seq,
                              topk=ix.topk, kpool=ix.kpool, select_tail=ix.tail)
    else:
        sel = prev_sel
    q_lat = absorbed_q(mla, q, ops)
    sel_rows, valid = _selected_rows(sel, seq[:, None])
    keys = latent[rows.entry_rows(sel_rows, per)]  # [N, W, lat]
    return mla.output(mla.pool_latent(q_lat, keys, valid), ops), sel


def _moe(ops: Backend, moe, x: torch.Tensor) -> torch.Tensor:
    """Glm5MoE.forward with no host-side grouping (`Experts.gathered`)."""
    weights, ids = moe.gate(x, ops)
    y = moe.experts.gathered(x, weights, ids, ops)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x, ops).float()
    return y.to(x.dtype)

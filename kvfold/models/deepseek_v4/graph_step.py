"""A DeepSeek-V4 decode step that a CUDA graph can capture: N rows, each a token of a sequence.

A sequence may bring several rows, at consecutive positions in ascending order (a verify step:
its last token and drafts), at most max_rewind + 1 of them: each layer writes every row's window,
compressor and pool rows before any row reads, so a row sees its sequence's earlier rows of the
step as the forward's chunk does, and the rings' max_rewind slack keeps what the first row reads.

A captured graph replays fixed kernels on fixed addresses. So this step's every shape follows
from N and the arena alone, and every value that changes between steps is read from a device
tensor: the tokens, the positions, the slots, and the page tables the arena holds. Nothing is
read back to the host. The forward (model.py) instead takes its sizes from each sequence's
`pos`: how many window rows exist, whether a compressor window closes, how many entries the
indexer scores. Here each of these is a mask over the largest case:
  * window: a query at p reads ring slots of positions p - W + 1 .. p, those before 0 masked;
  * compressors: every step pools the rows of the window holding p, and writes the entry to its
    pool row only where p closes it (position p = (w + 1) r - 1); elsewhere the write goes to
    the scratch page;
  * indexer and HCA: score every entry of the positions below the step's `context` bound (a
    power of two the caller picks), and mask those not yet visible.
The attention core (`sink_attention`), the pooling (`pool_windows`), the projections, mHC, norms
and the top-k rule are the forward's own functions. The per-row work differs only in sizes and in
masked terms, whose softmax weight is exactly 0, so a row's values agree with the forward's to
rounding. Replays of one captured graph give the same bits as this function run eagerly on the
same inputs. `Dsv4Model.graph_unsupported` says which models cannot take the step.

The engine's `DecodeGraphs` (engine/graphs.py) captures it per batch bucket and replays it.
"""
from __future__ import annotations

import torch

from ...layers.mhc import HyperConnection
from ...numerics import apply_rope, pool_windows, topk_lower_index
from ...numerics.backend import Backend
from ...state.arena import ArenaRows, RingSpec, SlotArena
from ...state.pages import COMPRESSOR, INDEXER
from .attention import sink_attention
from .config import CSA, SLIDING, Dsv4Config
from .indexer import index_scores
from .state import compressor_ring_rows


def arena_specs(cfg: Dsv4Config, dtype: torch.dtype, max_rewind: int) -> list[RingSpec]:
    """Every ring a V4 state holds outside its pools, as `new_state` sizes and fills them."""
    specs = []
    for i, (kind, ratio) in enumerate(zip(cfg.layer_types, cfg.compress_ratios)):
        specs.append(RingSpec((i, "window"), cfg.sliding_window + max_rewind, cfg.head_dim, dtype))
        for pool_kind, width in ((COMPRESSOR, cfg.head_dim), (INDEXER, cfg.index_head_dim)):
            if kind == SLIDING or (pool_kind == INDEXER and kind != CSA):
                continue
            rows, m = compressor_ring_rows(ratio, kind == CSA, max_rewind), 2 if kind == CSA else 1
            specs += [RingSpec((i, pool_kind, "kv"), rows, m * width, torch.float32, 0.0),
                      RingSpec((i, pool_kind, "score"), rows, m * width, torch.float32, float("-inf"))]
    return specs


@torch.no_grad()
def decode_step(model, ops: Backend, arena: SlotArena, tokens: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, context: int | None = None) -> torch.Tensor:
    """Row n: the token tokens[n] at position positions[n] of the state in arena slot slots[n],
    with the kernels of `ops` (the model's Backend in the caller's mode).
    Writes each row's window, compressor and pool rows, and returns (logits [N, vocab] fp32, the
    final streams [N, hc, hidden], which an MTP drafter reads).
    `context`: a bound on every position + 1 (default the arena's capacity); the indexer and HCA
    read the pool entries below it, so a step's cost follows it, not the capacity. The caller
    advances each state's cursors (`pos`, `written_until`) afterwards."""
    cfg = model.config
    rows = ArenaRows(arena, positions, slots, arena.capacity if context is None else context)
    rope = {SLIDING: (model.rope_main, *model.rope_main.cos_sin(ops, positions))}
    if any(k != SLIDING for k in cfg.layer_types):
        rope["compressed"] = (model.rope_compress, *model.rope_compress.cos_sin(ops, positions))
    streams = model.model.embed_tokens(tokens)[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    for block in model.model.layers:
        x, post, comb = block.attn_hc.collapse(streams, ops)
        y = _attention(ops, block.self_attn, block.input_layernorm(x, ops), rows, rope)
        streams = HyperConnection.expand(streams, y, post, comb, ops)
        x, post, comb = block.ffn_hc.collapse(streams, ops)
        y = _moe(ops, block.mlp, block.post_attention_layernorm(x, ops), tokens)
        streams = HyperConnection.expand(streams, y, post, comb, ops)
    return model.lm_head(model.model.norm(model.model.hc_head(streams, ops), ops), ops).float(), streams


def _attention(ops: Backend, attn, x: torch.Tensor, rows: ArenaRows, rope: dict) -> torch.Tensor:
    """Attention.forward for one decode row per sequence, with masks in place of sizes."""
    table, cos, sin = rope[SLIDING if attn.kind == SLIDING else "compressed"]
    proj = attn.project(x, rows.positions, None, cos, sin, ops)
    i, p, f32 = attn.layer_idx, rows.positions, torch.float32
    window = rows.arena.rings[(i, "window")]  # [slots + 1, W + max_rewind, D]
    ring = window.shape[1]
    # this row first: position p takes the slot of p - ring, which no query here reads (ring >= W)
    window[rows.slots, p % ring] = proj["kv"].to(window.dtype)
    wpos = p[:, None] - attn.window + 1 + torch.arange(attn.window, device=p.device)
    # each key set as (table, rows of it per query, valid): the Triton kernel reads the tables in
    # place (`ops.sparse_attention`, off by default); torch gathers the rows
    sets = [(window.view(-1, window.shape[-1]), rows.slots[:, None] * ring + wpos % ring, wpos >= 0)]
    if attn.compressor is not None:
        comp = attn.compressor
        storage, per = rows.pool(i, COMPRESSOR, attn.ratio)
        _fold(ops, comp, *proj["comp"], rows, (i, COMPRESSOR), storage, per, table)
        entries = torch.arange(rows.n_entries(attn.ratio, per), device=p.device).expand(p.shape[0], -1)
        if attn.kind == CSA:
            ix_storage, ix_per = rows.pool(i, INDEXER, attn.ratio)
            _fold(ops, comp.indexer, *proj["idx_kv"], rows, (i, INDEXER), ix_storage, ix_per, table)
            entries = _select(ops, comp.indexer, *proj["idx_q"], rows, ix_storage, ix_per)
            visible = entries >= 0
        else:
            visible = entries < ((p + 1) // attn.ratio)[:, None]
        sets.append((storage, rows.entry_rows(entries.clamp(min=0), per), visible))
    q = proj["q"].float() * attn.head_dim ** -0.5
    sinks = attn.sinks if attn.sinks.dtype == f32 else attn.sinks.float()
    kernels = ops.sparse_attention.triton
    if kernels is not None:
        (keys_w, at_w, ok_w), *comp = sets
        keys_c, at_c, ok_c = comp[0] if comp else (None, None, None)
        out = kernels.sparse_attend(q, keys_w, torch.where(ok_w, at_w, -1), keys_c,
                                    None if at_c is None else torch.where(ok_c, at_c, -1), sinks)
    else:
        keys = [_masked(table[at], ok) for table, at, ok in sets]
        out = sink_attention(q, [k if k.dtype == f32 else k.float() for k in keys], [ok for _, _, ok in sets], sinks)
    return attn.output(out, x.dtype, cos, sin, ops)


def _masked(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Keys [N, n, D] with the masked ones zeroed: their weight is 0, and a stale row of the ring
    or of a recycled page (anything at all) must not make 0 * key a NaN."""
    return torch.where(valid[..., None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))


def _fold(ops: Backend, comp, kv: torch.Tensor, score: torch.Tensor, rows: ArenaRows, key: tuple,
          storage: torch.Tensor, per: int, rope) -> None:
    """Compressor.fold for one row per sequence: keep the row in the rings, pool the window that
    holds p, and write its entry to pool row p // r where p closes it (else to the scratch page)."""
    r, p = comp.ratio, rows.positions
    ring_kv, ring_sc = rows.arena.rings[key + ("kv",)], rows.arena.rings[key + ("score",)]
    n_ring = ring_kv.shape[1]
    ring_kv[rows.slots, p % n_ring] = kv
    ring_sc[rows.slots, p % n_ring] = score
    w = p // r
    span = 2 * r if comp.overlap else r  # the window, and for CSA the one before it
    rpos = (w * r - (span - r))[:, None] + torch.arange(span, device=p.device)
    real = (rpos >= 0)[..., None]  # window 0 has no previous window: empty slots, weight 0
    where = rows.slots[:, None], rpos % n_ring
    pooled = pool_windows(ops, torch.where(real, ring_kv[where], 0.0),
                          torch.where(real, ring_sc[where], float("-inf")), r, comp.overlap)[:, 0]
    cos, sin = rope.cos_sin(ops, w * r)
    entry = comp._simulate(apply_rope(ops, comp.kv_norm(pooled.to(storage.dtype), ops), cos, sin))
    closes = (p + 1) % r == 0
    target = torch.where(closes, rows.entry_rows(w[:, None], per)[:, 0], rows.scratch_row(per))
    storage[target] = entry.to(storage.dtype)


def _select(ops: Backend, indexer, q: torch.Tensor, w: torch.Tensor, rows: ArenaRows, storage: torch.Tensor,
            per: int) -> torch.Tensor:
    """Indexer.select for one query per sequence over every entry below the step's context
    bound, the invisible ones scored -inf: [N, index_topk] entries, ascending, -1 padded."""
    n_entries = rows.n_entries(indexer.ratio, per)
    entries = torch.arange(n_entries, device=q.device)
    at = rows.entry_rows(entries.expand(q.shape[0], -1), per)  # [N, E] rows of the pool storage
    visible = (rows.positions + 1) // indexer.ratio
    kernels = ops.index_topk.triton
    if kernels is not None:  # the scores read the pool in place (`ops.index_topk`, off by default)
        return kernels.topk_lower_index(kernels.index_scores(q, w, storage, visible, rows=at), indexer.topk)
    scores = index_scores(q, w, storage[at].to(q.dtype))  # keys [N, E, d]
    scores = scores.masked_fill(entries[None, :] >= visible[:, None], float("-inf"))
    return topk_lower_index(scores.float(), indexer.topk, host_sync=False)


def _moe(ops: Backend, moe, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """MoE.forward with no host-side grouping (`Experts.gathered`)."""
    weights, ids = moe.gate(x, tokens, ops)
    y = moe.experts.gathered(x, weights, ids, ops)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x, ops).float()
    return y if y.dtype == x.dtype else y.to(x.dtype)

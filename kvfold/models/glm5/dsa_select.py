"""GLM-5.3 (`glm5_next`) DSA indexer selection with k-pools.

Pure functions over the indexer rows a `Glm5NextDsaState` holds; nothing here owns state.

Definitions (seq cached rows, kp = index_kpool, d = index_head_dim):

- `first` is the first valid row (seq if none): left padding is skipped.
- Pool P holds rows first + P*kp + s, s < kp, for P < n_pools = seq // kp. A pool is *valid*
  only if all kp slots are in range and valid, so a partial trailing pool never counts.
- Pooled key, per channel c: K_P[c] = sum_s softmax_s(gate[P,s,c] + ape[s,c]) * k[P,s,c]; the
  softmax runs in fp32 over the pool's valid slots (invalid slots have logit -inf) and is cast
  to the keys' dtype before the weighted sum. A pool with no valid slot gets key 0, not NaN.
- Score: I(q, P) = sum_h w_h * ReLU(d^-0.5 * qI_h . K_P), in fp32.
- Pool P is selectable for query q iff it is valid and its last row is <= q; the rest score
  the fp32 minimum.
- select_k = min(topk / kp, n_pools) pools per query, ranked by score descending with ties to
  the lower pool index. A pick that is not selectable (early queries of a prefill chunk: select_k
  is shared by the chunk) becomes -1 in all of its kp columns.
- Tail (always_select_tail): with `visible` = valid rows <= q, the last visible % kp of them
  (rows first + visible - tail ...), written from column select_k*kp on.

Output row: [selected pools' rows, in rank order, each pool ascending | tail | -1 ...], int32,
width topk + kp - 1 with the tail, topk without. A query whose own row is padding is all -1.
"""
from __future__ import annotations

import torch


def _first_valid(is_valid: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The first valid row of each buffer [B, S], or seq[b] when there is none: the first maximum
    of the validity (argmax's rule), found on the device (no value read back to the host)."""
    return torch.where(is_valid.any(dim=1), is_valid.to(torch.uint8).argmax(dim=1), seq)


def dsa_pool_keys(k_normed: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor,
                  kpool: int, seq: torch.Tensor | None = None, first: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate-weighted pooled keys of the complete-pool candidates.

    k_normed, gate: [seq, d]; valid: [seq] (nonzero = valid); ape: [kp, d] gate bias by slot.
    Returns (keys [n_pools, d] in k_normed's dtype, rows [n_pools, kp] long, pool_valid
    [n_pools] bool) with n_pools = seq // kp and rows[P, s] = first + P*kp + s (possibly out of
    range when `first` > 0; such a pool is invalid). Batched: k_normed, gate [B, S, d], valid
    [B, S] and `seq` [B] (buffer b's rows are its first seq[b]; the rest count as past its end)
    give every result a leading B, with n_pools = S // kp. `first` [B]: the rows pools start
    from, where the caller knows them (a state pooling its new rows: `Glm5NextDsaState.pooled`).
    """
    batched = k_normed.dim() == 3
    if not batched:
        k_normed, gate, valid = k_normed[None], gate[None], valid[None]
    b, s_rows, d = k_normed.shape
    device = k_normed.device
    if seq is None:
        seq = torch.full((b,), s_rows, dtype=torch.long, device=device)
    is_valid = (valid != 0) & (torch.arange(s_rows, device=device)[None] < seq[:, None])
    n_pools = s_rows // kpool
    first = _first_valid(is_valid, seq) if first is None else first
    rows = first[:, None, None] + torch.arange(n_pools * kpool, device=device).view(1, n_pools, kpool)
    safe = rows.clamp(max=max(s_rows - 1, 0)).flatten(1)  # [B, P * kp]
    slot_valid = (rows < seq[:, None, None]) & is_valid.gather(1, safe).view_as(rows)
    pick = safe[..., None].expand(-1, -1, d)
    logits = gate.gather(1, pick).view(b, n_pools, kpool, d).float() + ape.float()[None, None]
    logits = logits.masked_fill(~slot_valid[..., None], float("-inf"))
    # an all -inf column gives NaN: such a pool has no valid slot and its key is 0
    probs = torch.nan_to_num(torch.softmax(logits, dim=2)).to(k_normed.dtype)
    keys = (probs * k_normed.gather(1, pick).view(b, n_pools, kpool, d)).sum(dim=2)
    pool_valid = slot_valid.all(dim=2)
    return (keys, rows, pool_valid) if batched else (keys[0], rows[0], pool_valid[0])


def dsa_select(q: torch.Tensor, weights: torch.Tensor, k_normed: torch.Tensor, gate: torch.Tensor,
               valid: torch.Tensor, ape: torch.Tensor, *, topk: int, kpool: int,
               select_tail: bool = True, pooled: tuple | None = None) -> torch.Tensor:
    """Rows each of the last q_rows positions attends to (see the module docstring).

    q: [q_rows, H, d] indexer queries of positions seq - q_rows .. seq - 1 (no RoPE);
    weights: [q_rows, H] head weights, already scaled by H^-0.5;
    k_normed, gate: [seq, d]; valid: [seq]; rows [0, seq) of a state, including the queries' own;
    ape: [kp, d]. Returns int32 [q_rows, topk + kp - 1] (or [q_rows, topk] without the tail).
    `pooled`: `dsa_pool_keys` of these rows, where the caller keeps them (a state's cache).
    """
    if kpool < 1 or topk < 1 or topk % kpool:
        raise ValueError(f"need kpool >= 1 and topk a positive multiple of it, got topk {topk}, kpool {kpool}")
    q_rows, n_heads, d = q.shape
    seq = k_normed.shape[0]
    if q_rows > seq or weights.shape != (q_rows, n_heads) or gate.shape != k_normed.shape \
            or k_normed.shape[1:] != (d,) or valid.shape != (seq,) or ape.shape != (kpool, d):
        raise ValueError(f"inconsistent shapes: q {tuple(q.shape)}, weights {tuple(weights.shape)}, k_normed "
                         f"{tuple(k_normed.shape)}, gate {tuple(gate.shape)}, valid {tuple(valid.shape)}, "
                         f"ape {tuple(ape.shape)}")
    device = q.device
    if q_rows == 0:
        return torch.full((0, topk + (kpool - 1 if select_tail else 0)), -1, dtype=torch.int32, device=device)
    return _select(q, weights, k_normed[None], gate[None], valid[None], ape,
                   torch.full((1,), seq, dtype=torch.long, device=device), torch.arange(seq - q_rows, seq, device=device),
                   topk=topk, kpool=kpool, select_tail=select_tail,
                   pooled=None if pooled is None else tuple(t[None] for t in pooled))


def dsa_select_last(q: torch.Tensor, weights: torch.Tensor, k_normed: torch.Tensor, gate: torch.Tensor,
                    valid: torch.Tensor, ape: torch.Tensor, seq: torch.Tensor, *, topk: int, kpool: int,
                    select_tail: bool = True) -> torch.Tensor:
    """`dsa_select` of the last row of each of N sequences at once, with shapes that depend on the
    buffers' length S only (a graph-captured decode step): row n's rows are the first seq[n] of
    k_normed, gate [N, S, d] and valid [N, S]; the rest count as past its end. q [N, H, d],
    weights [N, H], seq [N] long (>= 1). Pools past a row's end are invalid, so `select_k` may
    count picks that come back -1, and the tail sits after them; read as a set, as the MLA does,
    the selection is `dsa_select`'s."""
    return _select(q, weights, k_normed, gate, valid, ape, seq, seq - 1, topk=topk, kpool=kpool,
                   select_tail=select_tail)


def _select(q: torch.Tensor, weights: torch.Tensor, k_normed: torch.Tensor, gate: torch.Tensor,
            valid: torch.Tensor, ape: torch.Tensor, seq: torch.Tensor, q_pos: torch.Tensor, *, topk: int,
            kpool: int, select_tail: bool, pooled: tuple | None = None) -> torch.Tensor:
    """The selection of Q queries at positions q_pos [Q] over B buffers [B, S, .] of seq [B] rows
    each: one buffer for all queries (B = 1, `dsa_select`; its [P] tensors broadcast over the
    queries) or one per query (B = Q)."""
    n_q, _, d = q.shape
    device = q.device
    out = torch.full((n_q, topk + (kpool - 1 if select_tail else 0)), -1, dtype=torch.long, device=device)
    shared = k_normed.shape[0] == 1
    of = torch.zeros(n_q, dtype=torch.long, device=device) if shared else torch.arange(n_q, device=device)
    s_rows = k_normed.shape[1]
    is_valid = (valid != 0) & (torch.arange(s_rows, device=device)[None] < seq[:, None])  # [B, S]
    visible = torch.cumsum(is_valid.long(), dim=1)[of, q_pos]  # valid rows <= q

    # pools: score every candidate, mask the ones this query cannot select
    keys, rows, pool_valid = pooled if pooled is not None else dsa_pool_keys(k_normed, gate, valid, ape, kpool, seq)
    n_pools = rows.shape[1]
    select_k = min(topk // kpool, n_pools)
    if select_k:
        kt = keys[0].float().transpose(0, 1) if shared else keys.float().transpose(1, 2)  # [d, P] or [Q, d, P]
        scores = torch.relu(torch.matmul(q.float(), kt) * d ** -0.5)  # [Q, H, P]
        index = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # [Q, P]
        selectable = pool_valid & (rows[..., -1] <= q_pos[:, None])  # [Q, P] ([1, P] broadcast)
        index = index.masked_fill(~selectable, torch.finfo(index.dtype).min)
        # a stable descending sort ranks ties by lower pool index (torch.topk leaves them undefined)
        picks = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :select_k]
        picked = rows[0][picks] if shared else rows.gather(1, picks[..., None].expand(-1, -1, kpool))
        picked = picked.masked_fill(~selectable.expand(n_q, -1).gather(1, picks)[..., None], -1)
        out[:, :select_k * kpool] = picked.flatten(1)  # [Q, select_k * kp], each pool ascending

    # tail: the visible rows past the last complete pool this query can see
    if select_tail and kpool > 1:
        first = _first_valid(is_valid, seq)[of]
        tail = visible % kpool
        offsets = torch.arange(kpool - 1, device=device)
        tail_rows = (first + visible - tail)[:, None] + offsets  # [Q, kp - 1]
        safe = tail_rows.clamp(max=s_rows - 1)
        keep = (offsets[None] < tail[:, None]) & (tail_rows < seq[of][:, None]) & is_valid[of[:, None], safe] \
            & (tail_rows <= q_pos[:, None])
        out[:, select_k * kpool:select_k * kpool + kpool - 1] = tail_rows.masked_fill(~keep, -1)

    out = out.masked_fill(~is_valid[of, q_pos][:, None], -1)  # a padded query selects nothing
    return out.to(torch.int32)


def selection_mask(indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Read a selection [Q, W] as a set per query: bool [Q, kv_len], True at every selected row.
    -1 entries, out-of-range entries and duplicates are ignored."""
    in_range = (indices >= 0) & (indices < kv_len)
    mask = torch.zeros(indices.shape[0], kv_len + 1, dtype=torch.bool, device=indices.device)
    # out-of-range entries land in a scratch column that is dropped
    mask.scatter_(1, torch.where(in_range, indices.long(), kv_len), True)
    return mask[:, :kv_len]

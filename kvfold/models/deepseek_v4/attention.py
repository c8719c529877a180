"""V4 attention over a batch of rows: for each sequence, a chunk of T tokens at positions
n..n+T-1 (T=1 is decode; prefill, decode and several sequences at once are one code path).
Projections run on all rows together; compressors, indexer and attention run per sequence.

Each query q reads, by gathering, only:
  * its window: positions [max(0, q - W + 1), q] (128 in V4), from the ring plus this chunk;
  * CSA: the compressed entries the indexer picked for it;  HCA: every entry j < (q+1)//r;
and one softmax over them plus a per-head sink logit (no value). K = V is one shared head,
so the output's rope dims are de-rotated at q before the grouped output projection.
Memory is O(T * (W + k)) per layer: queries run in blocks against a band of the window keys.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import CSA, HCA, SLIDING, Dsv4Config
from ...numerics import apply_rope, native, unweighted_rms_norm
from ...numerics.backend import Backend, KernelError
from ...numerics.native_abi import AttendKeys
from ...numerics.reference import release_q_norm, release_sparse_attn
from ...numerics.rows import grouped_row_mm, own_rows
from ...numerics.weights_mm import native_mm
from ...profiling import scope
from .state import LayerState
from ...state.kv_rows import fp8_roundtrip, plain_rows
from ...layers.basic import Linear, Norm, QuantizedWeight, _param, reads_as_stored, weight_mm
from .compressor import Compressor, simulate_kv_fp8
from .indexer import Indexer
from .native_attention import output_rows, project_rows, sequence_row
from ...layers.rows import RowBatch

_ATTN_BUDGET = 1 << 24  # floats of logits + gathered keys per query block


class GroupedLinear(nn.Module):
    """wo_a: [G*R, H*D/G] applied group-wise (group g of heads -> R outputs). `weight` may be a
    `QuantizedWeight`: read as stored where `weight_mm` would (each group's rows one matrix), else
    decoded per matmul."""

    quantizable = ("weight",)

    def __init__(self, in_per_group: int, out_total: int, groups: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.groups = groups
        self.weight = _param(out_total, in_per_group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:  # x [T, G, in] -> [T, G*R]
        if isinstance(self.weight, QuantizedWeight):
            y = self._native_quantized(x, ops)
            if y is not None:
                return y
        if ops.batch_invariant:
            weight = self.weight.dequant() if isinstance(self.weight, QuantizedWeight) else self.weight
            return grouped_row_mm(ops, x.to(weight.dtype), weight, self.groups)
        if ops.fixed_order and self.weight.dtype == torch.bfloat16:  # reference numerics: each group's
            per = self.weight.shape[0] // self.groups  # rows one fixed-order matmul, as weight_mm's
            return torch.cat([weight_mm(ops, x[:, i], self.weight[i * per:(i + 1) * per])
                              for i in range(self.groups)], -1)
        w_t = self._grouped_t()  # [G, in, R]
        if x.dtype != w_t.dtype:
            x = x.to(w_t.dtype)
        return torch.bmm(x.transpose(0, 1), w_t).transpose(0, 1).flatten(1)  # [G, T, in] @ [G, in, R]

    def _native_quantized(self, x: torch.Tensor, ops: Backend) -> torch.Tensor | None:
        """Each group's rows of a quantized weight in native.c, read as stored (`weight_mm`'s rule and
        bits), or None where `weight_mm` would not read it as stored (the model's dtype, the row
        count, a weight whose groups native.c cannot split)."""
        w, (t, g, k) = self.weight, x.shape
        if w.dtype not in (torch.float32, torch.bfloat16) or not reads_as_stored(ops, t):
            return None
        parts = w.native(groups=self.groups, lib=ops.weight_mm.native)
        if parts is None:
            return None
        per = parts[0][1]
        xf = x.float()
        out = torch.empty(t, g * per, dtype=torch.float32)
        for i, (desc, _, _) in enumerate(parts):
            native_mm(ops.weight_mm.native, xf[:, i], desc, per, k, out=out[:, i * per:(i + 1) * per])
        return out if w.dtype == torch.float32 else out.to(w.dtype)

    def _grouped_t(self) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, QuantizedWeight):
            weight = weight.dequant()
            return weight.view(self.groups, -1, weight.shape[1]).transpose(1, 2)
        hit = self.__dict__.get("_w_t")  # a view of the parameter, made once per storage
        if hit is not None and hit[0] is weight and hit[1] == weight.data_ptr():
            return hit[2]
        with torch.inference_mode(False):
            w_t = weight.view(self.groups, -1, weight.shape[1]).transpose(1, 2)
        self.__dict__["_w_t"] = (weight, weight.data_ptr(), w_t)
        return w_t


class Attention(nn.Module):
    # Reference numerics (set by `set_numerics("reference")`, bf16 models only): FP8-simulate the
    # window KV's non-rope dims, and run the release's order of operations here (bf16 q norm, the
    # sparse attention kernel's blocked softmax with bf16 probabilities).
    simulate_kv = False

    def __init__(self, cfg: Dsv4Config, layer_idx: int, dtype: torch.dtype, device=None, tp=None):
        """`tp` (a kvfold.parallel.TensorParallel): hold this rank's share of the query heads (wq_b,
        sinks) and of the output groups (wo_a, wo_b's input columns); the layer's output is then
        the sum over ranks. K = V, the compressors and the indexer stay whole on every rank."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        parts = tp.size if self.tp is not None else 1
        self.act_dtype = dtype
        self.layer_idx = layer_idx  # which of a state's LayerStates this layer reads
        self.rope_dim = cfg.qk_rope_head_dim
        self.kind = cfg.layer_types[layer_idx]
        self.ratio = cfg.compress_ratios[layer_idx]
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads // parts, cfg.head_dim, cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        hid = cfg.hidden_size
        self.q_a_proj = Linear(hid, cfg.q_lora_rank, dtype, device)
        self.q_a_norm = Norm(cfg.q_lora_rank, cfg.rms_norm_eps, device)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, device)
        self.kv_proj = Linear(hid, self.head_dim, dtype, device)
        self.kv_norm = Norm(self.head_dim, cfg.rms_norm_eps, device)
        self.o_groups = cfg.o_groups // parts
        self.o_a_proj = GroupedLinear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * cfg.o_lora_rank,
                                      self.o_groups, dtype, device)
        self.o_b_proj = Linear(self.o_groups * cfg.o_lora_rank, hid, dtype, device)
        self.sinks = _param(self.n_heads, dtype=torch.float32, device=device)
        self.compressor: Compressor | None = None
        if self.kind == CSA:
            self.compressor = Compressor(hid, self.head_dim, self.ratio, True, cfg.qk_rope_head_dim,
                                         cfg.rms_norm_eps, device)
            self.compressor.indexer = Indexer(hid, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                              cfg.index_topk, self.ratio, cfg.qk_rope_head_dim, cfg.rms_norm_eps,
                                              dtype, device)
        elif self.kind == HCA:
            self.compressor = Compressor(hid, self.head_dim, self.ratio, False, cfg.qk_rope_head_dim,
                                         cfg.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        """x [R, hidden]: the batch's rows (each segment one sequence at its positions)."""
        t, ops = x.shape[0], batch.ops
        rope, cos, sin = batch.rope[SLIDING if self.kind == SLIDING else "compressed"]
        rows = project_rows(ops, self, x, batch.positions, cos, sin)  # native.c's fused projections, else per op
        if rows is None:
            first = batch.segments[0].start if t == 1 else None  # a lone decode row: no index tensor
            rows = self.project(x, batch.positions, first, cos, sin, ops)
        parts = [p for seg in batch.segments for p in seg.parts()]  # (verify rows: each alone, in order)
        out = x.new_zeros(t, self.n_heads, self.head_dim, dtype=torch.float32) if len(parts) > 1 else None
        for part in parts:
            o = self._one_sequence(part, self._taker(part, t, ops), rows, rope, ops)
            if out is None:
                out = o
            else:
                out[part.rows] = o
        return self.output(out, x.dtype, cos, sin, ops)

    def output(self, out: torch.Tensor, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor,
               ops: Backend) -> torch.Tensor:
        """Token-parallel: the heads' outputs [R, H, D] (fp32) de-rotated and projected to [R, hidden]."""
        y = output_rows(ops, self, out, cos, sin)
        if y is None:
            out = apply_rope(ops, out if out.dtype == dtype else out.to(dtype), cos, sin, inverse=True)
            y = self.o_b_proj(self.o_a_proj(out.reshape(out.shape[0], self.o_groups, -1), ops), ops)
        return y if self.tp is None else self.tp.all_reduce_sum(y)  # this rank's heads: one part of the sum

    def project(self, x: torch.Tensor, positions: torch.Tensor, first: int | None, cos: torch.Tensor,
                sin: torch.Tensor, ops: Backend) -> dict:
        """Token-parallel: every projection of every row at once (`first`: a lone row's position
        as an int, which spares an index tensor; else None)."""
        t = x.shape[0]
        q_lora = self.q_a_norm(self.q_a_proj(x, ops), ops)
        q = self.q_b_proj(q_lora, ops).view(t, self.n_heads, self.head_dim)
        if self.simulate_kv:  # the release's per-head q norm, in bf16
            q = release_q_norm(q, self.eps)
        else:
            q = unweighted_rms_norm(ops, q, self.eps)
        rows = {"q": apply_rope(ops, q, cos, sin),
                "kv": apply_rope(ops, self.kv_norm(self.kv_proj(x, ops), ops), cos, sin)}  # [R, D], K = V
        if self.simulate_kv:
            rows["kv"] = simulate_kv_fp8(rows["kv"], self.head_dim - self.rope_dim)
        if self.compressor is not None:
            with scope("compressors"):
                rows["comp"] = self.compressor.project(x, positions, first, ops)
                if self.kind == CSA:
                    rows["idx_kv"] = self.compressor.indexer.project(x, positions, first, ops)
            if self.kind == CSA:
                with scope("indexer select"):
                    rows["idx_q"] = self.compressor.indexer.queries(x, q_lora, cos, sin, ops)
        rows["positions"] = positions
        return rows

    @staticmethod
    def _taker(seg, t: int, ops: Backend):
        """How a sequence reads its rows of a batch tensor."""
        if ops.fresh_rows(seg.length):  # in a fresh buffer, as when the sequence runs alone
            return lambda a: own_rows(a, seg.rows)
        if seg.length == t:  # the only segment: its rows are the whole tensors
            return lambda a: a
        return lambda a: a[seg.rows]

    def _one_sequence(self, seg, take, rows: dict, rope, ops: Backend) -> torch.Tensor:
        """One sequence: fold its compressors, select, attend to its own state, write its window."""
        ls: LayerState = seg.state.layers[self.layer_idx]
        start = seg.start
        if seg.length == 1 and ops.sparse_attention.triton is None:
            with scope("attention core"):  # a decode row: all of it in one native call where the state allows
                o = sequence_row(ops, self, ls, start, rows, take, rope)
            if o is not None:
                return o
        selected = None
        if self.compressor is not None:
            with scope("compressors"):
                self.compressor.fold(take(rows["comp"][0]), take(rows["comp"][1]), start, ls.compressor, rope, ops)
                if self.kind == CSA:
                    self.compressor.indexer.fold(take(rows["idx_kv"][0]), take(rows["idx_kv"][1]), start,
                                                 ls.indexer, rope, ops)
            if self.kind == CSA:
                with scope("indexer select"):
                    selected = self.compressor.indexer.select(take(rows["idx_q"][0]), take(rows["idx_q"][1]),
                                                              start, ls.indexer, ops)
        kv_seg = take(rows["kv"])
        fp8_nope = ls.window.store.fp8_nope
        if fp8_nope is not None:  # attend to fresh rows exactly as they will read back from FP8
            kv_seg = fp8_roundtrip(kv_seg, fp8_nope)
        # window keys: surviving ring rows, then this chunk's rows (never overwritten mid-chunk)
        prev_start = max(0, start - self.window + 1)
        with scope("attention core"):
            o = self._attend(take(rows["q"]), kv_seg, prev_start, start, ls, selected, take(rows["positions"]), ops)
        ls.window.write(start, kv_seg)
        return o

    def _attend(self, q: torch.Tensor, kv_seg: torch.Tensor, local_start: int, start: int, ls: LayerState,
                selected: torch.Tensor | None, positions: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Each of the T queries' softmax over its window band (the ring's rows of positions
        local_start..start-1, then the chunk's `kv_seg`), its compressed entries and the sink; a
        lone fp32 query (decode) runs as one native call of the same formula, reading the ring in place."""
        t, h, d = q.shape
        f32 = torch.float32
        sinks = self.sinks if self.sinks.dtype == f32 else self.sinks.float()
        pool = ls.compressor.pool if self.kind != SLIDING else None
        n_comp = 0 if selected is None else selected.shape[1]
        if self.kind == HCA:
            n_comp = (start + t) // self.ratio
        if self.simulate_kv:
            local = ls.window.read_then(local_start, start, kv_seg)
            return self._attend_release(q, local, local_start, start, pool, selected, n_comp, sinks, positions)
        q = (q if q.dtype == f32 else q.float()) * d ** -0.5
        kernels = ops.sparse_attention.triton  # off by default (KernelSet.triton)
        if ops.sparse_attention.native is not None and t == 1:
            out = _native_attend_one(ops, q, ls.window.runs(local_start, start) + [kv_seg], pool, selected, n_comp,
                                     sinks, self.kind)
            if out is not None:
                return out
        local = ls.window.read_then(local_start, start, kv_seg)
        if local.dtype != f32:
            local = local.float()
        if kernels is not None:
            return self._attend_triton(kernels, q, local, local_start, start, pool, selected, n_comp, sinks, positions)
        per_query = h * (2 * self.window + n_comp) + (n_comp * d if self.kind == CSA else 0)
        # a block of B queries reads B + W - 1 window keys: B = W keeps the band at most 2x the
        # W keys each query needs (B = T would make prefill O(T^2))
        block = max(1, min(t, self.window, _ATTN_BUDGET // max(1, per_query)))
        if block >= t:
            return self._attend_block(q, positions, 0, t, local, local_start, start, pool, selected, sinks)
        out = torch.empty(t, h, d, dtype=f32, device=q.device)
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            out[b0:b1] = self._attend_block(q[b0:b1], positions[b0:b1], b0, b1, local, local_start, start, pool,
                                            None if selected is None else selected[b0:b1], sinks)
        return out

    def _attend_triton(self, kernels, q: torch.Tensor, local: torch.Tensor, local_start: int, start: int, pool,
                       selected: torch.Tensor | None, n_comp: int, sinks: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """`_attend` in triton_kernels.sparse_attend: each query's window positions p-W+1..p as rows
        of `local` (-1 before position 0), and its compressed entries (HCA: the visible ones, CSA:
        the selected ones) as rows of the pool's first entries."""
        t = q.shape[0]
        cols = torch.arange(self.window, device=q.device)
        wpos = positions[:, None] - self.window + 1 + cols[None, :]
        idx_w = torch.where(wpos >= max(local_start, 0), wpos - local_start, -1)
        keys_c = idx_c = None
        if self.kind == HCA and n_comp:
            entries = torch.arange(n_comp, device=q.device)
            idx_c = torch.where(entries[None, :] < ((positions + 1) // self.ratio)[:, None], entries, -1)
            keys_c = pool[:n_comp]
        elif self.kind == CSA and selected is not None and selected.shape[1]:
            idx_c, keys_c = selected, pool[:(start + t) // self.ratio]
        return kernels.sparse_attend(q, local, idx_w, keys_c, idx_c, sinks)

    def _attend_block(self, qb: torch.Tensor, qpos: torch.Tensor, b0: int, b1: int, local: torch.Tensor,
                      local_start: int, start: int, pool, sel: torch.Tensor | None, sinks: torch.Tensor
                      ) -> torch.Tensor:
        """Queries b0..b1-1 of the chunk (scaled qb [nb, h, d] at positions qpos)."""
        nb = qb.shape[0]
        w, f32 = self.window, torch.float32
        # band of window keys for this block, in local (position - local_start) coordinates
        k0 = max(0, start + b0 - w + 1 - local_start)
        keys_w = local[k0:start + b1 - local_start]
        keys, masks = [keys_w], [None]
        if nb > 1:  # a lone query's band is exactly its window: nothing to mask
            kpos = torch.arange(k0, k0 + keys_w.shape[0], device=qb.device) + local_start
            masks[0] = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
        if self.kind == HCA:
            n_vis = (start + b1) // self.ratio
            keys_c = pool[:n_vis]
            keys.append(keys_c if keys_c.dtype == f32 else keys_c.float())
            # the last query of a block sees all n_vis entries
            masks.append(torch.arange(n_vis, device=qb.device)[None, :] < ((qpos + 1) // self.ratio)[:, None]
                         if nb > 1 else None)
        elif self.kind == CSA and sel is not None and sel.shape[1] > 0:
            n_vis = (start + b1) // self.ratio  # the entries the block's last query can pick from
            picked = sel >= 0
            if nb > 1 and n_vis <= 2 * sel.shape[1]:
                # every visible entry, those a query did not pick masked: at most twice the
                # products of its picks alone, without gathering them (a [nb, k, d] copy: 40% of
                # a 128-query block's time at k = 512, d = 512, bench/RESULTS.md)
                keys_c = pool[:n_vis]
                rows = torch.arange(nb, device=qb.device)[:, None].expand_as(sel)
                mask = torch.zeros(nb, n_vis, dtype=torch.bool, device=qb.device)
                mask[rows[picked], sel[picked]] = True
            else:
                keys_c, mask = pool[sel.clamp(min=0)], picked  # [nb, k, d]
            keys.append(keys_c if keys_c.dtype == f32 else keys_c.float())
            masks.append(mask)
        return sink_attention(qb, keys, masks, sinks)

    def _attend_release(self, q: torch.Tensor, local: torch.Tensor, local_start: int, start: int, pool,
                        selected: torch.Tensor | None, n_comp: int, sinks: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
        """Reference numerics: each query's keys laid out in the columns the release's
        sparse attention reads (docs/checkpoints.md): first its window, oldest position first,
        -1 padded to W columns (a prefill from position 0 shorter than W: to its length); then its
        compressed entries (HCA: 0.. ascending; CSA: the indexer's picks in its topk order). The kernel's blocked
        softmax runs over those columns (numerics/reference.py `release_sparse_attn`)."""
        t, h, d = q.shape
        w, dev = self.window, q.device
        width = min(t, w) if start == 0 else w
        f32 = torch.float32
        per_query = (width + n_comp) * (d + 2 * h)
        block = max(1, min(t, _ATTN_BUDGET // max(1, per_query)))
        out = torch.empty(t, h, d, dtype=f32, device=dev)
        cols = torch.arange(width, device=dev)
        for b0 in range(0, t, block):
            b1 = min(t, b0 + block)
            qpos = positions[b0:b1]
            n_win = torch.clamp(qpos + 1, max=w)  # window positions qpos - n_win + 1 .. qpos
            wpos = qpos[:, None] - n_win[:, None] + 1 + cols[None, :]
            valid = cols[None, :] < n_win[:, None]
            keys = local[(wpos.clamp(min=local_start) - local_start).clamp(max=local.shape[0] - 1)]
            keys = keys.masked_fill(~valid[..., None], 0.0)
            if self.kind == HCA and n_comp > 0:
                comp = pool[:n_comp].to(f32)[None].expand(b1 - b0, -1, -1)
                vis = torch.arange(n_comp, device=dev)[None, :] < ((qpos + 1) // self.ratio)[:, None]
                keys, valid = torch.cat([keys, comp], 1), torch.cat([valid, vis], 1)
            elif self.kind == CSA and n_comp > 0:
                sel = selected[b0:b1]
                comp = pool[sel.clamp(min=0)].to(f32)
                keys, valid = torch.cat([keys, comp], 1), torch.cat([valid, sel >= 0], 1)
            out[b0:b1] = release_sparse_attn(q[b0:b1], keys, valid, sinks, d ** -0.5)
        return out


def sink_attention(q: torch.Tensor, keys: list[torch.Tensor], masks: list[torch.Tensor | None],
                   sinks: torch.Tensor) -> torch.Tensor:
    """The attention core of every V4 query (K = V): one softmax over the logits q . k of each
    key set (-inf where its mask is False) and one sink logit per head, which has no value; the
    output is the probability-weighted sum of the keys. q [nb, H, D] (scaled); each key set is
    [n, D] (every query's) or [nb, n, D] (one per query), its mask broadcasts to [nb, n] or is None."""
    nb, h, _ = q.shape
    parts = []
    for k, mask in zip(keys, masks):
        logits = q @ k.transpose(-1, -2)
        parts.append(logits if mask is None else logits.masked_fill(~mask[:, None, :], float("-inf")))
    parts.append(sinks[None, :, None].expand(nb, h, 1))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    acc, c0 = None, 0
    for k, logits in zip(keys, parts):
        term = p[..., c0:c0 + logits.shape[-1]] @ k
        acc = term if acc is None else acc + term
        c0 += logits.shape[-1]
    return acc


def _native_attend_one(ops: Backend, q: torch.Tensor, window: list[torch.Tensor], pool,
                       selected: torch.Tensor | None, n_comp: int, sinks: torch.Tensor, kind: str
                       ) -> torch.Tensor | None:
    """`Attention._attend` of one query in one native call (`ops.sparse_attention`: fp32 CPU keys,
    pools private or paged), else None where the state's format is not what the kernel reads (an
    FP8 compressed pool). `window`: up to three runs of window keys, in position order."""
    lib = ops.sparse_attention.native
    if not native.fp32_cpu(q, sinks, *window) or len(window) > 3:
        raise KernelError(f"kv_attend_one reads one fp32 CPU query and up to three contiguous fp32 runs of "
                          f"window keys, got {q.dtype} and {[(w.dtype, w.is_contiguous()) for w in window]}")
    data = phys = sel = None
    if n_comp > 0:
        source = plain_rows(pool)
        if source is None:  # FP8 entries: the per-op path decodes them
            return None
        data, phys = source
        if kind == CSA:
            sel = selected[0]
            if sel.dtype != torch.int64 or not sel.is_contiguous():
                raise KernelError(f"kv_attend_one reads int64 contiguous picks, got {sel.dtype}")
    _, h, d = q.shape
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    keys = AttendKeys(pool=ptr(data), phys=ptr(phys), sel=ptr(sel), n_comp=n_comp)
    keys.window[:len(window)] = [w.data_ptr() for w in window]  # the runs left empty stay NULL, 0 rows
    keys.window_n[:len(window)] = [w.shape[0] for w in window]
    out = torch.empty(1, h, d, dtype=torch.float32)
    scratch = torch.empty(h * (sum(w.shape[0] for w in window) + n_comp), dtype=torch.float32)
    lib.kv_attend_one(q.data_ptr(), h, d, keys, sinks.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
    return out

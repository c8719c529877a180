"""GLM-5.3 (`glm5_next`) text model: one `forward(tokens, state)` for any chunk length.

Layers are KDA linear attention (`kda.py`) or indexed MLA with DSA (`mla.py`), each
with mHC residual streams (4 in GLM-5.3-Flash; the final head is a plain mean over the streams) and
a dense SwiGLU MLP or a sigmoid-routed MoE with a shared expert. All per-sequence data lives in the
`Glm5State` passed in (`state.py`). Prefill, chunked prefill, decode and verify are the
same code with different T. Checkpoints load through checkpoint.py.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import CapacityError, ConfigError
from .config import KDA, Glm5Config
from ...layers.basic import Linear, _param
from .kda import KdaAttention
from ...layers.mhc import HyperConnection
from ...numerics.hc import stream_mean
from .mla import GlmRMSNorm, IndexedMLA
from ...layers.moe import Experts, SwiGluMLP
from ...layers.rows import RowBatch
from ...numerics.backend import Backend
from ...numerics.rows import biased_topk, own_rows, route_rows, row_mm
from .indexer_state import KV_FP8, Glm5NextDsaState
from .state import Glm5State, KdaLayerState, MlaLayerState, kda_ring_sizes
from ...state.arena import SlotArena
from ...state.pages import LATENT, PagePool, PoolSpec
from ..base import Capabilities, CausalLM, Embedding
from ..placed import Walk
from ...parallel import check_divides
from .sharding import tp_counts
from .graph_step import arena_specs, decode_step


class Glm5Router(nn.Module):
    """Sigmoid scores; the correction bias (and the group limit) choose the experts, never weigh them."""

    def __init__(self, cfg: Glm5Config, device=None):
        super().__init__()
        self.k, self.scale, self.norm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        if ops.batch_invariant:
            return route_rows(ops, x, self.weight, "sigmoid", self.k, self.scale, bias=self.e_score_correction_bias,
                              n_group=self.n_group, topk_group=self.topk_group, renorm=self.norm)
        scores = torch.sigmoid(row_mm(ops, x.float(), self.weight.float()))
        ids = biased_topk(scores + self.e_score_correction_bias.float(), self.k, self.n_group, self.topk_group)
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


class Glm5MoE(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None, tp=None):
        """`tp`: this rank's routed experts, the shared expert on rank 0; the output is the sum over ranks."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        e0, e1 = self.tp.span(cfg.n_routed_experts) if self.tp is not None else (0, cfg.n_routed_experts)
        self.gate = Glm5Router(cfg, device)
        self.experts = Experts(e1 - e0, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                               dtype, device, first=e0, total=cfg.n_routed_experts)
        keep_shared = cfg.n_shared_experts and (self.tp is None or self.tp.rank == 0)
        self.shared_experts = SwiGluMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        cfg.swiglu_limit, dtype, device) if keep_shared else None

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        weights, ids = self.gate(x, ops)
        y = self.experts(x, weights, ids, ops)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x, ops).float()
        if self.tp is not None:
            y = self.tp.all_reduce_sum(y)
        return y.to(x.dtype)


class Glm5Block(nn.Module):
    def __init__(self, cfg: Glm5Config, i: int, dtype: torch.dtype, device=None, tp=None):
        super().__init__()
        self.kind = cfg.layer_types[i]
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc, device=device)
        self.ffn_hc = HyperConnection(*hc, device=device)
        self.input_layernorm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if self.kind == KDA:
            self.self_attn = KdaAttention(cfg, dtype, device, tp)
        else:
            self.self_attn = IndexedMLA(cfg, cfg.indexer_types[i] == "full", dtype, device, tp)
        self.mlp = Glm5MoE(cfg, dtype, device, tp) if cfg.mlp_layer_types[i] == "sparse" \
            else SwiGluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, dtype, device)


class Glm5Body(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None, tp=None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Glm5Block(cfg, i, dtype, device, tp) for i in range(cfg.num_hidden_layers))
        self.norm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


def kv_storage(kv_dtype: str | None) -> torch.dtype | None:
    """The dtype `new_state(kv_dtype=...)` stores MLA latent rows and indexer keys in: None for the
    model dtype, float8_e4m3fn for "fp8"."""
    if kv_dtype not in (None, "auto", "fp8"):
        raise ConfigError(f"kv_dtype must be None (the model dtype) or 'fp8', got {kv_dtype!r}")
    return KV_FP8 if kv_dtype == "fp8" else None


class Glm5Model(CausalLM):
    """Weights named as the text part of a transformers `Glm5NextForConditionalGeneration`."""

    capabilities = Capabilities(fp8_kv=True, pages=True)
    # tokens per page of a PagePool: the engine's 128-token prefix blocks, a whole number of k-pools
    # for every index_kpool that divides 128 (the indexer rows stay flat, so nothing else constrains it)
    page_tokens = 128

    def __init__(self, cfg: Glm5Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tp=None):
        """`tp`: a kvfold.parallel.TensorParallel of more than one rank shards the KDA and MLA heads
        and the routed experts (sharding.py), the KDA state with them."""
        super().__init__(cfg, dtype, device)
        if tp is not None and tp.size > 1:
            check_divides(tp_counts(cfg), tp.size)
            self.tp = tp
        self.model = Glm5Body(cfg, dtype, self.device, self.tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, self.device)

    def _on_device(self) -> None:
        if self.mtp is not None:
            self.mtp.device = self.device

    @property
    def kda_heads(self) -> int:
        """The KDA heads this rank holds (all of them without tensor parallelism)."""
        tp = getattr(self, "tp", None)
        return self.config.linear_num_heads // (tp.size if tp is not None else 1)

    def set_numerics(self, mode: str) -> None:
        if mode != "hf":
            raise ConfigError(f"glm5_next supports numerics 'hf' only, got {mode!r}")

    # ---- state --------------------------------------------------------------------------------
    def new_page_pool(self, num_pages: int, kv_dtype: str | None = None) -> PagePool:
        """Preallocate `num_pages` shared pages for the MLA latent rows of this model's states (one
        page: `page_tokens` positions of every DSA layer's latent; float8_e4m3fn with kv_dtype="fp8")."""
        fp8, cfg = kv_storage(kv_dtype), self.config
        specs = [PoolSpec(i, LATENT, 1, cfg.kv_lora_rank, dtype=fp8, device=self.layer_device(i))
                 for i in cfg.dsa_layers]
        pool = PagePool(specs, num_pages, self.page_tokens, self.dtype, self.device, fingerprint=self.fingerprint,
                        kv_fp8=fp8 is not None)
        self._tag_layers(pool.storages.items(), lambda key: key[0])
        return pool

    def new_state(self, capacity: int = 4096, max_rewind: int = 0, kv_dtype: str | None = None, *,
                  pages: PagePool | None = None, prefix_pages: list[int] | None = None,
                  arena: SlotArena | None = None) -> Glm5State:
        """Reserve every buffer of one sequence for `capacity` tokens (never grown later);
        the KDA layers keep one state plus the inputs of the tokens a rewind of up to `max_rewind`
        tokens replays (see state.py).

        `kv_dtype="fp8"` stores the MLA latent rows and the full DSA layers' indexer keys as
        float8_e4m3fn at unit scale (all their dims: GLM-5.3's MLA has no rope dims); the KDA
        states, the indexer gates and validity stay as they are.

        `pages`: keep the MLA latent rows in that shared `PagePool` (from `new_page_pool`, with the
        same kv_dtype), ceil(capacity / page_tokens) pages taken up front and returned on `free()`;
        `prefix_pages`: the first pages taken by reference from another holder, after which the
        state must restore the snapshot taken at their end (`snapshot(pools=False)`) before it runs.
        The indexer rows stay flat per sequence (`Glm5NextDsaState`). `arena`: hold the KDA states
        and the indexer rows in a free slot of that `SlotArena` (from `new_decode_arena`, with its
        `pages`), where a captured decode graph reads them (graph_step.py). Refusals allocate nothing."""
        if capacity < 1 or max_rewind < 0:
            raise CapacityError(f"capacity must be >= 1 and max_rewind >= 0 (got {capacity}, {max_rewind})")
        fp8 = kv_storage(kv_dtype)
        cfg, dev, dt = self.config, self.device, self.dtype
        if pages is None and prefix_pages:
            raise ConfigError("prefix_pages needs pages=<the PagePool they belong to>")
        if arena is not None:
            if self.devices is not None:
                raise ConfigError("a SlotArena holds a graph step's states on one device; a placed model's states "
                                  "live with their layers: leave arena out")
            if fp8 is not None:
                raise ConfigError("a state in a SlotArena stores its KV in the model dtype; use kv_dtype=None")
            arena.check_fits(capacity, max_rewind, pages, self.fingerprint)
        table = pages.take_table(capacity, prefix_pages, fingerprint=self.fingerprint, dtype=dt, device=dev,
                                 kv_fp8=fp8 is not None) if pages is not None else []
        slot = arena.take() if arena is not None else None

        def buffer(key: tuple, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            """The arena slot's buffer `key` as `shape`, or a zeroed one of this state's own."""
            if arena is not None and key in arena.rings:
                return arena.buffer(key, slot).view(shape)
            return torch.zeros(shape, dtype=dtype, device=layer_dev)

        memos: dict = {}  # one row-map memo per device: a page table's index lives with its pool
        kp = max(cfg.index_kpool, 1)
        dsa_cap = -(-capacity // kp) * kp  # whole pools, at least capacity rows
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            layer_dev = self.layer_device(i)  # a layer's state lives on its device only (placed.py); `buffer` reads it
            if kind == KDA:
                layers.append(self._kda_layer_state(i, max_rewind, buffer))
                continue
            dsa = None
            if cfg.indexer_types[i] == "full" and arena is not None:
                dsa = Glm5NextDsaState.over(dsa_cap, kp, *(arena.buffer((i, part), slot)
                                                           for part in ("dsa_k", "dsa_gate")),
                                            arena.buffer((i, "dsa_valid"), slot)[:, 0])
            elif cfg.indexer_types[i] == "full":
                dsa = Glm5NextDsaState(dsa_cap, cfg.index_head_dim, kp, dtype=dt, device=layer_dev, key_dtype=fp8)
            latent = pages.view(i, LATENT, table, capacity, memos.setdefault(self._device_name(i), {})) \
                if pages is not None else \
                torch.zeros(capacity, cfg.kv_lora_rank, dtype=fp8 or dt, device=layer_dev)
            layers.append(MlaLayerState(latent=latent, dsa=dsa))
        state = Glm5State(layers, capacity=capacity, max_rewind=max_rewind, fingerprint=self.fingerprint,
                          device=dev, dtype=dt, kv_fp8=fp8 is not None, tp=self.tp, pages=pages, page_table=table,
                          prefix_tokens=len(prefix_pages or []) * self.page_tokens if pages is not None else 0,
                          arena=arena, slot=slot)
        if arena is not None:
            arena.bind(slot, state)
        state.dev_set = self.dev_set
        self._tag_layers(enumerate(layers), lambda i: i)
        return state

    def _kda_layer_state(self, i: int, max_rewind: int, buffer) -> KdaLayerState:
        """Layer i's KDA state (state.py), each buffer from `buffer(key, shape, dtype)`."""
        cfg, dt, f32 = self.config, self.dtype, torch.float32
        nh, dk = self.kda_heads, cfg.linear_head_dim
        n_in, n_mix = kda_ring_sizes(max_rewind, cfg.linear_conv_kernel_dim)
        return KdaLayerState(
            conv=buffer((i, "conv"), (cfg.linear_conv_kernel_dim - 1, 3 * nh * dk), dt),
            rec=buffer((i, "rec"), (nh, dk, dk), f32),
            k=buffer((i, "k"), (n_in, nh, dk), f32), g=buffer((i, "g"), (n_in, nh, dk), f32),
            v=buffer((i, "v"), (n_in, nh, dk), dt), beta=buffer((i, "beta"), (n_in, nh), f32),
            mixed=buffer((i, "mixed"), (n_mix, 3 * nh * dk), dt))

    # ---- a decode step a CUDA graph captures (graph_step.py; engine/graphs.py replays it) -------
    def new_decode_arena(self, slots: int, capacity: int, pages: PagePool, max_rewind: int = 0) -> SlotArena:
        """Fixed-address KDA states and indexer rows for `slots` states of up to `capacity` tokens
        whose latent rows live in `pages`: what a captured decode graph reads (graph_step.py)."""
        kp = max(self.config.index_kpool, 1)
        return SlotArena(arena_specs(self.config, self.dtype, self.kda_heads, -(-capacity // kp) * kp, max_rewind),
                         slots, pages, capacity=capacity, max_rewind=max_rewind, fingerprint=self.fingerprint)

    def decode_graph_step(self, ops: Backend, arena: SlotArena, tokens: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor, context: int | None = None, extras: torch.Tensor | None = None):
        """One token per row, shapes fixed by the inputs' length and `context` (a bound on every
        position + 1), with the kernels of `ops` (`backend(...)` in the caller's mode): (logits
        [N, vocab] fp32, final streams [N, hc, hidden]). `extras` [N, E]: each row's state's
        `graph_inputs`. No checks and no cursor moves: the caller (engine/graphs.py) does both."""
        return decode_step(self, ops, arena, tokens, positions, slots, context, extras)

    # ---- forward: the rows of one model call (CausalLM runs the chunk loop and the checks) ----
    def _run_rows(self, batch: RowBatch, last_only: bool | list[bool]) -> tuple[list[torch.Tensor], torch.Tensor]:
        for seg in batch.segments:
            seg.state._dsa_sync(seg.start, 0)  # reconcile as eager decode does (seed): rewind if ahead
            seg.state._kda_begin(seg.start, seg.length)
        walk = Walk(self, batch, lambda b, name: None)  # a placed model's devices (one device: no moves)
        b, _ = walk.enter(walk.name("embed"), batch.token_ids)
        with walk.scope(walk.name("embed")):
            streams = self.model.embed_tokens(b.token_ids)[:, None, :].expand(-1, self.config.hc_mult, -1)
            streams = streams.contiguous()
        # MLA runs verify rows one after another, as decode rows (`Segment.parts`); KDA runs a
        # sequence's rows as its recurrence does, whose last max_rewind rows are single steps already
        parts = [p for seg in batch.segments for p in seg.parts()]
        sels: list = [None] * len(parts)  # each unit's DSA selection, shared down its layers
        for i, block in enumerate(self.model.layers):
            if walk.crosses(walk.name(i)):  # the DSA selections go on down the layers with the streams
                sels = [None if sel is None else walk.devmap.hop(sel, walk.name(i)) for sel in sels]
            b, streams = walk.enter(walk.name(i), streams)
            with walk.scope(walk.name(i)):
                streams = self._layer(i, block, streams, parts, sels, b)
        for seg in batch.segments:
            seg.state._kda_commit()
            seg.state.pos = seg.state.written_until = seg.start + seg.length
        b, streams = walk.enter(walk.name("head"), streams)
        with walk.scope(walk.name("head")):
            scored = streams[b.scored_rows(last_only)]
            logits = self.lm_head(self.model.norm(stream_mean(scored), b.ops), b.ops).float()
        return batch.split_scored(logits, last_only), streams

    def _layer(self, i: int, block, streams: torch.Tensor, parts: list, sels: list, batch: RowBatch) -> torch.Tensor:
        """Layer i on the rows' streams: attention per sequence (KDA) or per unit (MLA), then the MLP."""
        ops = batch.ops
        x, post, comb = block.attn_hc.collapse(streams, ops)
        x = block.input_layernorm(x, ops)
        units = batch.segments if block.kind == KDA else parts
        y = x.new_zeros(x.shape) if len(units) > 1 else None
        for s, seg in enumerate(units):
            xs = own_rows(x, seg.rows) if ops.fresh_rows(seg.length) else x[seg.rows]
            ys = self._attend(block, xs, seg, seg.state.layers[i], sels, s, ops)
            if y is None:
                y = ys
            else:
                y[seg.rows] = ys
        streams = HyperConnection.expand(streams, y, post, comb, ops)
        x, post, comb = block.ffn_hc.collapse(streams, ops)
        x = block.post_attention_layernorm(x, ops)
        y = block.mlp(x, ops)
        return HyperConnection.expand(streams, y, post, comb, ops)

    def _placement_units(self):
        body = self.model
        return [body.embed_tokens], list(body.layers), \
            [body.norm, self.lm_head, *([self.mtp] if self.mtp is not None else [])]

    @staticmethod
    def _attend(block, x: torch.Tensor, seg, ls, sels: list, s: int, ops: Backend) -> torch.Tensor:
        """One sequence's attention in one layer: KDA runs from its state at start (replayed from the
        base) and stores its inputs (state.py); DSA layers pass their selection on to the next."""
        if block.kind == KDA:
            return seg.state._kda_forward(block.self_attn, ls, x, seg.start, ops)
        y, sels[s] = block.self_attn(x, seg.start, ls.latent, ls.dsa, sels[s], ops)
        return y

    # ---- multi-token prediction: what the MTP drafter (decoding/drafters.py) calls --------------
    # (supports_mtp, from CausalLM: the checkpoint shipped layer num_hidden_layers, mtp.py)
    def new_mtp_state(self, capacity: int, max_rewind: int) -> Glm5State:
        """A state for the MTP layer's own latent and indexer rows (needs `supports_mtp`)."""
        return self.mtp.new_state(capacity=capacity, max_rewind=max_rewind)

    def mtp_step(self, hidden: torch.Tensor, token_ids, mtp_state: Glm5State, ops: Backend | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance `mtp_state` over T positions (needs `supports_mtp`). `hidden`: the main model's
        final streams [T, hc, d] at those positions (`forward(..., return_hidden=True)`), reduced
        here to the row its lm_head reads (final norm of the stream mean), or the MTP layer's own
        previous output [T, d]; `token_ids`: the T tokens one position later; `ops`: the kernels
        to run (None: `backend()`, the model's own mode). Returns (logits [T, vocab] for two
        positions ahead, the MTP output [T, d])."""
        ops = self.backend() if ops is None else ops
        with self._head_scope():
            h = self.model.norm(stream_mean(hidden), ops) if hidden.dim() == 3 else hidden
            return self.mtp(h, self._as_ids(token_ids), mtp_state, self._embed_at_head, self.lm_head, ops)

    # ---- accounting ---------------------------------------------------------------------------
    def state_layout(self, max_rewind: int = 0, kv_dtype: str | None = None) -> tuple[int, list[tuple[int, int]]]:
        """CausalLM.state_layout from the config: fixed, per KDA layer its conv and recurrent state
        and the rings of per-token inputs that rewinding by up to max_rewind replays (state.py); per token, the MLA latent of every DSA layer; per whole
        k-pool, the indexer rows (k, gate in the model dtype, one validity byte) and the pool's
        cached key (model dtype, one validity byte) of every full DSA layer (its buffers round
        capacity up to pools). With kv_dtype="fp8" the latent and k take
        one byte per value."""
        fp8 = kv_storage(kv_dtype)
        cfg, esz = self.config, torch.finfo(self.dtype).bits // 8
        kv_esz = 1 if fp8 is not None else esz
        c = self.kda_heads * cfg.linear_head_dim  # this rank's heads under tensor parallelism
        n_in, n_mix = kda_ring_sizes(max_rewind, cfg.linear_conv_kernel_dim)
        kda = (c * cfg.linear_head_dim * 4 + (cfg.linear_conv_kernel_dim - 1 + n_mix) * 3 * c * esz
               + n_in * (2 * c * 4 + c * esz + self.kda_heads * 4))
        kp = max(cfg.index_kpool, 1)
        pools = [(1, len(cfg.dsa_layers) * cfg.kv_lora_rank * kv_esz)]
        if cfg.full_dsa_layers:  # per pool: kp rows (k, gate, validity) and the pool's cached key (indexer_state.py)
            row, pool = cfg.index_head_dim * (kv_esz + esz) + 1, cfg.index_head_dim * esz + 1
            pools.append((kp, len(cfg.full_dsa_layers) * (kp * row + pool)))
        return len(cfg.kda_layers) * kda, pools

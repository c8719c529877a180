"""DeepSeek-V4 text model: one `forward(tokens, state)` for any chunk length.

Prefill, chunked prefill, decode and verify are the same code with different T; all
per-sequence data lives in the `Dsv4State` passed in.
"""
from __future__ import annotations

from math import lcm

import torch
from torch import nn

from .config import CSA, SLIDING, Dsv4Config
from ...errors import CapacityError, ConfigError
from .attention import Attention
from .compressor import Compressor
from .indexer import Indexer
from ...layers.basic import Linear, Norm
from ...layers.mhc import HyperConnection, HyperHead
from ...layers.moe import Experts
from .moe import MoE
from .names import official_quant_kind
from .native_block import block_row, model_row
from ...layers.rows import RowBatch
from ...numerics import RopeTable
from ...numerics.backend import Backend
from .state import Dsv4State, LayerState, compressor_ring_rows, compressor_state
from ...state.arena import SlotArena
from ...state.kv_rows import kv_row_bytes
from ...state.pages import COMPRESSOR, INDEXER, PagePool, PoolSpec
from ...state.rings import PositionRing
from ..base import Capabilities, CausalLM, Embedding
from ..placed import Walk
from ...parallel import check_divides
from .sharding import tp_counts


class Block(nn.Module):
    fused_decode = True  # decode rows in one native call where they can (Dsv4Model.set_fused_decode)

    def __init__(self, cfg: Dsv4Config, i: int, dtype: torch.dtype, device=None, tp=None):
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc, device=device)
        self.ffn_hc = HyperConnection(*hc, device=device)
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, i, dtype, device, tp)
        self.mlp = MoE(cfg, i, dtype, device, tp)

    def forward(self, streams: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        """streams [R, hc, hidden] of the batch's rows -> the same after this layer."""
        fused = block_row(self, streams, batch)  # decode rows: the calls below as one native call
        if fused is not None:
            return fused
        ops = batch.ops
        x, post, comb = self.attn_hc.collapse(streams, ops)
        y = self.self_attn(self.input_layernorm(x, ops), batch)
        streams = HyperConnection.expand(streams, y, post, comb, ops)
        x, post, comb = self.ffn_hc.collapse(streams, ops)
        y = self.mlp(self.post_attention_layernorm(x, ops), batch.token_ids, ops)
        return HyperConnection.expand(streams, y, post, comb, ops)


class Dsv4Body(nn.Module):
    def __init__(self, cfg: Dsv4Config, dtype: torch.dtype, device=None, tp=None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Block(cfg, i, dtype, device, tp) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps, device)


class Dsv4Model(CausalLM):
    """Weights named as in a transformers `DeepseekV4ForCausalLM` checkpoint."""

    capabilities = Capabilities(fp8_kv=True, pages=True, numerics=("hf", "reference"))
    fused_decode = True  # see set_fused_decode

    def __init__(self, cfg: Dsv4Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tp=None):
        """`tp`: a kvfold.parallel.TensorParallel of more than one rank shards every layer's query
        heads, output groups and routed experts (sharding.py); None runs the whole model here."""
        super().__init__(cfg, dtype, device)
        if tp is not None and tp.size > 1:
            check_divides(tp_counts(cfg), tp.size)
            self.tp = tp
        self.model = Dsv4Body(cfg, dtype, self.device, self.tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, self.device)
        self._on_device()
        # self.mtp: an MtpModule, built from `mtp.0.*` when the checkpoint has them

    def _on_device(self) -> None:
        cfg, rd = self.config, self.config.qk_rope_head_dim
        self.rope_main = RopeTable(rd, cfg.rope_theta, None, self.device)
        self.rope_compress = RopeTable(rd, cfg.compress_rope_theta, cfg.compress_yarn, self.device)
        # a placed model's layers read the tables of their own device (head's: the two above)
        self._ropes = {None: (self.rope_main, self.rope_compress)}
        if self.devices is not None:
            for name in self.devices.names:
                with self.devices.scope(name):
                    dev = self.devices.real(name)
                    pair = (RopeTable(rd, cfg.rope_theta, None, dev),
                            RopeTable(rd, cfg.compress_rope_theta, cfg.compress_yarn, dev))
                self.devices.tag([t.inv_freq for t in pair], name)
                self._ropes[name] = pair
            self.rope_main, self.rope_compress = self._ropes[self.devices.head]
        if self.mtp is not None:
            self.mtp.device = self.device

    def _placement_units(self):
        body = self.model
        return [body.embed_tokens], list(body.layers), \
            [body.norm, body.hc_head, self.lm_head, *([self.mtp] if self.mtp is not None else [])]

    # ---- numerics ----------------------------------------------------------------------------
    def set_numerics(self, mode: str) -> None:
        """"hf": plain fp32-style math (transformers' DeepseekV4ForCausalLM). "reference" (bf16
        models only): the official inference code's order of operations and roundings: FP8
        window/compressed KV (non-rope dims, blocks of 64), Hadamard + FP4 indexer queries and keys
        (blocks of 32), bf16 index scores, FP8 per-token activations into the release's FP8/FP4
        GEMMs, and the MoE, attention core and indexer orders of `numerics/reference.py`
        (docs/checkpoints.md cites the release function each follows)."""
        if mode not in ("hf", "reference"):
            raise ConfigError(f"numerics must be 'hf' or 'reference', got {mode!r}")
        ref = mode == "reference"
        if ref and self.dtype != torch.bfloat16:  # refused before any module changes
            raise ConfigError(
                f"numerics='reference' reproduces the release's bf16 activations (its default dtype); this model "
                f"is {self.dtype}: load it with dtype=torch.bfloat16 (CLI: --dtype bfloat16), or use numerics='hf'")
        if ref and self.batch_invariant:
            raise ConfigError("numerics='reference' keeps the release's order of roundings, which batch-invariant "
                              "mode does not; set_batch_invariant(False) first")
        for name, mod in self.named_modules():
            if isinstance(mod, Attention):
                mod.simulate_kv = ref
            elif isinstance(mod, Indexer):
                mod.entry_sim = "hadamard_fp4" if ref else None
            elif isinstance(mod, Compressor):
                mod.entry_sim = "fp8" if ref else None
            elif isinstance(mod, Experts):
                mod.act_quant = ref
            elif isinstance(mod, Linear):
                mod.act_quant = ref and official_quant_kind(name + ".weight") is not None
        self.numerics = mode
        # states hold rows computed under one numerics mode; keep them apart
        self.fingerprint = self.config.fingerprint() + ("" if mode == "hf" else "-ref")

    def set_fused_decode(self, on: bool = True) -> None:
        """On (the default): on the CPU, a step's decode rows run the whole model, or else each
        block, in one native call where they can (native_block.py), with the per-op path's bits.
        That call replaces the forwards of the modules it covers (the blocks and their norms,
        attention and MoE, the embedding, the mHC head, the final norm, the lm_head), so their
        forward hooks do not fire for those rows. Off: every module's forward runs, and its hooks
        see every row; the same bits, slower. Code that needs the hooks (a profiler) turns it off."""
        for module in (self, *(m for m in self.modules() if isinstance(m, Block))):
            module.fused_decode = bool(on)

    # ---- state -------------------------------------------------------------------------------
    @property
    def page_tokens(self) -> int:
        """Tokens per page of a `PagePool`: the lcm of 128 and every compress ratio."""
        n = 128
        for kind, r in zip(self.config.layer_types, self.config.compress_ratios):
            if kind != SLIDING:
                n = lcm(n, r)
        return n

    def _kv_nope(self, kv_dtype: str | None) -> int | None:
        if kv_dtype not in (None, "auto", "fp8"):
            raise ConfigError(f"kv_dtype must be None (the model dtype) or 'fp8', got {kv_dtype!r}")
        cfg = self.config
        return cfg.head_dim - cfg.qk_rope_head_dim if kv_dtype == "fp8" else None

    def new_page_pool(self, num_pages: int, kv_dtype: str | None = None) -> PagePool:
        """Preallocate `num_pages` shared pages for the compressed and indexer pools of this
        model's states (one page: `page_tokens` positions across every layer pool)."""
        nope, cfg = self._kv_nope(kv_dtype), self.config
        specs = []
        for i, (kind, ratio) in enumerate(zip(cfg.layer_types, cfg.compress_ratios)):
            dev = self.layer_device(i)  # a placed model's pages of a layer live with the layer
            if kind != SLIDING:
                specs.append(PoolSpec(i, COMPRESSOR, ratio, cfg.head_dim, nope, device=dev))
            if kind == CSA:
                specs.append(PoolSpec(i, INDEXER, ratio, cfg.index_head_dim, device=dev))
        pool = PagePool(specs, num_pages, self.page_tokens, self.dtype, self.device, fingerprint=self.fingerprint,
                        kv_fp8=nope is not None)
        self._tag_layers(pool.storages.items(), lambda key: key[0])
        return pool

    def new_state(self, capacity: int = 4096, max_rewind: int = 0, kv_dtype: str | None = None, *,
                  pages: PagePool | None = None, prefix_pages: list[int] | None = None,
                  arena: SlotArena | None = None) -> Dsv4State:
        """Reserve every buffer of one sequence for `capacity` tokens (never grown later).

        `kv_dtype="fp8"` stores window rows and compressed entries as float8_e4m3fn at unit
        scale (non-rope dims; rope dims stay exact in the model dtype).

        `pages`: keep the compressed and indexer pools in that shared `PagePool` (from
        `new_page_pool`, with the same kv_dtype): the state takes ceil(capacity / page_tokens)
        pages up front and returns them on `free()`. `prefix_pages`: the first pages taken by
        reference from another holder (a prefix-cache entry); such a state must restore the
        snapshot taken at their end (`snapshot(pools=False)`) before it runs. `arena`: hold the
        rings in a free slot of that `SlotArena` (from `new_decode_arena`, with its `pages`), where
        a captured decode graph reads them (graph_step.py). Refusals (PagesExhaustedError and
        ArenaFullError included) allocate nothing."""
        if capacity < 1 or max_rewind < 0:
            raise CapacityError(f"capacity must be >= 1 and max_rewind >= 0 (got {capacity}, {max_rewind})")
        nope = self._kv_nope(kv_dtype)
        cfg = self.config
        table: list[int] = []
        if pages is None and prefix_pages:
            raise ConfigError("prefix_pages needs pages=<the PagePool they belong to>")
        if arena is not None:
            if self.devices is not None:
                raise ConfigError("a SlotArena holds a graph step's states on one device; a placed model's states "
                                  "live with their layers: leave arena out")
            if nope is not None:
                raise ConfigError("a state in a SlotArena stores its KV in the model dtype; use kv_dtype=None")
            arena.check_fits(capacity, max_rewind, pages, self.fingerprint)
        if pages is not None:
            table = pages.take_table(capacity, prefix_pages, fingerprint=self.fingerprint, dtype=self.dtype,
                                     device=self.device, kv_fp8=nope is not None)
        slot = arena.take() if arena is not None else None
        layers, memos = [], {}  # one row-map memo per device: a page table's index lives with its pool
        for i, (kind, ratio) in enumerate(zip(cfg.layer_types, cfg.compress_ratios)):
            dev = self.layer_device(i)  # a layer's state lives on its device only (placed.py)
            window = arena.ring((i, "window"), slot) if arena is not None else \
                PositionRing(cfg.sliding_window + max_rewind, cfg.head_dim, self.dtype, dev, fp8_nope=nope)
            ls = LayerState(window=window)
            rows = -(-capacity // ratio) if ratio else 0
            for pool_kind, width in ((COMPRESSOR, cfg.head_dim), (INDEXER, cfg.index_head_dim)):
                if kind == SLIDING or (pool_kind == INDEXER and kind != CSA):
                    continue
                view = pages.view(i, pool_kind, table, rows, memos.setdefault(self._device_name(i), {})) \
                    if pages is not None else None
                rings = None if arena is None else \
                    (arena.ring((i, pool_kind, "kv"), slot), arena.ring((i, pool_kind, "score"), slot))
                c = compressor_state(ratio, kind == CSA, width, capacity, max_rewind, self.dtype, dev,
                                     fp8_nope=nope if pool_kind == COMPRESSOR else None, pool=view, rings=rings)
                setattr(ls, pool_kind, c)
            layers.append(ls)
        state = Dsv4State(layers, window=cfg.sliding_window, capacity=capacity, max_rewind=max_rewind,
                          fingerprint=self.fingerprint, device=self.device, dtype=self.dtype, kv_fp8=nope is not None,
                          pages=pages, page_table=table, arena=arena, slot=slot,
                          prefix_tokens=len(prefix_pages or []) * pages.page_tokens if pages is not None else 0)
        if arena is not None:
            arena.bind(slot, state)
        state.dev_set = self.dev_set
        self._tag_layers(enumerate(layers), lambda i: i)
        return state

    def new_decode_arena(self, slots: int, capacity: int, pages: PagePool, max_rewind: int = 0) -> SlotArena:
        """Fixed-address rings for `slots` states of up to `capacity` tokens whose pools live in
        `pages`: what a captured decode graph reads (graph_step.py)."""
        from .graph_step import arena_specs
        return SlotArena(arena_specs(self.config, self.dtype, max_rewind), slots, pages, capacity=capacity,
                         max_rewind=max_rewind, fingerprint=self.fingerprint)

    # ---- a decode step a CUDA graph captures (graph_step.py; engine/graphs.py replays it) -------
    def graph_tensors(self) -> list[torch.Tensor]:
        """Tensors the capturable step reads that are no parameter or buffer: the rope tables'."""
        return [self.rope_main.inv_freq, self.rope_compress.inv_freq]

    def graph_unsupported(self, batch_invariant: bool | None = None) -> str | None:
        """CausalLM.graph_unsupported; and the reference numerics run in the forward only."""
        if self.numerics != "hf":
            return "graph decode runs numerics='hf'; the reference numerics' roundings run in the forward only"
        return super().graph_unsupported(batch_invariant)

    def graph_invariance_unsupported(self) -> str | None:
        """Where the model's batch-invariant Backend runs the Triton kernels (`KernelSet.triton`),
        the graph step keeps batch invariance: its token-parallel ops take the fixed-order row
        kernels (triton_rows), and its attention, index scores and top-k and experts are Triton
        kernels of one program per row (graph_step.py)."""
        why = self._invariance_unsupported()
        if why is not None:
            return why
        ops = self.backend(True)
        if ops.sparse_attention.triton is None or ops.row_mm.rows is None:
            return ("graph decode keeps batch invariance only with the Triton kernels, one program per row: turn "
                    "them on (model.set_kernels(KernelSet(triton=True)), or KVFOLD_TRITON=1 at load; CUDA with "
                    "triton installed)")
        return None

    def decode_graph_step(self, ops: Backend, arena: SlotArena, tokens: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor, context: int | None = None, extras: torch.Tensor | None = None):
        """One token per row, shapes fixed by the inputs' length and `context` (a bound on every
        position + 1), with the kernels of `ops` (`backend(...)` in the caller's mode): (logits
        [N, vocab] fp32, final streams [N, hc, hidden]). `extras` [N, E]: each row's state's
        `graph_inputs`. No checks and no cursor moves: the caller (engine/graphs.py) does both."""
        from .graph_step import decode_step
        return decode_step(self, ops, arena, tokens, positions, slots, context)  # (V4's states plan nothing)

    # ---- forward: the rows of one model call (CausalLM runs the chunk loop and the checks) ----
    def _run_rows(self, batch: RowBatch, last_only: bool | list[bool]) -> tuple[list[torch.Tensor], torch.Tensor]:
        walk = Walk(self, batch, self._rope_rows)  # a placed model's devices (one device: no moves)
        fused = model_row(self, batch) if self.devices is None else None  # decode rows: one native call
        if fused is not None:
            logits, streams = fused  # every row's
            if any(seg.length > 1 for seg in batch.segments):  # verify rows: keep the scored ones
                logits = logits[batch.scored_rows(last_only)]
        else:
            name = walk.name("embed")
            b, _ = walk.enter(name, batch.token_ids)
            with walk.scope(name):
                streams = self.model.embed_tokens(b.token_ids)[:, None, :].expand(-1, self.config.hc_mult, -1)
                streams = streams.contiguous()
            for i, block in enumerate(self.model.layers):
                b, streams = walk.enter(walk.name(i), streams)
                with walk.scope(walk.name(i)):
                    streams = block(streams, b)
            b, streams = walk.enter(walk.name("head"), streams)
        for seg in batch.segments:
            seg.state.pos = seg.state.written_until = seg.start + seg.length
        if fused is None:
            with walk.scope(walk.name("head")):
                h = streams[b.scored_rows(last_only)]
                logits = self.lm_head(self.model.norm(self.model.hc_head(h, b.ops), b.ops), b.ops).float()
        return batch.split_scored(logits, last_only), streams

    def _rope_rows(self, batch: RowBatch, name: str | None) -> None:
        """The RoPE rows of a call's positions, from the tables of device `name` (Walk's `prepare`)."""
        rope_main, rope_compress = self._ropes[name]
        batch.rope[SLIDING] = (rope_main, *rope_main.cos_sin(batch.ops, batch.positions))
        if any(k != SLIDING for k in self.config.layer_types):
            batch.rope["compressed"] = (rope_compress, *rope_compress.cos_sin(batch.ops, batch.positions))

    # ---- accounting ----------------------------------------------------------------------------
    def state_layout(self, max_rewind: int = 0, kv_dtype: str | None = None) -> tuple[int, list[tuple[int, int]]]:
        """CausalLM.state_layout from the config: per layer a window ring of sliding_window +
        max_rewind rows; per compressor (and CSA indexer) two fp32 rings of its open windows
        (kv, score) and one pool row per `ratio` tokens."""
        nope, cfg = self._kv_nope(kv_dtype), self.config
        fixed, pools = 0, []
        for kind, ratio in zip(cfg.layer_types, cfg.compress_ratios):
            fixed += (cfg.sliding_window + max_rewind) * kv_row_bytes(cfg.head_dim, self.dtype, nope)
            compressors = [] if kind == SLIDING else [(cfg.head_dim, kind == CSA, nope)]
            if kind == CSA:
                compressors.append((cfg.index_head_dim, True, None))
            for width, overlap, fp8 in compressors:
                ring_rows = compressor_ring_rows(ratio, overlap, max_rewind)
                fixed += 2 * ring_rows * kv_row_bytes((2 if overlap else 1) * width, torch.float32, None)
                pools.append((ratio, kv_row_bytes(width, self.dtype, fp8)))
        return fixed, pools

    # ---- multi-token prediction: what the MTP drafter (decoding/drafters.py) calls --------------
    # (supports_mtp, from CausalLM: the checkpoint shipped the MTP block `mtp.0.*`)
    def new_mtp_state(self, capacity: int, max_rewind: int) -> Dsv4State:
        """A state for the MTP block's own sliding window (needs `supports_mtp`)."""
        return self.mtp.new_state(capacity=capacity, max_rewind=max_rewind)

    def mtp_step(self, hidden: torch.Tensor, token_ids, mtp_state: Dsv4State, ops: Backend | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance `mtp_state` over T positions (needs `supports_mtp`). `hidden` [T, hc, d]: this
        model's final streams there (`forward(..., return_hidden=True)`), or the previous step's
        output streams when drafting ahead; `token_ids`: the T tokens one position later; `ops`: the
        kernels to run (None: `backend()`, the model's own mode). Returns (logits [T, vocab] for the
        tokens two positions ahead, output streams [T, hc, d])."""
        with self._head_scope():
            return self.mtp.step(self, hidden, token_ids, mtp_state, self.backend() if ops is None else ops)

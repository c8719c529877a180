"""GLM-5.3 (`glm5_next`) text model: one `forward(tokens, state)` for any chunk length.

Layers are KDA linear attention (`kda.py`) or indexed MLA with DSA (`mla.py`), each
with mHC residual streams (4 in GLM-5.3-Flash; the final head is a plain mean over the streams) and
a dense SwiGLU MLP or a sigmoid-routed MoE with a shared expert. All per-sequence data lives in the
`Glm5State` passed in (`state.py`). Prefill, chunked prefill, decode and verify are the
same code with different T.

Weights are named as the text part of a transformers `Glm5NextForConditionalGeneration` checkpoint
written by `save_pretrained` (`model.language_model.*`, `hc_attn_fn`, `q_conv1d`, per-expert
`experts.N.gate_proj`); `load_glm5` also reads the in-memory layout (`attn_hc.fn`, fused `conv1d`,
`forget_gate.*`, stacked `experts.gate_up_proj`) and text-only `model.*` names.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ...errors import CapacityError, CheckpointError, ConfigError, KvfoldError
from .config import KDA, Glm5Config, load_glm5_config
from ...layers.basic import Linear, _param
from .kda import KdaAttention
from ...layers.mhc import HyperConnection
from .mla import GlmRMSNorm, IndexedMLA
from ...layers.moe import Experts, SharedExpert, SwiGluMLP
from ...layers.rows import RowBatch
from ...numerics.rows import invariance_unsupported, invariant_rows, own_rows, route_rows, row_mm, rows_invariant
from .indexer_state import Glm5NextDsaState
from .state import Glm5State, KdaLayerState, MlaLayerState
from ..chunks import run_batch_in_rounds, run_in_chunks
from ..deepseek_v4.model import Embedding, as_token_ids


def stream_mean(streams: torch.Tensor) -> torch.Tensor:
    """The mean of [T, hc, d] over its hc streams, summed left to right: elementwise IEEE adds, so a
    row's bits never depend on its batch (a reduction kernel may split the sum by tensor size)."""
    acc = streams[:, 0]
    for k in range(1, streams.shape[1]):
        acc = acc + streams[:, k]
    return acc / streams.shape[1]


class Glm5Router(nn.Module):
    """Sigmoid scores; the correction bias (and the group limit) choose the experts, never weigh them."""

    def __init__(self, cfg: Glm5Config, device=None):
        super().__init__()
        self.k, self.scale, self.norm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if rows_invariant():
            return route_rows(x, self.weight, "sigmoid", self.k, self.scale, bias=self.e_score_correction_bias,
                              n_group=self.n_group, topk_group=self.topk_group, renorm=self.norm)
        scores = torch.sigmoid(row_mm(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            gscore = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :self.topk_group]
            gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~gmask[..., None].expand_as(grouped).reshape(t, e), float("-inf"))
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :self.k]  # ties -> lower id
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


class Glm5MoE(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate = Glm5Router(cfg, device)
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = SharedExpert(cfg, dtype, device) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)


class Glm5Block(nn.Module):
    def __init__(self, cfg: Glm5Config, i: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.kind = cfg.layer_types[i]
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc, device=device)
        self.ffn_hc = HyperConnection(*hc, device=device)
        self.input_layernorm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if self.kind == KDA:
            self.self_attn = KdaAttention(cfg, dtype, device)
        else:
            self.self_attn = IndexedMLA(cfg, cfg.indexer_types[i] == "full", dtype, device)
        self.mlp = Glm5MoE(cfg, dtype, device) if cfg.mlp_layer_types[i] == "sparse" else SwiGluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, dtype, device)


class Glm5Body(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Glm5Block(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = GlmRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Glm5Model(nn.Module):
    max_chunk = 2048  # longer inputs run as consecutive chunks, bounding memory
    numerics = "hf"

    def __init__(self, cfg: Glm5Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = Glm5Body(cfg, dtype, self.device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, self.device)
        self.tokenizer = None
        self.mtp = None
        self.fingerprint = cfg.fingerprint()
        # on by default wherever it can hold: it costs little (bench/RESULTS.md)
        self.batch_invariant = self.supports_batch_invariance

    def set_numerics(self, mode: str) -> None:
        if mode != "hf":
            raise ConfigError(f"glm5_next supports numerics 'hf' only, got {mode!r}")

    def set_batch_invariant(self, on: bool = True) -> None:
        """As Dsv4Model.set_batch_invariant: batching never changes a row's bits (fp32 CPU only)."""
        why = invariance_unsupported(self.dtype, self.device) if on else None
        if why is not None:
            raise ConfigError(why + "; use set_batch_invariant(False) (Engine(batch_invariant=False))")
        self.batch_invariant = bool(on)

    @property
    def supports_batch_invariance(self) -> bool:
        return invariance_unsupported(self.dtype, self.device) is None

    # ---- state --------------------------------------------------------------------------------
    def new_state(self, capacity: int = 4096, max_rewind: int = 0, kv_dtype: str | None = None) -> Glm5State:
        """Reserve every buffer of one sequence for `capacity` tokens (never grown later);
        `max_rewind` KDA states are kept for rewinding (see state.py)."""
        if capacity < 1 or max_rewind < 0:
            raise CapacityError(f"capacity must be >= 1 and max_rewind >= 0 (got {capacity}, {max_rewind})")
        if kv_dtype not in (None, "auto"):
            raise ConfigError(f"glm5_next stores its latent cache in the model dtype; kv_dtype {kv_dtype!r} "
                              f"is not supported")
        cfg, dev, dt = self.config, self.device, self.dtype
        slots = max_rewind + 1
        kp = max(cfg.index_kpool, 1)
        dsa_cap = -(-capacity // kp) * kp  # whole pools, at least capacity rows
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            if kind == KDA:
                c3 = 3 * cfg.linear_num_heads * cfg.linear_head_dim
                layers.append(KdaLayerState(
                    conv=torch.zeros(slots, cfg.linear_conv_kernel_dim - 1, c3, dtype=dt, device=dev),
                    rec=torch.zeros(slots, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim,
                                    dtype=torch.float32, device=dev)))
            else:
                dsa = Glm5NextDsaState(dsa_cap, cfg.index_head_dim, kp, dtype=dt, device=dev) \
                    if cfg.indexer_types[i] == "full" else None
                layers.append(MlaLayerState(latent=torch.zeros(capacity, cfg.kv_lora_rank, dtype=dt, device=dev),
                                            dsa=dsa))
        return Glm5State(layers, capacity=capacity, max_rewind=max_rewind, fingerprint=self.fingerprint,
                         device=dev, dtype=dt)

    # ---- forward ------------------------------------------------------------------------------
    def _as_ids(self, token_ids) -> torch.Tensor:
        return as_token_ids(token_ids, self.config.vocab_size, self.device)

    def _check(self, ids: torch.Tensor, state: Glm5State) -> None:
        state.check_usable(self.fingerprint, self.device, self.dtype)
        if state.pos + ids.numel() > state.capacity:
            raise CapacityError(
                f"forward of {ids.numel()} tokens at pos {state.pos} would pass the state's capacity "
                f"{state.capacity}; create the state with a larger new_state(capacity=...)")

    @torch.no_grad()
    def forward(self, token_ids, state: Glm5State, return_hidden: bool = False, last_only: bool = False):
        """Consume T >= 1 tokens at positions state.pos.. and return their logits [T, vocab] (with
        `return_hidden`, also the final residual streams [T, hc_mult, hidden]); `last_only` returns
        just the last row's logits [1, vocab]. Every check runs before any buffer is written."""
        ids = self._as_ids(token_ids)
        self._check(ids, state)
        return run_in_chunks(self._forward_chunk, ids, state, self.max_chunk, last_only, return_hidden)

    def forward_batch(self, batch, last_only: bool = True) -> list[torch.Tensor]:
        """Advance several sequences: each (token_ids, state) as `forward` would. Every pair is
        validated before any state is touched."""
        checked = []
        for ids, st in batch:
            ids = self._as_ids(ids)
            self._check(ids, st)
            checked.append((ids, st))
        if len({id(st) for _, st in checked}) != len(checked):
            raise KvfoldError("forward_batch got the same state twice; a state advances once per call")
        return run_batch_in_rounds(self._forward_rows, checked, self.max_chunk, last_only)

    def _forward_chunk(self, ids: torch.Tensor, state: Glm5State, last_only: bool = False):
        logits, streams = self._forward_rows([(ids, state)], last_only)
        return logits[0], streams[:ids.numel()]

    def _forward_rows(self, pieces: list, last_only: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One model call over the concatenated rows of every (ids, state) piece (layers/rows.py):
        mHC, norms and MLPs run on all rows at once, attention per sequence on its own state."""
        with invariant_rows(self.batch_invariant):
            return self._run_rows(RowBatch.build(pieces, self.device), last_only)

    def _run_rows(self, batch: RowBatch, last_only: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        for seg in batch.segments:
            seg.state._sync_dsa()
        streams = self.model.embed_tokens(batch.token_ids)[:, None, :].expand(-1, self.config.hc_mult, -1)
        streams = streams.contiguous()
        sels: list = [None] * len(batch.segments)  # each sequence's DSA selection, shared down its layers
        for i, block in enumerate(self.model.layers):
            x, post, comb = block.attn_hc.collapse(streams)
            x = block.input_layernorm(x)
            y = x.new_zeros(x.shape) if len(batch.segments) > 1 else None
            invariant = rows_invariant()
            for s, seg in enumerate(batch.segments):
                xs = own_rows(x, seg.rows) if invariant and seg.length > 1 else x[seg.rows]
                ys = self._attend(block, xs, seg, seg.state.layers[i], sels, s)
                if y is None:
                    y = ys
                else:
                    y[seg.rows] = ys
            streams = HyperConnection.expand(streams, y, post, comb)
            x, post, comb = block.ffn_hc.collapse(streams)
            x = block.post_attention_layernorm(x)
            y = block.mlp(x)
            streams = HyperConnection.expand(streams, y, post, comb)
        for seg in batch.segments:
            seg.state.pos = seg.state.written_until = seg.start + seg.length
        last = streams[batch.last_rows()] if last_only else streams
        logits = self.lm_head(self.model.norm(stream_mean(last))).float()
        if last_only:
            return [logits[i:i + 1] for i in range(len(batch.segments))], streams
        return [logits[seg.rows] for seg in batch.segments], streams

    @staticmethod
    def _attend(block, x: torch.Tensor, seg, ls, sels: list, s: int) -> torch.Tensor:
        """One sequence's attention in one layer: KDA keeps the recurrent states of its last
        max_rewind + 1 positions; DSA layers pass their selection on to the next."""
        state, start, t = seg.state, seg.start, seg.length
        if block.kind == KDA:
            record = min(t, state.max_rewind + 1)
            first_rec = start + t - record + 1  # positions whose KDA states are kept
            s0 = state.slot(start)
            y, states = block.self_attn(x, ls.conv[s0], ls.rec[s0], record)
            for j, (conv, rec) in enumerate(states):
                slot = state.slot(first_rec + j)
                ls.conv[slot] = conv
                ls.rec[slot] = rec
            return y
        y, sels[s] = block.self_attn(x, start, ls.latent, ls.dsa, sels[s])
        return y

    # ---- accounting ---------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.parameters()) + sum(t.nbytes for t in self.buffers())

    def state_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Bytes each further token of capacity adds: the MLA latent of every DSA layer and the
        indexer rows (k, gate in the model dtype, one validity byte) of every full DSA layer."""
        cfg, esz = self.config, torch.finfo(self.dtype).bits // 8
        return float(len(cfg.dsa_layers) * cfg.kv_lora_rank * esz
                     + len(cfg.full_dsa_layers) * (2 * cfg.index_head_dim * esz + 1))

    def state_layout(self) -> tuple[int, list[tuple[int, int]]]:
        """(fixed bytes, [(ratio, bytes per row)]) such that a state of capacity c holds exactly
        fixed + sum(ceil(c / ratio) * row) bytes (the engine's admission formula): the latent rows
        per token, the indexer rows per whole k-pool (its buffers round capacity up to pools)."""
        cfg, esz = self.config, torch.finfo(self.dtype).bits // 8
        kp = max(cfg.index_kpool, 1)
        pools = [(1, len(cfg.dsa_layers) * cfg.kv_lora_rank * esz)]
        if cfg.full_dsa_layers:
            pools.append((kp, kp * len(cfg.full_dsa_layers) * (2 * cfg.index_head_dim * esz + 1)))
        return self.fixed_state_bytes(0), pools

    def fixed_state_bytes(self, max_rewind: int = 0, kv_dtype: str | None = None) -> int:
        """Bytes of a state that do not grow with capacity: the KDA rings (max_rewind + 1 slots)."""
        cfg, esz = self.config, torch.finfo(self.dtype).bits // 8
        c = cfg.linear_num_heads * cfg.linear_head_dim
        per_slot = c * cfg.linear_head_dim * 4 + (cfg.linear_conv_kernel_dim - 1) * 3 * c * esz
        return len(cfg.kda_layers) * (max_rewind + 1) * per_slot


# ---- loading ------------------------------------------------------------------------------------
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.")
_VISION_MARKERS = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.")
_HC_NAMES = {"hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
             "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale"}


def _checkpoint_tensors(directory: Path):
    from safetensors import safe_open
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _internal(name: str, n_layers: int) -> tuple[str, str | None]:
    """(kind, internal name): kind "text", "vision" or "skip" (MTP layers, shared heads)."""
    bare = name
    for m in ("model.", ""):
        if any(bare.startswith(m + v) for v in _VISION_MARKERS):
            return "vision", None
    if bare == "lm_head.weight" or bare.startswith("lm_head."):
        return "text", bare
    for p in _TEXT_PREFIXES:
        if bare.startswith(p):
            bare = bare[len(p):]
            break
    else:
        return "skip", None
    parts = bare.split(".")
    if parts[0] == "layers":
        if int(parts[1]) >= n_layers or "shared_head" in parts or parts[2] in ("eh_proj", "enorm", "hnorm"):
            return "skip", None
        if parts[2] in _HC_NAMES:
            parts = parts[:2] + _HC_NAMES[parts[2]].split(".") + parts[3:]
        if parts[2] == "self_attn" and parts[3] == "forget_gate":
            parts = parts[:3] + parts[4:]
    return "text", "model." + ".".join(parts)


@torch.no_grad()
def load_glm5_weights(model: Glm5Model, directory: Path) -> None:
    cfg = model.config
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen: set[str] = set()
    experts: dict[tuple[str, int, str], torch.Tensor] = {}
    n_vision = 0

    def put(name: str, t: torch.Tensor) -> None:
        if name not in params:
            raise CheckpointError(f"checkpoint tensor {name} has no place in the glm5_next model")
        p = params[name]
        if tuple(p.shape) != tuple(t.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        p.copy_(t.to(p.dtype))
        seen.add(name)

    for raw, t in _checkpoint_tensors(directory):
        kind, name = _internal(raw, cfg.num_hidden_layers)
        if kind == "vision":
            n_vision += 1
            continue
        if kind == "skip":
            continue
        parts = name.split(".")
        if ".self_attn.conv1d.weight" in name:  # in-memory layout: fused q|k|v taps
            pre = name[:-len("conv1d.weight")]
            for sub, piece in zip(("q", "k", "v"), t.chunk(3, dim=0)):
                put(f"{pre}{sub}_conv1d", piece)
            continue
        if ".self_attn." in name and name.endswith("_conv1d.weight"):
            put(name[:-len(".weight")], t)
            continue
        if len(parts) >= 8 and parts[4] == "experts" and parts[5].isdigit():  # experts.N.gate_proj.weight
            experts[(".".join(parts[:5]), int(parts[5]), parts[6])] = t
            continue
        put(name, t)
    for (pre, e, which), t in experts.items():
        if which in ("gate_proj", "up_proj"):
            p = params.get(pre + ".gate_up_proj")
            if p is None:
                raise CheckpointError(f"checkpoint expert {pre}.{e} has no place in the glm5_next model")
            i = cfg.moe_intermediate_size
            rows = slice(0, i) if which == "gate_proj" else slice(i, 2 * i)
            p[e, rows].copy_(t.to(p.dtype))
        elif which == "down_proj":
            params[pre + ".down_proj"][e].copy_(t.to(params[pre + ".down_proj"].dtype))
        else:
            raise CheckpointError(f"unknown expert tensor {pre}.{e}.{which}")
        seen.add(pre + (".down_proj" if which == "down_proj" else ".gate_up_proj"))
    if "lm_head.weight" not in seen and cfg.tie_word_embeddings and "model.embed_tokens.weight" in seen:
        params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} glm5_next tensors, e.g. {missing[:5]}")
    if n_vision:
        print(f"kvfold: note: ignoring {n_vision} vision tensors (glm5_next is loaded as a text model)",
              file=sys.stderr)


def load_glm5(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              numerics: str = "hf", weights: str = "dequant") -> Glm5Model:
    directory = Path(directory)
    if numerics != "hf":
        raise ConfigError(f"glm5_next supports numerics 'hf' only, got {numerics!r}")
    if weights != "dequant":
        raise ConfigError(f"glm5_next loads float weights only (weights='dequant'), got {weights!r}")
    cfg = load_glm5_config(directory)
    model = Glm5Model(cfg, dtype=dtype, device=device)
    load_glm5_weights(model, directory)
    try:
        from ...tokenizer import load_tokenizer
        model.tokenizer = load_tokenizer(str(directory), cfg.bos_token_id, cfg.eos_ids[0] if cfg.eos_ids else None,
                                         cfg.vocab_size)
    except ConfigError as e:
        print(f"kvfold: note: {e}", file=sys.stderr)
    return model.eval()

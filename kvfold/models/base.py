"""What every model family shares: one `forward` for any chunk length, `forward_batch` over many
sequences, the chunk loop, the checks that run before any write, batch invariance, and the byte
accounting the engine admits requests by.

A family (models/deepseek_v4, models/glm5) subclasses `CausalLM` and implements its rows
(`_run_rows`: one model call over a `RowBatch`), `new_state` and `state_layout`, and declares
what it supports in `capabilities`; the engine and the server read those, never probe.
"""
from __future__ import annotations

import contextlib
import functools

from array import array
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CapacityError, ConfigError, InvalidInputError, KvfoldError, PlacementError
from ..layers.basic import QuantizedWeight, _param, native_weights
from ..layers.rows import RowBatch
from ..numerics.backend import Backend, KernelSet, build_backend, invariance_by_default, invariance_unsupported
from .chunks import run_batch_in_rounds, run_in_chunks


@dataclass(frozen=True)
class Capabilities:
    fp8_kv: bool = False  # new_state(kv_dtype="fp8")
    pages: bool = False  # new_page_pool() and new_state(pages=...): compressed KV in shared pages
    numerics: tuple[str, ...] = ("hf",)  # the modes set_numerics accepts


def as_token_ids(token_ids, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A non-empty 1-D LongTensor of ids in [0, vocab_size) on `device`, or InvalidInputError."""
    if isinstance(token_ids, (list, tuple)) and token_ids and len(token_ids) <= 64 \
            and all(type(t) is int for t in token_ids):  # a short list (decode): checked in Python
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise InvalidInputError(f"token ids must lie in [0, {vocab_size}); got range "
                                    f"[{min(token_ids)}, {max(token_ids)}]")
        ids = torch.frombuffer(array("q", token_ids), dtype=torch.long)
        return ids if device.type == "cpu" else ids.to(device)
    ids = torch.as_tensor(token_ids, dtype=torch.long) if not isinstance(token_ids, torch.Tensor) \
        else token_ids.long()
    if ids.dim() != 1 or ids.numel() == 0:
        raise InvalidInputError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise InvalidInputError(f"token ids must lie in [0, {vocab_size}); got range [{lo}, {hi}]")
    return ids.to(device)


class Embedding(nn.Module):
    """Token rows of `weight`: a float parameter, or a `QuantizedWeight` (bf16 in an fp32 model, as
    the release stores the embedding) of which only the looked-up rows are decoded."""

    quantizable = ("weight",)

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _param(vocab, hidden, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._parameters.get("weight")
        if w is None:
            return self.weight.rows(ids.reshape(-1)).view(*ids.shape, -1)
        if ids.dim() == 1:
            return torch.index_select(w, 0, ids)  # the same rows as indexing, with less overhead
        return w[ids]


class CausalLM(nn.Module):
    capabilities = Capabilities()
    max_chunk = 2048  # longer inputs run as consecutive chunks (exact by construction), bounding memory
    numerics = "hf"
    dot = "fp32"  # the dot product of the matmuls on weights held as stored (`set_dot`)

    def __init__(self, config, dtype: torch.dtype, device: str | torch.device):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = None
        self.mtp = None  # an MTP block, where the family has one and the checkpoint holds it
        self.tp = None  # a kvfold.parallel.TensorParallel when this rank holds a shard of the model
        self.devices = None  # a models.placed.DeviceMap once `place` split the model across devices
        self.fingerprint = config.fingerprint()
        self.kernels = KernelSet.from_env()  # which kernel families may run (`set_kernels`)
        self._backends: dict[tuple, Backend] = {}
        # on by default where native.c holds it: it costs little there (bench/RESULTS.md)
        self.batch_invariant = invariance_by_default(self.device, self.dtype, self.kernels)

    def materialize_(self, device: str | torch.device) -> None:
        """A model built on the meta device (its shapes only) gets its tensors on `device`: every
        meta parameter and buffer is allocated there, empty, for the loader to fill, and what the
        family computes at construction is computed there (`_on_device`). The checkpoint loader
        builds on meta where it keeps weights quantized, so the float placeholders of the weights
        it holds as stored are never allocated (V4-Flash's would be 1.1 TB of fp32)."""
        device = torch.device(device)
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device),
                                                            requires_grad=p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device=device)
        self.device = device
        self._backends.clear()
        self.batch_invariant = invariance_by_default(self.device, self.dtype, self.kernels)
        self._on_device()

    def _on_device(self) -> None:
        """What the family builds from the device besides parameters and buffers (after `materialize_`)."""

    # ---- placement across one accelerator and host memory (models/placed.py) -------------------
    def _placement_units(self) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
        """(the embedding's modules, the blocks in order, the head's modules: its norms, lm_head and
        the MTP block): what a placement puts on a device as a whole. Each block's routed experts
        are `block.mlp.experts` where it has them."""
        raise NotImplementedError

    def place(self, placement, virtual=None, expert_policy: str = "static") -> None:
        """Split this model as `placement` (a kvfold.placement.Placement, from `kvfold plan`,
        `--gpu-layers`/`--gpu-experts` or a device map) says: each block, the embedding and the
        head move to their device; a card layer's routed experts outside its card set stay on the
        host (models/split_experts.py). States made before are refused from then on (their
        layers live elsewhere: the seed's `dev_set`). `virtual`: a VirtualDevices test mode, in
        which every device is the CPU and the mode checks each part runs on its own side.
        `expert_policy`: "static" (a card layer holds its placement's expert set) or "lru" (as
        many card slots, holding the experts used most recently; split_experts.py). Every check
        runs before anything moves (PlacementError)."""
        from .placed import DeviceMap
        from .split_experts import POLICIES, SplitExperts
        if self.tp is not None:
            raise ConfigError("a placement splits one whole model across an accelerator and the host; this one is "
                              "a tensor-parallel shard")
        if self.devices is not None:
            raise ConfigError("this model is placed already; load it again to place it another way")
        if expert_policy not in POLICIES:
            raise PlacementError(f"expert_policy must be one of {', '.join(POLICIES)}, got {expert_policy!r}")
        devmap = DeviceMap(placement, virtual)
        embed, blocks, head = self._placement_units()
        moes = [getattr(b.mlp, "experts", None) for b in blocks]
        devmap.check_model(len(blocks), [m is not None for m in moes], self.config.n_routed_experts)
        for i, (block, experts) in enumerate(zip(blocks, moes)):
            name = devmap.layer(i)
            card = devmap.card_experts(i)
            if card is not None:  # split on the host, where the stacks are, before the layer moves
                block.mlp.experts = SplitExperts(experts, card, devmap, name, self._side_backend, expert_policy)
            self._move(devmap, block, name)
            if card is not None:  # the pack's host stack stayed (SplitExperts._apply)
                block.mlp.experts.tag_host()
        for modules, name in ((embed, devmap.embed), (head, devmap.head)):
            for m in modules:
                self._move(devmap, m, name)
        self.devices = devmap
        self.device = devmap.real(devmap.head)
        self._backends.clear()
        self.batch_invariant = self.invariant_by_default
        self._on_device()

    def expert_hits(self) -> tuple[int, int]:
        """(routed (row, slot) pairs a card's partial pack served, all pairs routed in layers with a
        partial pack) since load: the pack's hit rate (0, 0 on a model without one)."""
        from .split_experts import SplitExperts
        packs = [m for m in self.modules() if isinstance(m, SplitExperts)]
        return sum(m.hits for m in packs), sum(m.slots for m in packs)

    @staticmethod
    def _move(devmap, module: nn.Module, name: str) -> None:
        with devmap.scope(name):
            module.to(devmap.real(name))
        devmap.tag([*module.parameters(), *module.buffers()], name)

    def _side_backend(self, name: str, ops: Backend) -> Backend:
        """The kernels of device `name` in the mode of `ops` (what a split layer's host experts run)."""
        return self.backend(ops.batch_invariant, self.devices.real(name))

    def _real_devices(self) -> list[torch.device]:
        if self.devices is None:
            return [self.device]
        return sorted({self.devices.real(n) for n in self.devices.names}, key=str)

    def _embed_at_head(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows of `ids` on the head's device, where an MTP block reads them."""
        d, embed = self.devices, self.model.embed_tokens
        if d is None or d.embed == d.head:
            return embed(ids)
        with d.scope(d.embed):
            rows = embed(d.hop(ids, d.embed))
        return d.hop(rows, d.head)

    def _head_scope(self):
        """The head's part of a placed model (the MTP block runs there)."""
        return contextlib.nullcontext() if self.devices is None else self.devices.scope(self.devices.head)

    def _tag_layers(self, items, layer_of) -> None:
        """Test mode (VirtualDevices): tag each (key, buffers) with the device of layer `layer_of(key)`."""
        if self.devices is not None:
            for key, obj in items:
                self.devices.tag(obj, self.devices.layer(layer_of(key)))

    @property
    def dev_set(self) -> tuple[str, ...] | None:
        """Each layer's device (None: the whole model on `device`); a state keeps the set it was made for."""
        return None if self.devices is None else self.devices.dev_set

    def _device_name(self, i: int) -> str | None:
        """Layer i's device name in the placement (None on one device)."""
        return None if self.devices is None else self.devices.layer(i)

    def layer_device(self, i: int) -> torch.device:
        """The device layer i's weights and state live on."""
        return self.device if self.devices is None else self.devices.real(self.devices.layer(i))

    @property
    def supports_mtp(self) -> bool:
        """Whether an MTP block is loaded (speculative="mtp"); the family provides new_mtp_state and mtp_step."""
        return self.mtp is not None

    def mtp_state_bytes(self, capacity: int, max_rewind: int) -> int:
        """Bytes of `new_mtp_state(capacity, max_rewind)` (needs `supports_mtp`), known before allocating it."""
        return self.mtp.state_bytes(capacity, max_rewind)

    # ---- graph decode (models/<family>/graph_step.py; engine/graphs.py replays it) --------------
    def graph_unsupported(self, batch_invariant: bool | None = None) -> str | None:
        """Why the family's capturable decode step (`decode_graph_step`) cannot run this model in
        that batch-invariant mode (None: the model's own), or None. The checks every family
        shares; a family adds its own."""
        from ..layers.moe import Experts
        if not hasattr(self, "decode_graph_step"):
            return f"{type(self).__name__} has no capturable decode step; use decode_graphs=False"
        if self.tp is not None:
            return "graph decode runs one rank's whole model; tensor parallelism is not supported"
        if self.devices is not None:
            return "graph decode captures a model on one device; a placed model decodes through its forward"
        if self.batch_invariant if batch_invariant is None else batch_invariant:
            why = self.graph_invariance_unsupported()
            if why is not None:
                return why + "; set_batch_invariant(False) (Engine(batch_invariant=False))"
        for mod in self.modules():
            stacks = (mod.gate_up_proj, mod.down_proj) if isinstance(mod, Experts) else ()
            if any(isinstance(w, QuantizedWeight) for w in stacks):
                return "graph decode gathers each row's experts from plain stacks; load with weights='dequant'"
        return None

    def graph_invariance_unsupported(self) -> str | None:
        """Why the capturable decode step cannot keep batch invariance, or None: a family whose
        step runs only per-row kernels says so."""
        return "graph decode runs torch's kernels, which promise no batch invariance"

    # ---- kernels (numerics/backend.py) ---------------------------------------------------------
    def set_kernels(self, kernels: KernelSet) -> None:
        """Which kernel families this model may run (native.c, Triton's sequence kernels, Triton's
        row kernels on the CPU); the default comes from the environment at load (`KernelSet.from_env`).
        An explicit call: nothing else changes what a model runs. Batch-invariant mode is turned
        off first where the new kernels cannot hold it."""
        self.kernels = kernels
        self._backends.clear()
        if self.batch_invariant and self._invariance_unsupported() is not None:
            self.batch_invariant = False

    def backend(self, batch_invariant: bool | None = None, device: torch.device | None = None) -> Backend:
        """The Backend this model runs in that batch-invariant mode (None: its own): each op's
        implementation, chosen once per (mode, numerics, device) from the device, the model's dtype
        and kernels, and passed explicitly down every call. `device`: one of a placed model's
        devices (None: `device`, where its head is). ConfigError where the mode cannot hold."""
        inv = self.batch_invariant if batch_invariant is None else bool(batch_invariant)
        device = self.device if device is None else torch.device(device)
        key = (inv, self.numerics, self.dot, device)
        ops = self._backends.get(key)
        if ops is None:
            self.invariance_refusal(inv)
            ops = self._backends[key] = build_backend(device, self.dtype, self.numerics, inv, self.kernels, self.dot)
        return ops

    def set_dot(self, mode: str) -> None:
        """The dot product of every matmul on a weight held as stored (loaded with
        weights="quantized"): "fp32" (the default: the activations and the dequantized weights as
        they are, native_dot.h) or "bf16" (both rounded to bf16 and multiplied in VDPBF16PS's order,
        native_bf16dot.h, which states the definition: twice the fused multiply-adds a cycle and half
        the panel bytes, for about 2^-8 relative error an element). The same order for any row
        count, so prefill, chunked prefill, decode and verify still agree bit for bit, and a row's
        bits never depend on its batch. Float parameters (the router, mHC) keep the fp32 dot.
        "bf16" runs in native.c on the CPU only, for fp32 models with numerics "hf"; elsewhere
        ConfigError, with nothing changed. Also `load_model(..., dot=)`."""
        if mode not in ("fp32", "bf16"):
            raise ConfigError(f"dot must be 'fp32' or 'bf16', got {mode!r}")
        why = self._bf16_dot_unsupported() if mode == "bf16" else None
        if why is not None:
            raise ConfigError(f"dot='bf16' {why}")
        self.dot = mode
        for w in self.quantized_weights().values():
            w.dot = mode
            w.bytes_changed()  # descriptors carry the dot: made again, and the native caches with them
        self._backends.clear()
        self.describe_held_weights()

    def _bf16_dot_unsupported(self) -> str | None:
        if self.device.type != "cpu" or self.devices is not None or self.tp is not None:
            return "runs native.c on the CPU: this model is on " + str(self.device) + \
                (" and placed across devices" if self.devices is not None else "") + \
                (" and tensor-parallel" if self.tp is not None else "")
        if self.dtype != torch.float32 or self.numerics != "hf":
            return f"runs fp32 models with numerics 'hf' (this one: {self.dtype}, numerics {self.numerics!r})"
        if self.backend().weight_mm.native is None:
            return "needs kvfold's native CPU kernels (a C compiler, and KVFOLD_NATIVE not 0)"
        if not self.quantized_weights():
            return "is the dot of weights held as stored: load the checkpoint with weights='quantized'"
        return None

    # ---- batch invariance --------------------------------------------------------------------
    @property
    def supports_batch_invariance(self) -> bool:
        return self._invariance_unsupported() is None

    @property
    def invariant_by_default(self) -> bool:
        """Whether an engine runs this model batch-invariant when not told (`invariance_by_default`)."""
        return all(invariance_by_default(d, self.dtype, self.kernels) for d in self._real_devices()) \
            and self.supports_batch_invariance

    def _invariance_unsupported(self) -> str | None:
        why = next((w for d in self._real_devices() if (w := invariance_unsupported(d, self.dtype, self.kernels))),
                   None)
        if why is None and self.numerics == "reference":
            why = "batch-invariant mode runs numerics='hf' (the release's order of roundings is its own)"
        return why

    def invariance_refusal(self, on: bool) -> None:
        """ConfigError where batch-invariant mode `on` cannot hold for this model; else nothing."""
        why = self._invariance_unsupported() if on else None
        if why is not None:
            raise ConfigError(why + "; use set_batch_invariant(False) (Engine(batch_invariant=False))")

    def set_batch_invariant(self, on: bool = True) -> None:
        """On: every row's logits are bit-identical whatever other sequences share its
        `forward_batch` call (token-parallel ops in fixed-order kernels: native.c on the CPU,
        Triton on CUDA; see numerics/rows.py). The default for fp32 CPU models with the native
        kernels; on CUDA (fp32 and bf16, with triton installed) it is asked for; turning it on
        elsewhere raises ConfigError. Off: torch's kernels, whose last bits may change with the
        batch. This is the model's own mode, what `forward` and a `forward_batch` without
        `batch_invariant` run; an engine keeps its own and never changes this one."""
        self.invariance_refusal(on)
        self.batch_invariant = bool(on)

    # ---- forward -----------------------------------------------------------------------------
    def _as_ids(self, token_ids) -> torch.Tensor:
        return as_token_ids(token_ids, self.config.vocab_size, self.device)

    def _checked(self, token_ids, state) -> torch.Tensor:
        """The ids as a tensor, after every check a forward of them on `state` needs."""
        state.check_usable(self.fingerprint, self.device, self.dtype, self.dev_set)
        ids = self._as_ids(token_ids)
        if state.pos + ids.numel() > state.capacity:
            raise CapacityError(
                f"forward of {ids.numel()} tokens at pos {state.pos} would pass the state's capacity "
                f"{state.capacity}; create the state with a larger new_state(capacity=...)")
        return ids

    @torch.no_grad()
    def forward(self, token_ids, state, return_hidden: bool = False, last_only: bool = False,
                decode_rows: bool = False):
        """Consume T >= 1 tokens at positions state.pos.. and return their logits [T, vocab]
        (and, with `return_hidden`, the final residual streams [T, hc_mult, hidden], which an MTP
        drafter reads). `last_only` returns just the last row's logits [1, vocab]: a long prompt
        never materialises T x vocab logits. `decode_rows`: each row as a decode row (`forward_batch`).
        Every check runs before any buffer is written: a refused call changes nothing."""
        ids = self._checked(token_ids, state)
        chunk = functools.partial(self._forward_chunk, decode_rows=decode_rows)
        return run_in_chunks(chunk, ids, state, self.max_chunk, last_only, return_hidden)

    def forward_batch(self, batch: list, last_only: bool | list[bool] = True, return_hidden: bool = False,
                      batch_invariant: bool | None = None, decode_rows: bool | list[bool] = False):
        """Advance several sequences in ONE model call: each (token_ids, state) pair as `forward`
        would (decode tokens and prefill chunks alike). Returns one logits tensor per pair
        ([1, vocab] with `last_only`, else [T_i, vocab]; one flag for all pairs, or one per pair:
        a request that wants its prompt's logprobs or verifies drafts), and with `return_hidden`
        also each pair's final streams [T_i, hc_mult, hidden] (what an MTP drafter reads); in
        batch-invariant mode they are bit-identical to what the pair would get alone.
        `batch_invariant`: this call's mode (an engine passes its own); None: the model's
        (`set_batch_invariant`). `decode_rows` (one flag, or one per pair): run the pair's rows as
        decode rows, one after another, so each row's logits are the bits decoding computes there
        (a verify step; in batch-invariant mode). Every pair is validated before any
        state is touched."""
        invariant = self.batch_invariant if batch_invariant is None else bool(batch_invariant)
        self.invariance_refusal(invariant)
        checked = [(self._checked(ids, st), st) for ids, st in batch]
        if len({id(st) for _, st in checked}) != len(checked):
            raise KvfoldError("forward_batch got the same state twice; a state advances once per call")
        flags = [decode_rows] * len(checked) if isinstance(decode_rows, bool) else list(decode_rows)
        rowwise = frozenset(id(st) for (_, st), f in zip(checked, flags) if f)
        rows = functools.partial(self._forward_rows, invariant=invariant, decode_rows=rowwise)
        return run_batch_in_rounds(rows, checked, self.max_chunk, last_only, return_hidden)

    def _forward_chunk(self, ids: torch.Tensor, state, last_only: bool = False, decode_rows: bool = False):
        logits, streams = self._forward_rows([(ids, state)], last_only,
                                             decode_rows=frozenset((id(state),)) if decode_rows else frozenset())
        return logits[0], streams[:ids.numel()]

    def _forward_rows(self, pieces: list, last_only: bool | list[bool], invariant: bool | None = None,
                      decode_rows: frozenset[int] = frozenset()) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One model call over the concatenated rows of every (ids, state) piece; advances each
        state. Returns (logits per piece, all rows' final streams). `invariant`: the call's
        batch-invariant mode (None: the model's)."""
        ops = self.backend(invariant)
        return self._run_rows(RowBatch.build(pieces, self.device, ops, decode_rows), last_only)

    def _run_rows(self, batch: RowBatch, last_only: bool | list[bool]) -> tuple[list[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    # ---- state -------------------------------------------------------------------------------
    def new_state(self, capacity: int = 4096, max_rewind: int = 0, kv_dtype: str | None = None, **kw):
        raise NotImplementedError

    def state_layout(self, max_rewind: int = 0, kv_dtype: str | None = None) -> tuple[int, list[tuple[int, int]]]:
        """(fixed bytes, [(ratio, bytes per row)]): a state of capacity c holds exactly
        fixed + sum(ceil(c / ratio) * row) bytes, computed from the config (the engine's
        admission formula, known before anything is allocated)."""
        raise NotImplementedError

    def state_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Bytes each further token of capacity adds to a state."""
        return float(sum(row / ratio for ratio, row in self.state_layout(0, kv_dtype)[1]))

    def fixed_state_bytes(self, max_rewind: int = 0, kv_dtype: str | None = None) -> int:
        """Bytes of a state that do not grow with capacity."""
        return self.state_layout(max_rewind, kv_dtype)[0]

    def describe_held_weights(self) -> None:
        """Give each CPU weight held as stored its native descriptor now (the FP8 code scan is part
        of it) where this model's matmuls read weights as stored: the load pays for it, not the
        first forward."""
        lib = self.backend().weight_mm.native
        if lib is None:
            return
        for w in self.quantized_weights().values():
            if w.device.type == "cpu":
                native_weights(w, lib=lib)

    # ---- accounting --------------------------------------------------------------------------
    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """The weights kept in their checkpoint format (loaded with weights="quantized"), by name."""
        return {n: m for n, m in self.named_modules() if isinstance(m, QuantizedWeight)}

    def num_parameters(self) -> int:
        """Logical parameters: a quantized weight counts its dequantized elements."""
        return (sum(p.numel() for p in self.parameters())
                + sum(w.numel() for w in self.quantized_weights().values()))

    def weight_bytes(self) -> int:
        """Bytes the weights occupy in memory: float parameters and every buffer (quantized weights'
        bytes and scales, routing tables), an MTP block's included when loaded."""
        return sum(t.nbytes for t in self.parameters()) + sum(t.nbytes for t in self.buffers())

"""A V4 block, and the whole model, for a batch of decode rows (a decode step of one or several
sequences, and the rows of verify steps, which run as decode rows one after another:
`Segment.parts`) in one native call each (native_block.h).

`Block.forward` on such rows runs a fixed sequence of native calls when the model is fp32 on the
CPU: the attention's mHC collapse and input norm, its fused projections, each sequence's decode
row (native_attention.py), its output, the expand, the MoE's collapse and norm, the MoE rows and
the last expand. `block_row` makes that sequence one call: the same kernels in the same order on
the same values, so the streams and the states it writes are the per-op path's bit for bit,
without the Python between the calls. It runs only where every one of those calls would run
natively for that many rows, the model's fused decode is on and no profiler listens
(`kvfold.profiling`); anywhere else it returns None and the block runs op by op. `model_row` does
the same for `Dsv4Model._run_rows`: the embedding, every block, the mHC head, the norm and the
lm_head in one call. What that call reads of the weights is one `_RowPlan` a model, checked once a
step by one `NativeCache` over every weight it points into; only the states' part (each layer's
sequence_layer per row) and the rope are built per step.

Forward hooks. A fused call replaces the forwards of the modules it covers (the block's norms,
attention and MoE; for `model_row` also the blocks, the embedding, the mHC head, the norm and the
lm_head), so a forward hook registered on one of them does not fire for those rows. torch has no
public way to ask whether a module, or any module, has hooks (`Module._forward_hooks` and
`torch.nn.modules.module._global_forward_hooks` are private), so the fused path does not guess:
it is a setting of the model, `Dsv4Model.set_fused_decode(on)` (on by default: the fast path),
and code that needs every module's forward to run turns it off there, as the profiler does
(`kvfold.bench.profile.probes`). Off changes no bits, only the speed.
"""
from __future__ import annotations

import ctypes

import torch

from ... import profiling
from ...layers.basic import fp32_native_weights, reads_as_stored
from ...layers.native_cache import NativeCache
from ...numerics import native
from ...numerics.backend import Backend, KernelError
from ...numerics.native_abi import BlockLayer, DecodeRows, HcEntry, HcParams, ModelLayer, ModelRows
from ...numerics.hc import native_collapse_serves
from ...numerics.rows import _threads
from .config import SLIDING
from .moe import NATIVE_MOE_ROWS, moe_threads, native_moe_layer, native_moe_paths
from .native_attention import fused_halves, fused_paths, sequence_layer

_ENTRIES = (("attn_hc", "input_layernorm"), ("ffn_hc", "post_attention_layernorm"))


def _paths(block) -> list[str]:
    return [f"{hc}.{p}" for hc, norm in _ENTRIES for p in ("fn", "base", "scale")] + \
        [f"{norm}.weight" for _, norm in _ENTRIES]


def _entry(hc, norm) -> HcEntry | None:
    p, w = hc._parameters, norm._parameters["weight"]
    if not native.fp32_cpu(p["fn"], p["base"], p["scale"], w):
        return None
    params = HcParams(p["fn"].data_ptr(), p["base"].data_ptr(), p["scale"].data_ptr(), hc.iters, hc.hc_eps,
                      hc.norm_eps)
    return HcEntry(params, w.data_ptr(), norm.eps)


def _build(block) -> BlockLayer | None:
    entries = [_entry(getattr(block, hc), getattr(block, norm)) for hc, norm in _ENTRIES]
    if any(e is None for e in entries):
        return None
    return BlockLayer(0, 0, *entries)  # hc and hid: set from each call's streams


def _prepared(block, batch, hc: int, hid: int):
    """What one block's native call needs for the batch's n decode rows: (lib, its block_layer, its
    sequence_layers (one per row), (cos, sin, emit_cos per row, emit_sin per row)), or None where
    a step would not run natively. A shared page under an entry a row would write refuses here
    (PageError), before any write."""
    attn, moe, n, ops = block.self_attn, block.mlp, batch.rows, batch.ops
    if attn.tp is not None or moe.tp is not None or not block.fused_decode:
        return None
    lib = ops.decode_block.native
    if lib is None or not _int64_rows(batch.token_ids, batch.positions):
        return None
    rope, cos, sin = batch.rope[SLIDING if attn.kind == SLIDING else "compressed"]
    if cos.shape[0] != n or 2 * cos.shape[-1] != attn.rope_dim:
        return None
    _fp32_rows("kv_block_decode_rows", cos, sin)
    cache = block.__dict__.get("_native_block")
    if cache is None:
        cache = block.__dict__["_native_block"] = NativeCache(block, _paths(block), lambda: _build(block))
    linked = _linked(ops, cache.get(), block, hc, hid, n)
    if linked is None:
        return None
    found = _sequence_layers(ops, attn, batch, rope)
    if found is None:
        return None
    seqs, emit_cos, emit_sin = found
    return lib, linked[0], seqs, (cos, sin, emit_cos, emit_sin)


def _sequence_layers(ops: Backend, attn, batch, rope) -> tuple[list, list, list] | None:
    """Each decode row's sequence_layer for `attn`, with the rope (cos, sin) of the entry its
    closing window emits (None, None where none closes), as three lists in row order; or None.
    A verify step's rows each get their own (its position's), on the one state they share: native
    code runs them in row order, so each sees the rows before it, as decoding does."""
    seqs, emit_cos, emit_sin = [], [], []
    i = attn.layer_idx
    for part in (p for seg in batch.segments for p in seg.parts()):
        found = sequence_layer(ops, attn, part.state.layers[i], part.start, rope)
        if found is None:
            return None
        seqs.append(found[0])
        emit_cos.append(found[1])
        emit_sin.append(found[2])
    return seqs, emit_cos, emit_sin


# the ops whose per-op calls a fused decode call replaces: each must be native.c in the Backend
_FUSED_OPS = ("rms_norm", "hc", "attention_rows", "moe_rows")


def _rows_serve(ops: Backend, n: int, fns) -> bool:
    """Whether the per-op path runs each step of n decode rows natively, as the fused call does:
    the norms, the fused attention halves (`reads_as_stored`), the native MoE rows and every mHC
    collapse of these `fn`s (the head's included), each one native.c in `ops`."""
    return n <= NATIVE_MOE_ROWS and all(getattr(ops, op).native is not None for op in _FUSED_OPS) \
        and reads_as_stored(ops, n) and all(native_collapse_serves(ops, n, fn) for fn in fns)


def _linked(ops: Backend, layer: BlockLayer | None, block, hc: int, hid: int, rows: int):
    """`layer` pointed at the block's fused attention halves and MoE layer (returned with it, which
    keeps them alive), for calls of `rows` decode rows; or None where a step of that many rows
    would not run natively (whether the collapse is native depends on the mode and threads of this
    call)."""
    lib = ops.weight_mm.native
    halves, moe_layer = fused_halves(block.self_attn, lib), native_moe_layer(block.mlp, lib)
    if layer is None or halves is None or moe_layer is None or not _rows_serve(
            ops, rows, [hc_._parameters["fn"] for hc_ in (block.attn_hc, block.ffn_hc)]):
        return None
    layer.hc, layer.hid = hc, hid
    layer.project, layer.output = ctypes.addressof(halves[0]), ctypes.addressof(halves[1])
    layer.moe, layer.moe_threads = ctypes.addressof(moe_layer), moe_threads(moe_layer, rows)
    return layer, (halves, moe_layer)


def _decode_rows(batch) -> bool:
    """Whether the batch is decode rows only (a sequence's one row, or its verify rows, which run
    as decode rows), with no profiler listening and no Triton kernels serving its attention
    (`batch.ops.sparse_attention`)."""
    return all(seg.length == 1 or seg.decode_rows for seg in batch.segments) and profiling.quiet() \
        and batch.ops.sparse_attention.triton is None


def _pointers(items) -> ctypes.Array:
    """A C array of pointers: ctypes structures by address, tensors by data pointer, None as NULL."""
    return (ctypes.c_void_p * len(items))(*(
        None if x is None else x.data_ptr() if isinstance(x, torch.Tensor) else ctypes.addressof(x) for x in items))


def block_row(block, streams: torch.Tensor, batch) -> torch.Tensor | None:
    """`Block.forward` for a batch of n decode rows (streams [n, hc, hidden]), in one native call,
    or None where any of its steps would not run natively (then nothing has been written)."""
    if streams.shape[0] != batch.rows or not _decode_rows(batch):
        return None
    found = _prepared(block, batch, streams.shape[1], streams.shape[2])
    if found is None:
        return None
    _fp32_rows("kv_block_decode_rows", streams)
    lib, layer, seqs, (cos, sin, emit_cos, emit_sin) = found
    out = torch.empty_like(streams)
    rows = DecodeRows(len(seqs), batch.positions.data_ptr(), batch.token_ids.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), _pointers(emit_cos), _pointers(emit_sin))
    rc = lib.kv_block_decode_rows(layer, _pointers(seqs), rows, streams.data_ptr(), out.data_ptr())
    if rc == -2:
        return None  # refused before any write: the per-op path runs (and reports what it finds)
    if rc != 0:
        raise MemoryError("native decode block could not allocate its buffers")
    return out


def _head_weights(ops: Backend, model):
    """native.c's descriptors of the embedding and the lm_head where the per-op path reads them
    natively too (an fp32 model: a QuantizedWeight, or an fp32 lm_head where `ops.row_mm` is
    native.c: batch-invariant mode), else None."""
    embed, head = model.model.embed_tokens, model.lm_head
    we = embed._parameters.get("weight")
    lib = ops.weight_mm.native
    e = fp32_native_weights(we if we is not None else embed._modules.get("weight"), lib)
    w = head._parameters.get("weight")
    if head.act_quant or (w is not None and ops.row_mm.native is None):
        return None  # an fp32 parameter where row_mm runs torch's GEMM
    h = fp32_native_weights(w if w is not None else head._modules.get("weight"), lib)
    return None if e is None or h is None else (e, h)


class _RowPlan:
    """What `model_row`'s call reads of the model's weights, built once per model (and again when
    a weight, the thread count, batch invariance, `numerics` or the kernels change): every block's
    block_layer with its attention halves and MoE layer, the head's model_layer, and what each
    call still checks (the modules a `tp` would shard, the most decode rows the per-op path runs
    natively)."""

    def __init__(self, lib, head: ModelLayer, layers: list, keep: list, sharded: list, attns: list, max_rows: int):
        self.lib, self.head, self.layers, self.keep = lib, head, layers, keep  # keep: what the pointers point into
        self.blocks = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(b) for b in layers))
        self.sharded = sharded
        self.attns = attns  # (attention, its batch.rope key, its rope_dim) per block
        self.ropes = {(kind, dim) for _, kind, dim in attns}
        self.max_rows = max_rows
        # the attention halves are shared with the per-op path, which sets their threads on each
        # call; `threads` puts back the count this plan was built for (no bits depend on it)
        self.halves = [half for halves, _ in keep[1:] for half in halves]
        self.threads = torch.get_num_threads()
        self.rows = 1  # the row count the blocks' MoE thread counts are set for (no bits depend on them)

    def set_rows(self, n: int) -> None:
        if n != self.rows:
            for layer, (_, moe_layer) in zip(self.layers, self.keep[1:]):
                layer.moe_threads = moe_threads(moe_layer, n)
            self.rows = n


def _plan_paths(model) -> list[str]:
    paths = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + \
        [f"model.hc_head.{p}" for p in ("hc_fn", "hc_base", "hc_scale")]
    for i, block in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        paths += [pre + p for p in _paths(block)]
        paths += [f"{pre}self_attn.{p}" for p in fused_paths(block.self_attn)]
        paths += [f"{pre}mlp.{p}" for p in native_moe_paths(block.mlp)]
    return paths


def _build_plan(ops: Backend, model) -> _RowPlan | None:
    body, lib = model.model, ops.decode_block.native
    found = _head_weights(ops, model)
    p = body.hc_head._parameters
    if lib is None or found is None or not native.fp32_cpu(p["hc_fn"], p["hc_base"], p["hc_scale"], body.norm.weight) \
            or not native_collapse_serves(ops, 1, p["hc_fn"]):
        return None
    (embed, vocab, hid), (head, _, _) = found
    hc = model.config.hc_mult
    built = [_linked(ops, _build(block), block, hc, hid, 1) for block in body.layers]
    if any(b is None for b in built):
        return None
    head_hc = HcParams(p["hc_fn"].data_ptr(), p["hc_base"].data_ptr(), p["hc_scale"].data_ptr(), 0,
                       body.hc_head.hc_eps, body.hc_head.norm_eps)
    layer = ModelLayer(hc, hid, vocab, len(built), ctypes.addressof(embed), head_hc, body.norm.weight.data_ptr(),
                       body.norm.eps, ctypes.addressof(head), _threads(vocab * hid))
    sharded = [model, *(m for block in body.layers for m in (block.self_attn, block.mlp))]
    attns = [(a, SLIDING if a.kind == SLIDING else "compressed", a.rope_dim)
             for a in (block.self_attn for block in body.layers)]
    fns = [p["hc_fn"], *(hc_._parameters["fn"] for block in body.layers for hc_ in (block.attn_hc, block.ffn_hc))]
    max_rows = 1  # the conditions only tighten as rows are added
    while max_rows < NATIVE_MOE_ROWS and _rows_serve(ops, max_rows + 1, fns):
        max_rows += 1
    return _RowPlan(lib, layer, [b[0] for b in built], [found, *(b[1] for b in built)], sharded, attns, max_rows)


def _plan(ops: Backend, model) -> _RowPlan | None:
    """The model's _RowPlan for the kernels of `ops` now (one check of every weight it points
    into), or None; built again for a Backend of another kind (its native.c and its choices:
    `Backend.key`, which holds the batch-invariant mode)."""
    kind = (ops.decode_block.native, ops.key())
    cache = model.__dict__.get("_native_row_plan")
    if cache is None or model.__dict__.get("_native_row_plan_kind") != kind:
        cache = model.__dict__["_native_row_plan"] = NativeCache(model, _plan_paths(model),
                                                                 lambda: _build_plan(ops, model))
        model.__dict__["_native_row_plan_kind"] = kind
    return cache.get(key=(torch.get_num_threads(), model.numerics))


def _rope_serves(plan: _RowPlan, batch, n: int) -> bool:
    for kind, dim in plan.ropes:
        _, cos, sin = batch.rope[kind]
        if cos.shape[0] != n or 2 * cos.shape[-1] != dim:
            return False
        _fp32_rows("kv_model_decode_rows", cos, sin)
    return True


def _fp32_rows(what: str, *tensors: torch.Tensor) -> None:
    """KernelError unless every tensor is contiguous fp32 on the CPU, as native.c's `what` reads them."""
    if not native.fp32_cpu(*tensors):
        raise KernelError(f"{what} reads contiguous fp32 CPU rows, got "
                          f"{[(t.dtype, t.device.type, t.is_contiguous()) for t in tensors]}")


def model_row(model, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Dsv4Model._run_rows` for a batch of n decode rows (`_decode_rows`) in one native call: the
    embedding, every block, the mHC head, the norm and the lm_head (native_block.h). Returns
    (logits [n, vocab], final streams [n, hc, hidden]), or None where any step would not run
    natively, the model's fused decode is off or a profiler listens (then nothing has been
    written). A shared page under an entry a row would write refuses (PageError) before any
    write."""
    tokens, positions, n = batch.token_ids, batch.positions, batch.rows
    if not model.fused_decode or not _decode_rows(batch) or not _int64_rows(tokens, positions):
        return None
    plan = _plan(batch.ops, model)
    if plan is None or n > plan.max_rows or any(m.tp is not None for m in plan.sharded) \
            or not _rope_serves(plan, batch, n):
        return None
    for half in plan.halves:
        half.threads = plan.threads
    plan.set_rows(n)
    seqs, emit = [], []
    for attn, kind, _ in plan.attns:
        found = _sequence_layers(batch.ops, attn, batch, batch.rope[kind][0])
        if found is None:
            return None
        seqs += found[0]
        emit += [t for pair in zip(found[1], found[2]) for t in pair]
    rope = [t for _, kind, _ in plan.attns for t in batch.rope[kind][1:]]
    hc, hid, vocab = plan.head.hc, plan.head.hid, plan.head.vocab
    streams = torch.empty(n, hc, hid, dtype=torch.float32)
    logits = torch.empty(n, vocab, dtype=torch.float32)
    rows = ModelRows(n, positions.data_ptr(), tokens.data_ptr(), _pointers(rope), _pointers(emit))
    rc = plan.lib.kv_model_decode_rows(plan.head, plan.blocks, _pointers(seqs), rows, streams.data_ptr(),
                                       logits.data_ptr())
    if rc == -2:
        return None  # refused before any write
    if rc != 0:
        raise MemoryError("native decode rows could not allocate their buffers")
    return logits, streams


def _int64_rows(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.int64 and t.is_contiguous() for t in ts)

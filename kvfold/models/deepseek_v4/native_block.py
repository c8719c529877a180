"""A V4 block, and the whole model, for one sequence's decode row in one native call each
(native_block.h).

`Block.forward` on a lone decode row runs a fixed sequence of native calls when the model is fp32
on the CPU: the attention's mHC collapse and input norm, its fused projections, its decode row
(native_attention.py), its output, the expand, the MoE's collapse and norm, the MoE row and the
last expand. `block_row` makes that sequence one call: the same kernels in the same order on the
same values, so the streams and the state it writes are the per-op path's bit for bit, without
the Python between the calls. It runs only where every one of those calls would run natively, no
forward hook is registered on the block's sub-modules (the fused call would skip them) and no
profiler listens (`kvfold.profiling`); anywhere else it returns None and the block runs op by op.
`model_row` does the same for `Dsv4Model._run_rows`: the embedding, every block, the mHC head,
the norm and the lm_head in one call. What that call reads of the weights is one `_RowPlan` a
model, checked once a step by one `NativeCache` over every weight it points into; only the state's
part (each layer's sequence_layer) and the rope are built per step.
"""
from __future__ import annotations

import ctypes

import torch
from torch.nn.modules import module as _module

from ... import profiling
from ...layers.basic import fp32_native_weights
from ...layers.native_cache import NativeCache
from ...numerics import native, triton_ops
from ...numerics.hc import native_collapse_serves
from ...numerics.rows import _threads, rows_invariant
from .config import SLIDING
from .moe import moe_threads, native_moe_layer, native_moe_paths
from .native_attention import fused_halves, fused_paths, sequence_layer

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _HcEntry(ctypes.Structure):
    """native_block.h's hc_entry, field for field."""
    _fields_ = [("fn", _P), ("base", _P), ("scale", _P), ("iters", _I), ("hc_eps", _D), ("norm_eps", _D),
                ("norm", _P), ("eps", _D)]


class _BlockLayer(ctypes.Structure):
    """native_block.h's block_layer, field for field."""
    _fields_ = [("hc", _I), ("hid", _I), ("attn", _HcEntry), ("ffn", _HcEntry), ("project", _P), ("output", _P),
                ("moe", _P), ("moe_threads", _I)]


_ENTRIES = (("attn_hc", "input_layernorm"), ("ffn_hc", "post_attention_layernorm"))
_CALLED = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")  # the sub-modules Block.forward calls


def _paths(block) -> list[str]:
    return [f"{hc}.{p}" for hc, norm in _ENTRIES for p in ("fn", "base", "scale")] + \
        [f"{norm}.weight" for _, norm in _ENTRIES]


def _entry(hc, norm) -> _HcEntry | None:
    p, w = hc._parameters, norm._parameters["weight"]
    if not native.fp32_cpu(p["fn"], p["base"], p["scale"], w):
        return None
    return _HcEntry(p["fn"].data_ptr(), p["base"].data_ptr(), p["scale"].data_ptr(), hc.iters, hc.hc_eps,
                    hc.norm_eps, w.data_ptr(), norm.eps)


def _build(block) -> _BlockLayer | None:
    entries = [_entry(getattr(block, hc), getattr(block, norm)) for hc, norm in _ENTRIES]
    if any(e is None for e in entries):
        return None
    return _BlockLayer(0, 0, *entries)  # hc and hid: set from each call's streams


def _hooked(block) -> bool:
    """Whether a forward hook would see one of the sub-modules Block.forward calls."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    subs = block._modules
    return any(subs[name]._forward_hooks or subs[name]._forward_pre_hooks for name in _CALLED)


def _prepared(block, batch, hc: int, hid: int):
    """What one block's native call needs for the batch's lone decode row: (lib, its block_layer,
    its sequence_layer, (cos, sin, emit_cos, emit_sin)), or None where a step would not run
    natively. A shared page under an entry the row would write refuses here (PageError), before
    any write."""
    attn, moe = block.self_attn, block.mlp
    if attn.tp is not None or moe.tp is not None or _hooked(block):
        return None
    tokens = batch.token_ids
    lib = native.library()
    if lib is None or tokens.dtype != torch.int64 or not tokens.is_contiguous():
        return None
    rope, cos, sin = batch.rope[SLIDING if attn.kind == SLIDING else "compressed"]
    if not native.fp32_cpu(cos, sin) or cos.shape[0] != 1 or 2 * cos.shape[-1] != attn.rope_dim:
        return None
    cache = block.__dict__.get("_native_block")
    if cache is None:
        cache = block.__dict__["_native_block"] = NativeCache(block, _paths(block), lambda: _build(block))
    linked = _linked(cache.get(), block, hc, hid)
    if linked is None:
        return None
    seg = batch.segments[0]
    found = sequence_layer(attn, seg.state.layers[attn.layer_idx], seg.start, rope)
    if found is None:
        return None
    seq, emit_cos, emit_sin = found
    return lib, linked[0], seq, (cos, sin, emit_cos, emit_sin)


def _linked(layer: _BlockLayer | None, block, hc: int, hid: int):
    """`layer` pointed at the block's fused attention halves and MoE layer (returned with it, which
    keeps them alive), or None where a step would not run natively (whether the collapse is native
    depends on the mode and threads of this call)."""
    halves, moe_layer = fused_halves(block.self_attn), native_moe_layer(block.mlp)
    if layer is None or halves is None or moe_layer is None or not all(
            native_collapse_serves(1, hc_._parameters["fn"]) for hc_ in (block.attn_hc, block.ffn_hc)):
        return None
    layer.hc, layer.hid = hc, hid
    layer.project, layer.output = ctypes.addressof(halves[0]), ctypes.addressof(halves[1])
    layer.moe, layer.moe_threads = ctypes.addressof(moe_layer), moe_threads(moe_layer, 1)
    return layer, (halves, moe_layer)


def _lone_decode_row(batch) -> bool:
    return len(batch.segments) == 1 and batch.segments[0].length == 1 and profiling.quiet() \
        and triton_ops.serving(batch.token_ids.device) is None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def block_row(block, streams: torch.Tensor, batch) -> torch.Tensor | None:
    """`Block.forward` for a batch of one decode row (streams [1, hc, hidden]) in one native call,
    or None where any of its steps would not run natively (then nothing has been written)."""
    if streams.shape[0] != 1 or not _lone_decode_row(batch) or not native.fp32_cpu(streams):
        return None
    found = _prepared(block, batch, streams.shape[1], streams.shape[2])
    if found is None:
        return None
    lib, layer, seq, rope = found
    out = torch.empty_like(streams)
    rc = lib.kv_block_decode_one(ctypes.addressof(layer), ctypes.addressof(seq), batch.segments[0].start,
                                 batch.token_ids.data_ptr(), *map(_ptr, rope), streams.data_ptr(), out.data_ptr())
    if rc == -2:
        return None  # refused before any write: the per-op path runs (and reports what it finds)
    if rc != 0:
        raise MemoryError("native decode block could not allocate its buffers")
    return out


class _ModelLayer(ctypes.Structure):
    """native_block.h's model_layer, field for field."""
    _fields_ = [("hc", _I), ("hid", _I), ("vocab", _I), ("layers", _I), ("embed", _P), ("head_fn", _P),
                ("head_base", _P), ("head_scale", _P), ("head_hc_eps", _D), ("head_norm_eps", _D), ("norm", _P),
                ("norm_eps", _D), ("lm_head", _P), ("head_threads", _I)]


def _head_weights(model):
    """native.c's descriptors of the embedding and the lm_head where the per-op path reads them
    natively too (an fp32 model: a QuantizedWeight, or an fp32 lm_head in batch-invariant mode),
    else None."""
    embed, head = model.model.embed_tokens, model.lm_head
    we = embed._parameters.get("weight")
    e = fp32_native_weights(we if we is not None else embed._modules.get("weight"))
    w = head._parameters.get("weight")
    if head.act_quant or (w is not None and not rows_invariant()):
        return None  # an fp32 parameter outside batch invariance: torch's GEMM (row_mm)
    h = fp32_native_weights(w if w is not None else head._modules.get("weight"))
    return None if e is None or h is None else (e, h)


class _RowPlan:
    """What `model_row`'s call reads of the model's weights, built once per model (and again when
    a weight, the thread count, batch invariance, `numerics` or the kernels change): every block's
    block_layer with its attention halves and MoE layer, the head's model_layer, and what each
    call still checks (the hook dicts of the modules it skips, the modules a `tp` would shard)."""

    def __init__(self, lib, head: _ModelLayer, layers: list, keep: list, hooks: list, sharded: list, attns: list):
        self.lib, self.head, self.layers, self.keep = lib, head, layers, keep  # keep: what the pointers point into
        self.blocks = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(b) for b in layers))
        self.hooks, self.sharded = hooks, sharded
        self.attns = attns  # (attention, its batch.rope key, its rope_dim) per block
        self.ropes = {(kind, dim) for _, kind, dim in attns}
        # the attention halves are shared with the per-op path, which sets their threads on each
        # call; `threads` puts back the count this plan was built for (no bits depend on it)
        self.halves = [half for halves, _ in keep[1:] for half in halves]
        self.threads = torch.get_num_threads()


def _plan_paths(model) -> list[str]:
    paths = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + \
        [f"model.hc_head.{p}" for p in ("hc_fn", "hc_base", "hc_scale")]
    for i, block in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        paths += [pre + p for p in _paths(block)]
        paths += [f"{pre}self_attn.{p}" for p in fused_paths(block.self_attn)]
        paths += [f"{pre}mlp.{p}" for p in native_moe_paths(block.mlp)]
    return paths


def _build_plan(model) -> _RowPlan | None:
    body, lib = model.model, native.library()
    found = _head_weights(model)
    p = body.hc_head._parameters
    if lib is None or found is None or not native.fp32_cpu(p["hc_fn"], p["hc_base"], p["hc_scale"], body.norm.weight) \
            or not native_collapse_serves(1, p["hc_fn"]):
        return None
    (embed, vocab, hid), (head, _, _) = found
    hc = model.config.hc_mult
    built = [_linked(_build(block), block, hc, hid) for block in body.layers]
    if any(b is None for b in built):
        return None
    layer = _ModelLayer(hc, hid, vocab, len(built), ctypes.addressof(embed), p["hc_fn"].data_ptr(),
                        p["hc_base"].data_ptr(), p["hc_scale"].data_ptr(), body.hc_head.hc_eps, body.hc_head.norm_eps,
                        body.norm.weight.data_ptr(), body.norm.eps, ctypes.addressof(head), _threads(vocab * hid))
    skipped = [body.embed_tokens, body.hc_head, body.norm, model.lm_head, *body.layers,
               *(block._modules[name] for block in body.layers for name in _CALLED)]
    hooks = [d for m in skipped for d in (m._forward_hooks, m._forward_pre_hooks)]
    sharded = [model, *(m for block in body.layers for m in (block.self_attn, block.mlp))]
    attns = [(a, SLIDING if a.kind == SLIDING else "compressed", a.rope_dim)
             for a in (block.self_attn for block in body.layers)]
    return _RowPlan(lib, layer, [b[0] for b in built], [found, *(b[1] for b in built)], hooks, sharded, attns)


def _plan(model) -> _RowPlan | None:
    """The model's _RowPlan now (one check of every weight it points into), or None."""
    cache = model.__dict__.get("_native_row_plan")
    if cache is None:
        cache = model.__dict__["_native_row_plan"] = NativeCache(model, _plan_paths(model), lambda: _build_plan(model))
    return cache.get(key=(native.library(), rows_invariant(), torch.get_num_threads(), model.numerics))


def _rope_serves(plan: _RowPlan, batch) -> bool:
    for kind, dim in plan.ropes:
        _, cos, sin = batch.rope[kind]
        if not native.fp32_cpu(cos, sin) or cos.shape[0] != 1 or 2 * cos.shape[-1] != dim:
            return False
    return True


def model_row(model, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Dsv4Model._run_rows` for a batch of one decode row in one native call: the embedding, every
    block, the mHC head, the norm and the lm_head (native_block.h). Returns (logits [1, vocab],
    final streams [1, hc, hidden]), or None where any step would not run natively, a forward hook
    would see one of the modules it skips, or a profiler listens (then nothing has been written).
    A shared page under an entry the row would write refuses (PageError) before any write."""
    tokens = batch.token_ids
    if not _lone_decode_row(batch) or _module._global_forward_hooks or _module._global_forward_pre_hooks \
            or tokens.dtype != torch.int64 or not tokens.is_contiguous():
        return None
    plan = _plan(model)
    if plan is None or any(plan.hooks) or any(m.tp is not None for m in plan.sharded) or not _rope_serves(plan, batch):
        return None
    for half in plan.halves:
        half.threads = plan.threads
    seg = batch.segments[0]
    layers = seg.state.layers
    found = [sequence_layer(a, layers[a.layer_idx], seg.start, batch.rope[kind][0]) for a, kind, _ in plan.attns]
    if any(f is None for f in found):
        return None
    n = len(found)
    seqs = (ctypes.c_void_p * n)(*(ctypes.addressof(f[0]) for f in found))
    rope = (ctypes.c_void_p * (4 * n))(*(_ptr(t) for (_, kind, _), f in zip(plan.attns, found)
                                         for t in (*batch.rope[kind][1:], f[1], f[2])))
    hc, hid, vocab = plan.head.hc, plan.head.hid, plan.head.vocab
    streams = torch.empty(1, hc, hid, dtype=torch.float32)
    logits = torch.empty(1, vocab, dtype=torch.float32)
    rc = plan.lib.kv_model_decode_one(ctypes.addressof(plan.head), plan.blocks, seqs, rope, seg.start,
                                      tokens.data_ptr(), streams.data_ptr(), logits.data_ptr())
    if rc == -2:
        return None  # refused before any write
    if rc != 0:
        raise MemoryError("native decode row could not allocate its buffers")
    return logits, streams

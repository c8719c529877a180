"""A V4 block for one sequence's decode row in one native call (native_block.h).

`Block.forward` on a lone decode row runs a fixed sequence of native calls when the model is fp32
on the CPU: the attention's mHC collapse and input norm, its fused projections, its decode row
(native_attention.py), its output, the expand, the MoE's collapse and norm, the MoE row and the
last expand. `block_row` makes that sequence one call: the same kernels in the same order on the
same values, so the streams and the state it writes are the per-op path's bit for bit, without
the Python between the calls. It runs only where every one of those calls would run natively, no
forward hook is registered on the block's sub-modules (the fused call would skip them) and no
profiler listens (`kvfold.profiling`); anywhere else it returns None and the block runs op by op.
"""
from __future__ import annotations

import ctypes

import torch
from torch.nn.modules import module as _module

from ... import profiling
from ...layers.native_cache import NativeCache
from ...numerics import native, triton_ops
from ...numerics.hc import native_collapse_serves
from .config import SLIDING
from .moe import native_moe_layer
from .native_attention import fused_halves, sequence_layer

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


def block_row(block, streams: torch.Tensor, batch) -> torch.Tensor | None:
    """`Block.forward` for a batch of one decode row (streams [1, hc, hidden]) in one native call,
    or None where any of its steps would not run natively (then nothing has been written)."""
    attn, moe = block.self_attn, block.mlp
    if len(batch.segments) != 1 or streams.shape[0] != 1 or attn.tp is not None or moe.tp is not None \
            or not profiling.quiet() or _hooked(block):
        return None
    tokens = batch.token_ids
    lib = native.serving(streams)
    if lib is None or triton_ops.serving(streams.device) is not None or tokens.dtype != torch.int64 \
            or not tokens.is_contiguous():
        return None
    rope, cos, sin = batch.rope[SLIDING if attn.kind == SLIDING else "compressed"]
    if not native.fp32_cpu(cos, sin) or cos.shape[0] != 1 or 2 * cos.shape[-1] != attn.rope_dim:
        return None
    cache = block.__dict__.get("_native_block")
    if cache is None:
        cache = block.__dict__["_native_block"] = NativeCache(block, _paths(block), lambda: _build(block))
    layer, halves, moe_layer = cache.get(), fused_halves(attn), native_moe_layer(moe)
    if layer is None or halves is None or moe_layer is None or not all(
            native_collapse_serves(1, hc._parameters["fn"]) for hc in (block.attn_hc, block.ffn_hc)):
        return None  # (whether the collapse is native depends on the mode and threads of this call)
    seg = batch.segments[0]
    found = sequence_layer(attn, seg.state.layers[attn.layer_idx], seg.start, rope)
    if found is None:
        return None
    seq, emit_cos, emit_sin = found
    layer.hc, layer.hid = streams.shape[1], streams.shape[2]
    layer.project, layer.output = ctypes.addressof(halves[0]), ctypes.addressof(halves[1])
    layer.moe, layer.moe_threads = ctypes.addressof(moe_layer[0]), moe_layer[1]
    out = torch.empty_like(streams)
    rc = lib.kv_block_decode_one(ctypes.addressof(layer), ctypes.addressof(seq), seg.start, tokens.data_ptr(),
                                 cos.data_ptr(), sin.data_ptr(), None if emit_cos is None else emit_cos.data_ptr(),
                                 None if emit_sin is None else emit_sin.data_ptr(), streams.data_ptr(),
                                 out.data_ptr())
    if rc == -2:
        return None  # refused before any write: the per-op path runs (and reports what it finds)
    if rc != 0:
        raise MemoryError("native decode block could not allocate its buffers")
    return out

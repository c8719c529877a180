"""The token-parallel halves of a V4 attention layer in one native call each (native_attention.h):
the projections (`Attention.project`) and the output (de-rotation, grouped wo_a, wo_b).

They run where the per-op path would run native.c's kernels on the same rows: an fp32 model on
the CPU whose matmuls read their weights natively (`reads_as_stored`: decode and verify rows, and
every row in batch-invariant mode), its weights fp32 parameters or FP8 / FP4 weights read as
stored. Each C half is the per-op path's sequence of native calls, so in batch-invariant mode its
outputs equal the per-op path's bit for bit; outside it, the per-op path runs torch's GEMMs on
fp32 parameters, and the two agree to fp32 rounding. Anything else (bf16 models, reference
numerics, other devices) returns None, and the caller runs the per-op path.
"""
from __future__ import annotations

import ctypes

import torch

from ...layers.basic import QuantizedWeight, fp32_native_weights, reads_as_stored
from ...layers.native_cache import NativeCache
from ...numerics import native
from ...numerics.backend import Backend, KernelError
from ...numerics.native_abi import (AttnRows, CompressorProj, FoldState, OutputLayer, ProjectLayer, SequenceLayer,
                                    WeightsDesc)
from ...numerics.weights_mm import describe, row_groups
from ...state.kv_rows import plain_rows
from .config import CSA, HCA, SLIDING

_F32 = torch.float32


def _weight(module):
    """A Linear's (or GroupedLinear's) weight: an fp32 parameter or a QuantizedWeight."""
    w = module._parameters.get("weight")
    return module._modules.get("weight") if w is None else w


def _desc(w, lib) -> WeightsDesc | None:
    """native.c's descriptor of a weight the fp32 kernels read, or None."""
    found = fp32_native_weights(w, lib)
    return None if found is None else found[0]


def _projection_paths(attn) -> list[str]:
    paths = ["q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "q_a_norm.weight", "kv_norm.weight"]
    parts = () if attn.compressor is None else ("compressor", "compressor.indexer") if attn.kind == CSA \
        else ("compressor",)
    for part in parts:
        paths += [f"{part}.kv_proj.weight", f"{part}.gate_proj.weight", f"{part}.position_bias"]
    if attn.kind == CSA:
        paths += ["compressor.indexer.q_b_proj.weight", "compressor.indexer.scorer.weights_proj.weight"]
    return paths


def _cached(attn, name: str, paths, build, lib):
    """The layer's NativeCache `name` (made on first use over `paths(attn)`), its value now;
    `lib`: the backend's weight_mm library, which the descriptors are made with."""
    cache = attn.__dict__.get(name)
    if cache is None:
        cache = attn.__dict__[name] = NativeCache(attn, paths(attn), lambda: build(attn, cache.key))
    return cache.get(key=lib)


def _compressor_proj(c, descs: list, lib) -> CompressorProj | None:
    """One compressor's projections (its descriptors appended to `descs`, which keeps them alive)."""
    kv, gate = _desc(_weight(c.kv_proj), lib), _desc(_weight(c.gate_proj), lib)
    bias = c.position_bias
    if kv is None or gate is None or not native.fp32_cpu(bias) or c.entry_sim is not None:
        return None
    descs += [kv, gate]
    return CompressorProj(ctypes.addressof(kv), ctypes.addressof(gate), bias.data_ptr(), bias.shape[1], c.ratio)


def _build_projection(attn, lib) -> tuple[ProjectLayer, list] | None:
    """The layer's attn_project_layer (and the descriptors it points into), or None."""
    lins = [attn.q_a_proj, attn.q_b_proj, attn.kv_proj]
    c = attn.compressor
    ix = getattr(c, "indexer", None) if c is not None else None
    if c is not None:
        lins += [c.kv_proj, c.gate_proj]
    if ix is not None:
        lins += [ix.kv_proj, ix.gate_proj, ix.q_b_proj, ix.scorer.weights_proj]
    norms = (attn.q_a_norm, attn.kv_norm)
    if attn.act_dtype is not _F32 or attn.simulate_kv or any(lin.act_quant for lin in lins) \
            or any(n.eps != attn.eps for n in norms) or not native.fp32_cpu(*(n.weight for n in norms)):
        return None
    descs = [_desc(_weight(lin), lib) for lin in (attn.q_a_proj, attn.q_b_proj, attn.kv_proj)]
    if any(d is None for d in descs):
        return None
    q_a = _weight(attn.q_a_proj)
    layer = ProjectLayer(q_a.shape[1], q_a.shape[0], attn.n_heads, attn.head_dim, attn.rope_dim // 2, attn.eps,
                         *(ctypes.addressof(d) for d in descs), attn.q_a_norm.weight.data_ptr(),
                         attn.kv_norm.weight.data_ptr())
    if c is not None:
        comp = _compressor_proj(c, descs, lib)
        if comp is None:
            return None
        layer.comp = comp
    if ix is not None:
        index = _compressor_proj(ix, descs, lib)
        iq, iw = _desc(_weight(ix.q_b_proj), lib), _desc(_weight(ix.scorer.weights_proj), lib)
        if index is None or iq is None or iw is None:
            return None
        descs += [iq, iw]
        layer.index, layer.index_q_b, layer.index_w = index, ctypes.addressof(iq), ctypes.addressof(iw)
        layer.index_heads, layer.index_dim = ix.n_heads, ix.head_dim
        layer.index_w_scale = ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    return layer, descs


def _rows_in(what: str, *tensors: torch.Tensor) -> None:
    """KernelError unless every tensor is contiguous fp32 on the CPU, as native.c's `what` reads them."""
    if not native.fp32_cpu(*tensors):
        raise KernelError(f"{what} reads contiguous fp32 CPU rows, got "
                          f"{[(t.dtype, t.device.type, t.is_contiguous()) for t in tensors]}")


def project_rows(ops: Backend, attn, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> dict | None:
    """`Attention.project`'s rows for x [m, hidden] at `positions` in one native call, or None where
    the per-op path would not run native.c on these rows (`ops.attention_rows`, `reads_as_stored`)
    or the layer's weights or numerics are not what the kernel reads."""
    m = x.shape[0]
    lib = ops.attention_rows.native
    if lib is None or not reads_as_stored(ops, m) or cos.shape[0] != m or 2 * cos.shape[-1] != attn.rope_dim:
        return None
    layer = _projection_layer(attn, ops.weight_mm.native)
    if layer is None:
        return None
    if positions.dtype != torch.int64:
        raise KernelError(f"kv_attn_project reads int64 positions, got {positions.dtype}")
    positions = positions.contiguous()
    _rows_in("kv_attn_project", x, cos, sin)
    empty = torch.empty
    q = empty(m, attn.n_heads, attn.head_dim, dtype=_F32)
    kv = empty(m, attn.head_dim, dtype=_F32)
    rows = {"q": q, "kv": kv, "positions": positions}
    out = AttnRows(q.data_ptr(), kv.data_ptr())  # the absent parts' rows stay NULL
    if attn.compressor is not None:
        rows["comp"] = (empty(m, layer.comp.cols, dtype=_F32), empty(m, layer.comp.cols, dtype=_F32))
        out.comp_kv, out.comp_score = (t.data_ptr() for t in rows["comp"])
        if layer.index_heads:
            rows["idx_kv"] = (empty(m, layer.index.cols, dtype=_F32), empty(m, layer.index.cols, dtype=_F32))
            rows["idx_q"] = (empty(m, layer.index_heads, layer.index_dim, dtype=_F32),
                             empty(m, layer.index_heads, dtype=_F32))
            out.index_kv, out.index_score = (t.data_ptr() for t in rows["idx_kv"])
            out.index_q, out.index_w = (t.data_ptr() for t in rows["idx_q"])
    rc = lib.kv_attn_project(layer, x.data_ptr(), m, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out)
    if rc != 0:
        raise MemoryError(f"native attention projections could not allocate a buffer (rc {rc})")
    return rows


def _build_output(attn, lib) -> tuple[OutputLayer, list] | None:
    wa, wb = _weight(attn.o_a_proj), _weight(attn.o_b_proj)
    if attn.act_dtype is not _F32 or attn.o_b_proj.act_quant or wa.dtype is not _F32:
        return None
    if isinstance(wa, QuantizedWeight):
        groups = wa.native(groups=attn.o_groups, lib=lib)
    else:
        found = describe(wa)
        groups = None if found is None else row_groups(found, attn.o_groups)
    o_b = _desc(wb, lib)
    if groups is None or o_b is None:
        return None
    table = (WeightsDesc * len(groups))(*(d for d, _, _ in groups))  # copies: the C side reads an array
    layer = OutputLayer(wb.shape[0], attn.n_heads, attn.head_dim, attn.rope_dim // 2, attn.o_groups, groups[0][1],
                        ctypes.addressof(table), ctypes.addressof(o_b))
    return layer, [table, o_b, groups]


def output_rows(ops: Backend, attn, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The attention output o [m, heads, head_dim] de-rotated and projected to [m, hidden] in one
    native call, or None where the per-op path would not run native.c on these rows
    (`ops.attention_rows`, `reads_as_stored`) or the layer's weights are not what the kernel reads."""
    m = o.shape[0]
    lib = ops.attention_rows.native
    if lib is None or not reads_as_stored(ops, m) or cos.shape[0] != m or 2 * cos.shape[-1] != attn.rope_dim:
        return None
    layer = _output_layer(attn, ops.weight_mm.native)
    if layer is None:
        return None
    _rows_in("kv_attn_output", o, cos, sin)
    out = torch.empty(m, layer.hid, dtype=_F32)
    if lib.kv_attn_output(layer, o.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), out.data_ptr()) != 0:
        raise MemoryError("native attention output could not allocate its buffers")
    return out


def _with_threads(built):
    """A cached (layer, keep-alive) pair's layer, its threads set to torch's count now; or None."""
    if built is None:
        return None
    built[0].threads = torch.get_num_threads()
    return built[0]


def _projection_layer(attn, lib) -> ProjectLayer | None:
    return _with_threads(_cached(attn, "_native_project", _projection_paths, _build_projection, lib))


def _output_paths(attn) -> list[str]:
    return ["o_a_proj.weight", "o_b_proj.weight"]


def _output_layer(attn, lib) -> OutputLayer | None:
    return _with_threads(_cached(attn, "_native_output", _output_paths, _build_output, lib))


def fused_paths(attn) -> list[str]:
    """The weights (relative to `attn`) that `fused_halves`' layers point into."""
    return _projection_paths(attn) + _output_paths(attn)


def fused_halves(attn, lib) -> tuple[ProjectLayer, OutputLayer] | None:
    """The layer's attn_project_layer and attn_output_layer as `project_rows` and `output_rows` use
    them (descriptors made with `lib`, the backend's weight_mm library), or None where either
    cannot run."""
    project, output = _projection_layer(attn, lib), _output_layer(attn, lib)
    return None if project is None or output is None else (project, output)


_KINDS = {SLIDING: 0, CSA: 1, HCA: 2}


def _ring(ring) -> torch.Tensor | None:
    """A position ring's fp32 rows, or None (FP8 rows)."""
    store = ring.store
    return store.data if store.fp8_nope is None and native.fp32_cpu(store.data) else None


def _fold_state(comp, st, w: int | None) -> FoldState | None:
    """One compressor's rings and pool for native.c, or None where they are not plain fp32 rows.
    With `w` (the entry this row emits), a shared page under it refuses here, before any write."""
    kv, score, pool = _ring(st.kv), _ring(st.score), plain_rows(st.pool)
    norm = comp.kv_norm.weight
    if kv is None or score is None or pool is None or comp.entry_sim is not None or not native.fp32_cpu(norm):
        return None
    data, phys = pool
    if w is not None and phys is not None:
        st.pool.check_writable(w, w + 1)
    return FoldState(kv.data_ptr(), score.data_ptr(), st.kv.rows, kv.shape[1], st.ratio, int(st.overlap),
                     data.data_ptr(), None if phys is None else phys.data_ptr(), data.shape[1], norm.data_ptr(),
                     comp.kv_norm.eps)


def sequence_layer(ops: Backend, attn, ls, start: int, rope) -> tuple[SequenceLayer, torch.Tensor | None,
                                                                      torch.Tensor | None] | None:
    """What native.c's decode row reads and writes of `ls` at position `start` (a sequence_layer),
    with the rope (cos, sin) of the entry a closing window emits (None, None when none closes);
    None where the state or the numerics are not what the kernel reads. A shared page under the
    entry the row would write refuses here (PageError), before any write."""
    if attn.simulate_kv or not native.fp32_cpu(attn.sinks):
        return None
    window = _ring(ls.window)
    if window is None:
        return None
    c = attn.compressor
    emits = c is not None and (start + 1) % c.ratio == 0
    w = start // c.ratio if emits else None
    layer = SequenceLayer(window.data_ptr(), ls.window.rows, attn.window, attn.n_heads, attn.head_dim,
                          attn.rope_dim // 2, 0, _KINDS[attn.kind], attn.head_dim ** -0.5, attn.sinks.data_ptr(),
                          threads=torch.get_num_threads())
    if c is not None:
        comp = _fold_state(c, ls.compressor, w)
        if comp is None:
            return None
        layer.comp = comp
        if attn.kind == CSA:
            ix = c.indexer
            index = _fold_state(ix, ls.indexer, w)
            if index is None:
                return None
            layer.index, layer.topk, layer.index_heads, layer.index_dim = index, ix.topk, ix.n_heads, ix.head_dim
    if not emits:
        return layer, None, None
    return (layer, *rope.cos_sin(ops, torch.tensor([w * c.ratio])))


def sequence_row(ops: Backend, attn, ls, start: int, rows: dict, take, rope) -> torch.Tensor | None:
    """`Attention._one_sequence` for one decode row in one native call (folds, selection,
    attention, window write; native_attention.h), or None where the model does not run it
    (`ops.attention_rows` not native.c) or its state or numerics are not what the kernel reads
    (then nothing has been written)."""
    lib = ops.attention_rows.native
    if lib is None:
        return None
    found = sequence_layer(ops, attn, ls, start, rope)
    if found is None:
        return None
    parts = [take(rows["q"]), take(rows["kv"])]
    if attn.compressor is not None:
        parts += [take(rows["comp"][0]), take(rows["comp"][1])]
        if attn.kind == CSA:
            parts += [take(rows["idx_kv"][0]), take(rows["idx_kv"][1]), take(rows["idx_q"][0]),
                      take(rows["idx_q"][1])]
    _rows_in("kv_attn_sequence_one", *parts)
    layer, cos, sin = found
    row = AttnRows(*(t.data_ptr() for t in parts))  # in AttnRows' order; the absent parts' stay NULL
    out = torch.empty(1, attn.n_heads, attn.head_dim, dtype=_F32)
    if lib.kv_attn_sequence_one(layer, start, row, None if cos is None else cos.data_ptr(),
                                None if sin is None else sin.data_ptr(), out.data_ptr()) != 0:
        raise MemoryError("native decode attention could not allocate its buffers")
    return out

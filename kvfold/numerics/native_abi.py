"""native.c's C interface as ctypes sees it: every struct a kernel reads, mirrored once, and every
exported function's signature, with the check that holds the mirrors to the compiled library.

ctypes cannot read a C header, so each mirror below is written by hand, field for field, and a
field added, moved or retyped on one side only would let a kernel read the wrong bytes,
silently. The library exports its own layout of each struct (native_abi.h's `kv_abi_layout`:
sizeof, and each field's offsetof and sizeof, by name), and `verify` compares that with every
mirror here (`ctypes.sizeof`, each `Structure.field`'s offset and size) when native.py loads the
library: the first difference refuses it with a NativeAbiError naming the struct and the field.
So a mirror is declared only here (the modules that fill one import it), and a struct passed to a
kernel is in both lists, or the load fails.

A kernel with more than 8 arguments takes a struct instead: positional arguments have no names
the library could report, so their order is checked by nothing.
"""
from __future__ import annotations

import ctypes

from ..errors import NativeAbiError

_P = ctypes.c_void_p  # a pointer to data, or to a struct by address (NULL: None)
_PP = ctypes.POINTER(ctypes.c_void_p)  # an array of pointers (assign a (c_void_p * n) array)
_I = ctypes.c_int64
_D = ctypes.c_double


class AbiField(ctypes.Structure):
    """One line of kv_abi_layout's table: a struct's size (field "") or a field's offset and size."""
    c_name = "kv_abi_field"
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _I), ("size", _I)]


# ---- native_weights.h ------------------------------------------------------------------------------
class WeightsDesc(ctypes.Structure):
    """kv_weights: a stored weight as the matmuls read it (numerics/weights_mm.py fills it). It holds
    raw pointers, so it also keeps the tensors they point into alive (`tensors`). The piece_* fields
    each hold the address of an array of addresses (int64 tensors in `tensors`)."""
    c_name = "kv_weights"
    _fields_ = [("fmt", _I), ("scale_f32", _I), ("data", _P), ("scale", _P), ("br", _I), ("bc", _I), ("k", _I),
                ("data_stride", _I), ("scale_stride", _I), ("row_phase", _I), ("nan_codes", _I),
                ("subnormal_blocks", _P), ("subnormal_stride", _I), ("piece_data", _P), ("piece_scale", _P),
                ("piece_subnormal", _P), ("pieces", _I), ("piece_rows", _I), ("dot", _I)]


class MmJob(ctypes.Structure):
    """mm_job: out [m, n] = x [m, k] @ (matrix `index` of the kv_weights at w)^T (kv_matmul_weights)."""
    c_name = "mm_job"
    _fields_ = [("x", _P), ("ldx", _I), ("w", _P), ("index", _I), ("out", _P), ("ldo", _I), ("m", _I), ("n", _I)]


# ---- native.c ---------------------------------------------------------------------------------------
class MatmulArgs(ctypes.Structure):
    """kv_matmul_args: out [m, n] = x [m, k] @ w [n, k]^T, fp32 w (kv_matmul)."""
    c_name = "kv_matmul_args"
    _fields_ = [("x", _P), ("ldx", _I), ("w", _P), ("out", _P), ("ldo", _I), ("m", _I), ("n", _I), ("k", _I),
                ("threads", _I)]


class RopeArgs(ctypes.Structure):
    """kv_rope_args: x [t, inner, d] rotated by (cs, sn) [t, half] into out (kv_rope)."""
    c_name = "kv_rope_args"
    _fields_ = [("x", _P), ("cs", _P), ("sn", _P), ("out", _P), ("t", _I), ("inner", _I), ("d", _I), ("half", _I),
                ("inverse", _I)]


class HcParams(ctypes.Structure):
    """hc_params: one HyperConnection's (or the mHC head's) parameters (kv_hc_collapse, kv_hc_head)."""
    c_name = "hc_params"
    _fields_ = [("fn", _P), ("base", _P), ("scale", _P), ("iters", _I), ("hc_eps", _D), ("norm_eps", _D)]


class RouteParams(ctypes.Structure):
    """route_params: a MoE router (kv_route; the `route` of a MoeLayer)."""
    c_name = "route_params"
    _fields_ = [("h", _I), ("e", _I), ("k", _I), ("n_group", _I), ("topk_group", _I), ("scoring", ctypes.c_int),
                ("renorm", ctypes.c_int), ("route_scale", _D), ("router_w", _P), ("bias", _P), ("tid2eid", _P)]


class MoeLayer(ctypes.Structure):
    """moe_layer: a MoE layer's router and expert weights (kv_moe_rows; models/deepseek_v4/moe.py)."""
    c_name = "moe_layer"
    _fields_ = [("route", RouteParams), ("inter", _I), ("shared_inter", _I), ("limit", ctypes.c_float),
                ("w13", _P), ("w2", _P), ("shared_gate", _P), ("shared_up", _P), ("shared_down", _P)]


class AttendKeys(ctypes.Structure):
    """attend_keys: the keys one decode query attends to: up to three runs of window rows, then
    compressed entries (kv_attend_one)."""
    c_name = "attend_keys"
    _fields_ = [("window", _P * 3), ("window_n", _I * 3), ("pool", _P), ("phys", _P), ("sel", _P), ("n_comp", _I)]


class IndexQuery(ctypes.Structure):
    """index_query: one indexer query's heads [heads, dim] and head weights (kv_index_topk_one)."""
    c_name = "index_query"
    _fields_ = [("q", _P), ("w", _P), ("heads", _I), ("dim", _I)]


# ---- native_attention.h -------------------------------------------------------------------------------
class CompressorProj(ctypes.Structure):
    """compressor_proj: one compressor's projections (models/deepseek_v4/native_attention.py)."""
    c_name = "compressor_proj"
    _fields_ = [("kv", _P), ("gate", _P), ("bias", _P), ("cols", _I), ("ratio", _I)]


class ProjectLayer(ctypes.Structure):
    """attn_project_layer: an attention layer's projections (kv_attn_project)."""
    c_name = "attn_project_layer"
    _fields_ = [("hid", _I), ("q_rank", _I), ("heads", _I), ("head_dim", _I), ("half", _I), ("eps", _D),
                ("q_a", _P), ("q_b", _P), ("kv", _P), ("q_norm", _P), ("kv_norm", _P),
                ("comp", CompressorProj), ("index", CompressorProj), ("index_q_b", _P), ("index_w", _P),
                ("index_heads", _I), ("index_dim", _I), ("index_w_scale", _D), ("threads", _I)]


class OutputLayer(ctypes.Structure):
    """attn_output_layer: an attention layer's output projections (kv_attn_output)."""
    c_name = "attn_output_layer"
    _fields_ = [("hid", _I), ("heads", _I), ("head_dim", _I), ("half", _I), ("groups", _I), ("rank", _I),
                ("o_a", _P), ("o_b", _P), ("threads", _I)]


class AttnRows(ctypes.Structure):
    """attn_rows: the projected rows kv_attn_project writes and kv_attn_sequence_one reads one of."""
    c_name = "attn_rows"
    _fields_ = [("q", _P), ("kv", _P), ("comp_kv", _P), ("comp_score", _P), ("index_kv", _P), ("index_score", _P),
                ("index_q", _P), ("index_w", _P)]


class FoldState(ctypes.Structure):
    """fold_state: one compressor's rings and entry pool in a sequence's state."""
    c_name = "fold_state"
    _fields_ = [("kv", _P), ("score", _P), ("rows", _I), ("cols", _I), ("ratio", _I), ("overlap", _I),
                ("pool", _P), ("phys", _P), ("width", _I), ("norm", _P), ("eps", _D)]


class SequenceLayer(ctypes.Structure):
    """sequence_layer: one sequence's state of one attention layer (kv_attn_sequence_one)."""
    c_name = "sequence_layer"
    _fields_ = [("window", _P), ("window_rows", _I), ("window_len", _I), ("heads", _I), ("head_dim", _I),
                ("half", _I), ("topk", _I), ("kind", _I), ("q_scale", _D), ("sinks", _P),
                ("comp", FoldState), ("index", FoldState), ("index_heads", _I), ("index_dim", _I), ("threads", _I)]


# ---- native_block.h -----------------------------------------------------------------------------------
class HcEntry(ctypes.Structure):
    """hc_entry: a sub-block's HyperConnection and its input RMSNorm."""
    c_name = "hc_entry"
    _fields_ = [("hc", HcParams), ("norm", _P), ("eps", _D)]


class BlockLayer(ctypes.Structure):
    """block_layer: a V4 block (kv_block_decode_rows)."""
    c_name = "block_layer"
    _fields_ = [("hc", _I), ("hid", _I), ("attn", HcEntry), ("ffn", HcEntry), ("project", _P), ("output", _P),
                ("moe", _P), ("moe_threads", _I)]


class DecodeRows(ctypes.Structure):
    """decode_rows: a block call's decode rows, their positions, tokens and rope."""
    c_name = "decode_rows"
    _fields_ = [("n", _I), ("start", _P), ("token", _P), ("cs", _P), ("sn", _P), ("emit_cs", _PP),
                ("emit_sn", _PP)]


class ModelLayer(ctypes.Structure):
    """model_layer: the model around its blocks (kv_model_decode_rows)."""
    c_name = "model_layer"
    _fields_ = [("hc", _I), ("hid", _I), ("vocab", _I), ("layers", _I), ("embed", _P), ("head", HcParams),
                ("norm", _P), ("norm_eps", _D), ("lm_head", _P), ("head_threads", _I)]


class ModelRows(ctypes.Structure):
    """model_rows: a whole-model call's decode rows, their positions, tokens and every block's rope."""
    c_name = "model_rows"
    _fields_ = [("n", _I), ("start", _P), ("token", _P), ("rope", _PP), ("emit", _PP)]


MIRRORS = (AbiField, WeightsDesc, MmJob, MatmulArgs, RopeArgs, HcParams, RouteParams, MoeLayer, AttendKeys,
           IndexQuery, CompressorProj, ProjectLayer, OutputLayer, AttnRows, FoldState, SequenceLayer, HcEntry,
           BlockLayer, DecodeRows, ModelLayer, ModelRows)


def _to(struct) -> type:
    return ctypes.POINTER(struct)  # an argument of this type takes the struct itself (passed by reference)


_C_INT = ctypes.c_int
SIGNATURES = {  # name: (restype, argtypes)
    "kv_abi_layout": (ctypes.POINTER(AbiField), [ctypes.POINTER(_I)]),
    "kv_rms_norm": (None, [_P, _P, _P, _I, _I, _D]),
    "kv_rope": (None, [_to(RopeArgs)]),
    "kv_hc_collapse": (_C_INT, [_to(HcParams), _P, _I, _I, _I, _P, _P, _P]),
    "kv_hc_head": (_C_INT, [_to(HcParams), _P, _I, _I, _I, _P]),
    "kv_hc_expand": (None, [_P, _P, _P, _P, _I, _I, _I, _P]),
    "kv_route": (_C_INT, [_to(RouteParams), _P, _I, _P, _P, _P, _I]),
    "kv_moe_rows": (_C_INT, [_to(MoeLayer), _P, _I, _P, _I, _P]),
    "kv_swiglu": (None, [_P, _P, _I, _P, _I, _I, ctypes.c_float]),
    "kv_unary": (None, [_P, _P, _I, _I]),
    "kv_l2norm": (None, [_P, _P, _I, _I, _D]),
    "kv_matmul": (None, [_to(MatmulArgs)]),
    "kv_matmul_weights": (_C_INT, [_to(MmJob), _I]),
    "kv_scan_fp8": (_I, [_P, _I, _I, _I, _P, _I]),
    "kv_attend_one": (None, [_P, _I, _I, _to(AttendKeys), _P, _P, _P, _I]),
    "kv_index_topk_one": (None, [_to(IndexQuery), _P, _P, _I, _I, _P, _P, _I]),
    "kv_pool_windows": (_C_INT, [_P, _P, _I, _I, _I, _C_INT, _P]),
    "kv_attn_project": (_C_INT, [_to(ProjectLayer), _P, _I, _P, _P, _P, _to(AttnRows)]),
    "kv_attn_output": (_C_INT, [_to(OutputLayer), _P, _I, _P, _P, _P]),
    "kv_attn_sequence_one": (_C_INT, [_to(SequenceLayer), _I, _to(AttnRows), _P, _P, _P]),
    "kv_block_decode_rows": (_C_INT, [_to(BlockLayer), _P, _to(DecodeRows), _P, _P]),
    "kv_model_decode_rows": (_C_INT, [_to(ModelLayer), _P, _P, _to(ModelRows), _P, _P]),
}


def declare(lib: ctypes.CDLL) -> None:
    """Give each of the library's functions its signature; a declared function it lacks refuses it."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise NativeAbiError(f"the native library has no function {name}, which native_abi.py declares; "
                                 "native.c and native_abi.SIGNATURES disagree", struct=name)
        fn.restype, fn.argtypes = restype, argtypes


def c_layout(lib: ctypes.CDLL) -> dict[str, dict[str, tuple[int, int]]]:
    """kv_abi_layout's table: {struct: {field: (offset, size)}}, the struct's own size under ""."""
    count = _I()
    table = lib.kv_abi_layout(ctypes.byref(count))
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for i in range(count.value):
        line = table[i]
        found.setdefault(line.type.decode(), {})[line.field.decode()] = (line.offset, line.size)
    return found


def check_layout(layout: dict[str, dict[str, tuple[int, int]]], mirrors=None) -> None:
    """Raise NativeAbiError at the first difference between `layout` (c_layout's) and a mirror of
    `mirrors` (default MIRRORS): a struct the table lacks, a field one side lacks, a field's offset
    or size, the struct's size."""
    for mirror in MIRRORS if mirrors is None else mirrors:
        name = mirror.c_name
        fields = layout.get(name)
        if fields is None:
            raise NativeAbiError(f"native.c's layout table (native_abi.h) has no struct {name}, which "
                                 f"native_abi.{mirror.__name__} mirrors", struct=name)
        names = [f[0] for f in mirror._fields_]
        unmirrored = sorted(set(fields) - set(names) - {""}, key=lambda f: fields[f][0])
        if unmirrored:
            field = unmirrored[0]
            raise NativeAbiError(f"{name}.{field}: native.c has it at offset {fields[field][0]}; its ctypes "
                                 f"mirror native_abi.{mirror.__name__} has no such field", struct=name, field=field)
        for field in names:
            _check_field(fields, mirror, field)
        size = ctypes.sizeof(mirror)
        if fields[""][1] != size:
            raise NativeAbiError(f"{name}: native.c's is {fields[''][1]} bytes, its ctypes mirror "
                                 f"native_abi.{mirror.__name__}'s {size}", struct=name)


def _check_field(fields: dict, mirror, field: str) -> None:
    name, ours = mirror.c_name, getattr(mirror, field)
    if field not in fields:
        raise NativeAbiError(f"{name}.{field}: the ctypes mirror native_abi.{mirror.__name__} has it at offset "
                             f"{ours.offset}; native.c's struct has no such field", struct=name, field=field)
    offset, size = fields[field]
    if (offset, size) != (ours.offset, ours.size):
        raise NativeAbiError(f"{name}.{field}: native.c has it at offset {offset} ({size} bytes), its ctypes "
                             f"mirror native_abi.{mirror.__name__} at offset {ours.offset} ({ours.size} bytes)",
                             struct=name, field=field)


def verify(lib: ctypes.CDLL) -> None:
    """Declare every signature, then hold every mirror to the library's layout table, and every
    struct of the table to a mirror; NativeAbiError at the first difference."""
    declare(lib)
    layout = c_layout(lib)
    check_layout(layout)
    unmirrored = sorted(set(layout) - {m.c_name for m in MIRRORS})
    if unmirrored:
        raise NativeAbiError(f"native.c's layout table lists struct {unmirrored[0]}, which native_abi.py does not "
                             "mirror (add its mirror to MIRRORS)", struct=unmirrored[0])

"""Matmuls on weights in their checkpoint formats, in native.c (native_weights.h).

`describe` turns a stored weight (fp32, bf16, FP8 e4m3fn with block scales, packed FP4 e2m1 with
1 x 32 scales, each possibly a stack of matrices such as the routed experts) into the descriptor
the kernels read; `native_mm` runs x @ W^T on it without decoding the weight into memory: a
decode row, and up to 8 rows, decode in registers; more rows decode a panel of columns at a time.

Every output is native.c's fixed-order `dot` over exactly the float32 values quant.py's
dequantizers write (native_weights.h says why the decoding is exact), so it equals
`invariant_mm(x, dequantized fp32 weight)` bit for bit, whatever the row count, the path or the
thread count: batch-invariant by construction. Threads split the output columns, never K.
"""
from __future__ import annotations

import ctypes
import math

import torch

from .backend import KernelError
from .native_abi import MmJob, WeightsDesc
from .rows import _threads

F32, BF16, FP8, FP4 = 0, 1, 2, 3
DOTS = {"fp32": 0, "bf16": 1}  # kv_weights.dot: native_dot.h's fp32 dot, native_bf16dot.h's bf16 dot
_FORMAT_OF = {torch.float32: F32, torch.bfloat16: BF16, torch.float8_e4m3fn: FP8}
_LANES = 8


def subnormal_assists(vendor: str) -> bool:
    """Whether a CPU of this vendor (cpuinfo's vendor_id) takes a microcode assist, about a hundred
    cycles, for each multiply-add with a float32 subnormal operand. Intel's cores do (bench/RESULTS.md,
    the Xeon run of FP8 blocks holding subnormal codes); AMD's Zen cores run them at full rate (a
    2-core Zen 4: the same multiply-add rate with and without, bench/RESULTS.md). Where they do,
    `describe` flags the FP8 blocks that hold subnormal codes and the decode rows take those blocks
    through halves (native_weights.h, tile_subnormal). Each path gives the same bits, so this
    chooses speed only; a vendor not known to run them at full rate keeps the flags."""
    return vendor != "AuthenticAMD"


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# a property of the machine, read once: whether `describe` builds subnormal-block flags by default
SUBNORMAL_FLAGS = subnormal_assists(_cpu_vendor())


def describe(data: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
             packed_fp4: bool = False, subnormal_flags: bool = SUBNORMAL_FLAGS, lib=None, dot: str = "fp32"
             ) -> tuple[WeightsDesc, int, int] | None:
    """(descriptor, rows n, columns k) of `data` [..., n, k] (FP4: [..., n, k/2] bytes with
    `packed_fp4`), its leading dims a stack of matrices; None where the kernels cannot read it
    (another device, a non-contiguous tensor, scale blocks not a multiple of 8 columns, an
    unknown dtype). FP8 blocks holding subnormal codes are flagged where `subnormal_flags`
    (default: this CPU's `subnormal_assists`). `lib`: the native library of the backend's
    weight_mm, which scans FP8 codes (`scan_fp8_codes`); None (no such kernel here): an FP8
    weight gets no descriptor. `dot`: the dot product every output takes, "fp32" (x and the
    dequantized weights as they are) or "bf16" (both rounded to bf16, native_bf16dot.h)."""
    if not data.is_cpu or not data.is_contiguous() or data.dim() < 2:
        return None
    fmt = FP4 if packed_fp4 else _FORMAT_OF.get(data.dtype)
    if fmt is None or (fmt in (FP8, FP4)) != (scale is not None):
        return None
    rows, k = data.shape[-2], data.shape[-1] * (2 if fmt == FP4 else 1)
    br, bc = block if block is not None else (1, _LANES)
    if scale is not None and (bc % _LANES or not scale.is_cpu or not scale.is_contiguous()
                              or scale.dtype not in (torch.uint8, torch.float32)):
        return None
    scanned = scan_fp8_codes(lib, data, bc, subnormal_flags) if fmt == FP8 else (False, None)
    if scanned is None:
        return None
    nan_codes, flags = scanned
    desc = WeightsDesc(fmt, 0, data.data_ptr(), None, br, bc, k, rows * data.element_size() * data.shape[-1], 0, 0,
                       int(nan_codes))
    desc.dot = DOTS[dot]
    desc.tensors = (data, scale)
    if flags is not None:
        desc.subnormal_blocks, desc.subnormal_stride = flags.data_ptr(), rows * flags.shape[-1]
        desc.tensors = (data, scale, flags)
    if scale is not None:
        desc.scale, desc.scale_f32 = scale.data_ptr(), int(scale.dtype == torch.float32)
        desc.scale_stride = scale.numel() // max(math.prod(data.shape[:-2]), 1)
    return desc, rows, k


def describe_pieces(pieces: list[list[tuple[torch.Tensor, torch.Tensor | None]]], block: tuple[int, int] | None = None,
                    packed_fp4: bool = False, subnormal_flags: bool = SUBNORMAL_FLAGS, lib=None, dot: str = "fp32"
                    ) -> tuple[WeightsDesc, int, int] | None:
    """`describe` of a stack whose matrices lie apart: `pieces[e]` is matrix e's row pieces in order,
    each (codes [r, k] or FP4 bytes [r, k/2], its scales), every piece of the same shape and format,
    each starting a scale block (the release stores each expert, and its w1 and w3, as tensors of
    their own). The kernels read each piece where it is (native_weights.h, weights_cols); None
    where `describe` would refuse a piece."""
    flat = [p for matrix in pieces for p in matrix]
    found = [describe(q, s, block, packed_fp4, subnormal_flags, lib, dot) for q, s in flat]
    if not flat or any(f is None for f in found) or len({(f[1], f[2]) for f in found}) != 1:
        return None
    if len({len(matrix) for matrix in pieces}) != 1:
        return None
    first, rows, k = found[0]
    desc = WeightsDesc.from_buffer_copy(first)
    desc.data_stride = desc.scale_stride = desc.subnormal_stride = 0
    desc.nan_codes = int(any(f[0].nan_codes for f in found))
    tables = [torch.tensor([f[0].data for f in found], dtype=torch.int64)]
    desc.piece_data = tables[0].data_ptr()
    if first.scale:
        tables.append(torch.tensor([f[0].scale for f in found], dtype=torch.int64))
        desc.piece_scale = tables[-1].data_ptr()
    if any(f[0].subnormal_blocks for f in found):
        tables.append(torch.tensor([f[0].subnormal_blocks or 0 for f in found], dtype=torch.int64))
        desc.piece_subnormal = tables[-1].data_ptr()
    desc.subnormal_blocks = None
    desc.pieces, desc.piece_rows = len(pieces[0]), rows
    desc.tensors = (*tables, *(f[0].tensors for f in found))
    return desc, rows * len(pieces[0]), k


def scan_fp8_codes(lib, q: torch.Tensor, bc: int, flags: bool = True) -> tuple[bool, torch.Tensor | None] | None:
    """One pass over FP8 codes [..., n, k] (native.c's kv_scan_fp8, at memory speed: GLM-5.3-Flash
    holds 7 GB of FP8 experts per MoE layer, scanned once a weight): whether any code is a NaN
    (0x7F / 0xFF), which needs a decoder step the others do not, and with `flags` uint8 flags
    [..., n, ceil(k / bc)], 1 where that row's block of bc columns holds a subnormal code (exponent
    bits 0, mantissa not), which a folded decode row must not feed to the fused multiply-add as a
    float32 subnormal (native_weights.h, tile_subnormal); None when no code is subnormal (the tiles
    then check nothing) or without `flags`. `lib`: the native library of weight_mm's row of the
    dispatch table (numerics/backend.py), whose matmuls the descriptor is for; None where there
    is none (nothing to describe for)."""
    if lib is None:
        return None
    k = q.shape[-1]
    rows = q.numel() // max(k, 1)
    out = torch.empty(*q.shape[:-1], -(-k // bc), dtype=torch.uint8) if flags else None
    found = lib.kv_scan_fp8(q.data_ptr(), rows, k, bc, None if out is None else out.data_ptr(), _threads(rows * k))
    return bool(found & 1), out if found & 2 else None


def row_groups(found: tuple[WeightsDesc, int, int], groups: int) -> list | None:
    """`describe`'s result for one [n, k] matrix split into `groups` matrices of n / groups rows
    each (a grouped projection), or None when n does not split evenly."""
    rows = found[1]
    if rows % groups:
        return None
    per = rows // groups
    return row_blocks(found, range(0, rows, per), per)


def row_blocks(found: tuple[WeightsDesc, int, int], firsts, per: int) -> list:
    """`describe`'s result for one [n, k] matrix read as the matrices of `per` rows that start at
    the rows `firsts` (each within the matrix), in place."""
    desc, rows, k = found
    scale = desc.tensors[1]
    row_bytes = desc.data_stride // rows
    scale_cols = 0 if scale is None else scale.shape[-1]
    parts = []
    for first in firsts:
        part = WeightsDesc.from_buffer_copy(desc)
        part.tensors = desc.tensors
        part.data += first * row_bytes
        if desc.subnormal_blocks:
            part.subnormal_blocks += first * desc.tensors[2].shape[-1]
        if scale is not None:
            part.scale += (first // desc.br) * scale_cols * scale.element_size()
            part.row_phase = first % desc.br
        parts.append((part, per, k))
    return parts


def native_mm(lib, x: torch.Tensor, desc: WeightsDesc, n: int, k: int, index: int = 0,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] (fp32) @ (matrix `index` of desc)^T -> fp32 [..., n] (written into `out`, an fp32
    [rows, n] view with unit column stride, when given), in native.c (`lib`)."""
    if x.dtype != torch.float32 or not x.is_cpu:
        raise KernelError(f"kv_matmul_weights reads fp32 CPU rows, got {x.dtype} on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        job = MmJob(x2.data_ptr(), x2.stride(0) if m > 1 else k, ctypes.addressof(desc), index, out.data_ptr(),
                    out.stride(0) if m > 1 else n, m, n)
        rc = lib.kv_matmul_weights(job, _threads(m * n * k))
        if rc != 0:
            raise MemoryError(f"native matmul could not allocate its panel ({n} x {k} weights, rc {rc})")
    return out.view(*x.shape[:-1], n) if out.is_contiguous() else out

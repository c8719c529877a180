"""Weight holders named like the checkpoint: `Linear.weight`, `Norm.weight`, and `QuantizedWeight`,
which a weight becomes when it is kept in memory in its checkpoint format (FP8 / packed FP4, or
bf16 in an fp32 model)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..numerics import rms_norm
from ..numerics.backend import Backend
from ..numerics.rows import row_mm
from ..numerics.quant import act_quant_fp8, dequant_fp4_into, dequant_fp8_into
from ..numerics.weights_mm import describe, describe_pieces, native_mm, row_groups
from ..numerics.quant_formats import BF16, FP4, FP8


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class QuantizedWeight(nn.Module):
    """A weight kept as the checkpoint stores it and decoded only for the matmul that reads it.

    * "fp8": `q` float8_e4m3fn [..., R, C] with `scale` [..., ceil(R/br), ceil(C/bc)], `block` = (br, bc)
      (128 x 128 in the release; (1, 128) for stacked expert halves whose rows do not fall on 128-row
      blocks, each row then carrying its own copy of its block's scale);
    * "fp4": `q` uint8 [..., R, C/2] (two e2m1 codes a byte, the low nibble the even column) with
      `scale` [..., R, ceil(C/32)], `block` = (1, 32);
    * "bf16": `q` bfloat16 [..., R, C] and no scale (`scale` is empty): a float tensor the release
      stores in bf16 (the embedding, the lm_head, the compressors), held so in an fp32 model. Its
      fp32 value is the bf16 bits shifted up 16, so every matmul sees the values an fp32 load
      writes, at half the bytes.
    `scale` holds e8m0 exponent bytes (uint8), or float32 multipliers for checkpoints with float scales.

    `shape` is the logical (dequantized) shape and `dtype` the dtype `dequant` returns: the dtype of the
    float parameter it replaces, so both residencies run the same matmuls on bit-identical values.

    With `pieces` = p > 0, a stack [E, R, C] is held as the checkpoint stores it when each expert,
    and its w1 and w3 halves, are tensors of their own: matrix e is p row pieces of R / p rows,
    buffers `q_{e}_{i}` and `scale_{e}_{i}` (each with scale blocks of its own), and `q` / `scale`
    are empty. Loaded with `keep`, every piece stays a view of the mapped checkpoint file, read in
    place (models/mapped_files.py); the kernels take a pointer a piece (weights_mm.describe_pieces).

    `dot`: the dot product native.c's matmuls take on it, "fp32" or "bf16" (weights_mm.describe),
    the model's choice (`CausalLM.set_dot`), which weights made from this one (`take`) keep.
    """

    dot = "fp32"

    def __init__(self, fmt: str, shape, dtype: torch.dtype, block: tuple[int, int],
                 scale_dtype: torch.dtype = torch.uint8, device=None, pieces: int = 0):
        super().__init__()
        if fmt not in (FP8, FP4, BF16):
            raise ValueError(f"format must be {FP8!r}, {FP4!r} or {BF16!r}, got {fmt!r}")
        *lead, r, c = shape
        br, bc = block
        if fmt == FP4 and (br != 1 or c % 2):
            raise ValueError(f"FP4 needs 1 x n blocks and an even number of columns; got {block}, {tuple(shape)}")
        self.fmt, self.shape, self.dtype, self.block = fmt, torch.Size(shape), dtype, (br, bc)
        q_shape, q_dtype = {FP8: (shape, torch.float8_e4m3fn), FP4: ((*lead, r, c // 2), torch.uint8),
                            BF16: (shape, torch.bfloat16)}[fmt]
        scale_shape = (0,) if fmt == BF16 else (*lead, math.ceil(r / br), math.ceil(c / bc))
        if pieces and (len(lead) != 1 or r % pieces):
            raise ValueError(f"pieces hold a stack [E, R, C] of {pieces} equal row pieces; got {tuple(shape)}")
        self.pieces = pieces
        if pieces:
            q_shape, scale_shape = (0,), (0,)
            for e in range(lead[0]):
                for i in range(pieces):
                    self.register_buffer(f"q_{e}_{i}", None)
                    self.register_buffer(f"scale_{e}_{i}", None)
        self.register_buffer("q", torch.empty(q_shape, dtype=q_dtype, device=device))
        self.register_buffer("scale", torch.empty(scale_shape, dtype=scale_dtype, device=device))

    def matrix_pieces(self, e: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Matrix e's row pieces (codes, scale), in order (pieces mode)."""
        b = self._buffers
        return [(b[f"q_{e}_{i}"], b[f"scale_{e}_{i}"]) for i in range(self.pieces)]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def numel(self) -> int:
        """Logical parameters (as the float weight would count them)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._buffers.values() if t is not None)

    def dequant(self, dtype: torch.dtype | None = None, index: int | None = None) -> torch.Tensor:
        """The float weight (or, with `index`, its slice `[index]`, e.g. one expert) in `dtype`
        (default `self.dtype`), in a new tensor: the same values a load-time dequantization writes."""
        if self.pieces:
            if index is None:
                return torch.stack([self.dequant(dtype, e) for e in range(self.shape[0])])
            return torch.cat([self._decoded(q, s, dtype or self.dtype) for q, s in self.matrix_pieces(index)], dim=-2)
        if index is None:
            return self._decoded(self.q, self.scale, dtype or self.dtype)
        return self._decoded(self.q[index], None if self.fmt == BF16 else self.scale[index], dtype or self.dtype)

    def _decoded(self, q: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Codes q (scales s, in `block`s) as a new tensor of `dtype`."""
        if self.fmt == BF16:
            return torch.empty(q.shape, dtype=dtype, device=q.device).copy_(q)
        return self._decode(q, s, self.block, dtype)

    def _decode(self, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        shape = q.shape if self.fmt == FP8 else (*q.shape[:-1], 2 * q.shape[-1])
        out = torch.empty(shape, dtype=dtype, device=q.device)
        if self.fmt == FP8:
            return dequant_fp8_into(out, q, s, block)
        return dequant_fp4_into(out, q, s, block[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of a 2-D weight, decoded (an embedding lookup): the same values as
        `dequant()[ids]`, decoding only those rows (each with its own row of scales)."""
        q = torch.index_select(self.q, 0, ids)
        if self.fmt == BF16:
            return q.to(self.dtype)
        br, bc = self.block
        return self._decode(q, torch.index_select(self.scale, 0, torch.div(ids, br, rounding_mode="floor")),
                            (1, bc), self.dtype)

    def native(self, groups: int | None = None, lib=None):
        """(descriptor, n, k) for native.c's format-reading matmul (with `groups`: one per group of
        rows, see weights_mm.row_groups), or None where it cannot read this weight (see
        weights_mm.describe); cached until q or scale is replaced, moved or loaded again. `lib`:
        the backend's weight_mm library, which scans FP8 codes when the descriptor is made."""
        key = (self.q.data_ptr(), self.scale.data_ptr(), self.q.device, groups, self.dot)
        hit = self.__dict__.get("_native")
        if hit is None or hit[0] != key:
            if self.pieces:
                found = None if groups is not None else describe_pieces(
                    [self.matrix_pieces(e) for e in range(self.shape[0])], None if self.fmt == BF16 else self.block,
                    packed_fp4=self.fmt == FP4, lib=lib, dot=self.dot)
            elif self.fmt == BF16:
                found = describe(self.q, dot=self.dot)
            else:
                found = describe(self.q, self.scale, self.block, packed_fp4=self.fmt == FP4, lib=lib, dot=self.dot)
            if found is not None and groups is not None:
                found = row_groups(found, groups) if self.q.dim() == 2 else None
            hit = self.__dict__["_native"] = (key, found)
        return hit[1]

    def take(self, index: torch.Tensor) -> "QuantizedWeight":
        """Slices `index` of the first dimension (experts of a stack) as a weight of their own,
        in the same format: q and scale copied, bit for bit (pieces joined into one stack)."""
        shape = (index.numel(), *self.shape[1:])
        if self.pieces:
            return self._joined(index.tolist(), shape)
        out = QuantizedWeight(self.fmt, shape, self.dtype, self.block, self.scale.dtype, device="meta")
        out.q = self.q.index_select(0, index)
        out.scale = self.scale if self.fmt == BF16 else self.scale.index_select(0, index)
        out.dot = self.dot
        return out

    def _joined(self, experts: list[int], shape: tuple) -> "QuantizedWeight":
        """Pieces of `experts` copied into one stack. Scale blocks that straddle two pieces (piece rows
        not a multiple of the block's) become a scale a row, as the loader holds such stacks."""
        br, bc = self.block
        per_row = self.fmt != BF16 and br > 1 and (self.shape[-2] // self.pieces) % br != 0
        block = (1, bc) if per_row else self.block
        dtype = self.scale.dtype
        out = QuantizedWeight(self.fmt, shape, self.dtype, block, dtype, device="meta")
        out.dot = self.dot
        out.q = torch.stack([torch.cat([q for q, _ in self.matrix_pieces(e)], dim=-2) for e in experts])
        if self.fmt != BF16:
            def rows(q, s):
                return s.repeat_interleave(br, dim=-2)[:q.shape[-2]] if per_row else s
            out.scale = torch.stack([torch.cat([rows(q, s) for q, s in self.matrix_pieces(e)], dim=-2)
                                     for e in experts])
        else:
            out.scale = torch.empty(0, dtype=dtype, device=self.q.device)
        return out

    def derived(self, name: str, build):
        """`build(self)`, cached under `name` like `native`, until q or scale is replaced, moved or
        loaded again: what is made from the stored codes alone (another layout of the same codes,
        descriptors of parts of them), never decoded values."""
        key = (self.q.data_ptr(), self.scale.data_ptr(), self.q.device)
        cache = self.__dict__.setdefault("_derived", {})
        hit = cache.get(name)
        if hit is None or hit[0] != key:
            hit = cache[name] = (key, build(self))
        return hit[1]

    def bytes_changed(self) -> None:
        """q or scale is written in place: drop what was cached from their bytes (the native
        descriptor, whose NaN-code scan is of the old bytes, and the derived layouts)."""
        self.__dict__.pop("_native", None)
        self.__dict__.pop("_derived", None)

    @torch.no_grad()
    def load_(self, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
              index: int | None = None, rows: slice | None = None, keep: bool = False) -> bool:
        """Copy a stored tensor and its scale in as they are: all of the weight, or `[index]` (one expert)
        and, within it, `rows` (e.g. the w1 or w3 half of gate_up_proj). `block` is the stored scale's
        block; row blocks of br > 1 are expanded to per-row scales when `self.block` is (1, bc).
        `keep`: q and scale stay valid (views of a mapped checkpoint file), so where they are the
        whole weight or one of its pieces, on this weight's device and in its formats, they are held
        as they are, not copied. Returns whether they were (False: copied)."""
        self.bytes_changed()
        q = q if self.fmt != FP4 else q.view(torch.uint8)
        if scale is not None and self.fmt != BF16 and self.scale.dtype == torch.uint8:
            scale = scale.view(torch.uint8)  # e8m0 exponent bytes stay bytes
        if self.pieces:
            return self._load_piece(q, scale, block, index, rows, keep)
        if keep and index is None and rows is None and self._holds_as_is(q, scale, block):
            self.q, self.scale = q, (self.scale if self.fmt == BF16 else scale)
            return True
        dq = self.q if index is None else self.q[index]
        start, stop, _ = (rows or slice(None)).indices(dq.shape[-2])
        if self.fmt == BF16:
            dq[..., start:stop, :].copy_(q)
            return False
        ds = self.scale if index is None else self.scale[index]
        dq[..., start:stop, :].copy_(q)
        br = self.block[0]
        if br == block[0]:
            ds[..., start // br:math.ceil(stop / br), :].copy_(scale)
        elif br == 1:
            ds[..., start:stop, :].copy_(scale.repeat_interleave(block[0], dim=-2)[..., :stop - start, :])
        else:
            raise ValueError(f"cannot place {block} scale blocks into {self.block} blocks")
        return False

    def _holds_as_is(self, q: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> bool:
        """Whether q and scale are this weight's own layout: its device, codes' dtype and shape,
        contiguous, and (FP8 / FP4) the scale's dtype, shape and block."""
        held = self.q if not self.pieces else None
        if q.device != self.q.device or q.dtype != self.q.dtype or not q.is_contiguous():
            return False
        if held is not None and q.shape != held.shape:
            return False
        if self.fmt == BF16:
            return True
        return (scale is not None and scale.device == q.device and scale.dtype == self.scale.dtype
                and scale.is_contiguous() and tuple(block) == self.block
                and (held is None or scale.shape == self.scale.shape))

    def _load_piece(self, q: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int], index: int | None,
                    rows: slice | None, keep: bool) -> bool:
        """Expert `index`'s `rows` (one piece) in pieces mode: held as it is with `keep` (True), else copied."""
        per = self.shape[-2] // self.pieces
        start, stop, _ = (rows or slice(None)).indices(self.shape[-2])
        if index is None or start % per or stop - start != per or q.shape[-2] != per:
            raise ValueError(f"a weight held in {self.pieces} pieces loads one expert's rows of {per}, "
                             f"got expert {index}, rows [{start}, {stop})")
        if self.fmt != BF16 and tuple(block) != self.block:
            raise ValueError(f"pieces keep the stored {self.block} scale blocks, got {block}")
        if self.fmt != BF16 and scale.dtype != self.scale.dtype:
            scale = scale.to(self.scale.dtype)
        kept = keep and self._holds_as_is(q, scale, block)
        if not kept:
            q = q.to(self.q.device, copy=True).contiguous()
            scale = None if self.fmt == BF16 else scale.to(self.q.device, copy=True).contiguous()
        i = start // per
        self._buffers[f"q_{index}_{i}"] = q
        self._buffers[f"scale_{index}_{i}"] = None if self.fmt == BF16 else scale
        return kept

    def extra_repr(self) -> str:
        return (f"{self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, block={self.block}, "
                f"scale={self.scale.dtype}" + (f", pieces={self.pieces}" if self.pieces else ""))


E8M0_STORED = {"F8_E8M0", "U8"}  # checkpoint scale dtypes held as exponent bytes; float scales as float32


def hold_quantized(model: nn.Module, name: str, fmt: str, block: tuple[int, int],
                   scale_dtypes: list[str], pieces: int = 0) -> bool:
    """Replace the float weight `name` of `model` by an empty `QuantizedWeight` of its shape and
    dtype, stored in `block`s, with scales of the checkpoint's `scale_dtypes` (all exponent bytes:
    uint8, else float32), in `pieces` row pieces a matrix (0: one stack). False, and nothing changed,
    where `name` is not a weight its module lists as `quantizable`, or is FP4 with an odd row length
    (FP4 packs two columns a byte): the loader then reports the tensor as not the model's or mis-shaped."""
    mod_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(mod_name)
    except AttributeError:
        return False
    if attr not in getattr(module, "quantizable", ()):
        return False
    current = getattr(module, attr)
    if fmt == FP4 and current.shape[-1] % 2:
        return False
    scale_dtype = torch.uint8 if all(sd in E8M0_STORED for sd in scale_dtypes) else torch.float32
    if pieces and (current.dim() != 3 or current.shape[-2] % pieces):
        return False
    holder = QuantizedWeight(fmt, tuple(current.shape), current.dtype, block, scale_dtype, current.device, pieces)
    delattr(module, attr)
    setattr(module, attr, holder)
    return True


def weight_slots(model: nn.Module) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every loadable tensor by name: parameters, buffers and `QuantizedWeight`s (not their q / scale)."""
    holders = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    slots: dict = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
                   if n.rpartition(".")[0] not in holders}
    slots.update(holders)
    return slots


def matmul_weight(w: torch.Tensor | QuantizedWeight, index: int | None = None) -> torch.Tensor:
    """The float weight one matmul reads: a parameter as it is, a `QuantizedWeight` dequantized for
    just this matmul; `index` selects one slice (an expert of a stacked weight), the only one decoded."""
    if isinstance(w, QuantizedWeight):
        return w.dequant(index=index)
    return w if index is None else w[index]


NATIVE_ROWS = 32  # up to this many rows (decode, verify), a quantized weight is read as stored


def reads_as_stored(ops: Backend, rows: int) -> bool:
    """Whether a matmul of `rows` rows reads a weight in its stored format (`weight_mm`'s rule):
    native.c's matmul serves the model, and the rows are decode and verify rows, or any rows where
    matmuls take the fixed-order dot. (Prefill chunks decode a weight for torch's GEMM instead:
    a speed rule by row count, the same whatever the load in batch-invariant mode.)"""
    return ops.weight_mm.native is not None and (rows <= NATIVE_ROWS or ops.fixed_order)


def weight_mm(ops: Backend, x: torch.Tensor, w: torch.Tensor | QuantizedWeight, index: int | None = None
              ) -> torch.Tensor:
    """x [..., K] @ W^T (W = w, or its slice `index`: one expert), in W's dtype: the one dispatch
    point for weights the native kernels read as stored. For up to NATIVE_ROWS rows on the CPU
    (any rows in batch-invariant mode), native.c reads an FP8 / FP4 weight of an fp32 or bf16 model,
    and a bf16 weight, without decoding it into memory: fp32 outputs equal `row_mm` over the
    dequantized weight bit for bit (weights_mm.py); bf16 ones accumulate in fp32 and round once.
    Otherwise an FP8 / FP4 weight (slice) is dequantized for this one matmul, and torch runs it."""
    if reads_as_stored(ops, x.numel() // max(x.shape[-1], 1)):
        found = native_weights(w, lib=ops.weight_mm.native)
        if found is not None:
            y = native_mm(ops.weight_mm.native, x if x.dtype == torch.float32 else x.float(), *found, index=index or 0)
            return y if w.dtype == torch.float32 else y.to(w.dtype)
    wf = matmul_weight(w, index)
    return row_mm(ops, x if x.dtype == wf.dtype else x.to(wf.dtype), wf)


def native_weights(w: torch.Tensor | QuantizedWeight, params: tuple = (torch.bfloat16,), lib=None):
    """native.c's view (descriptor, n, k) of a weight it reads as stored, cached on the weight: an
    FP8 / FP4 weight of an fp32 or bf16 model, or a CPU parameter of one of the `params` dtypes
    (for `weight_mm` bf16 only: fp32 parameters go through row_mm); None for the others. `lib`:
    the backend's weight_mm library (QuantizedWeight.native)."""
    if isinstance(w, QuantizedWeight):
        return w.native(lib=lib) if w.dtype in (torch.float32, torch.bfloat16) else None
    if w.dtype not in params or not w.is_cpu:
        return None
    hit = getattr(w, "_kvfold_native", None)
    if hit is None or hit[0] != w.data_ptr():
        hit = (w.data_ptr(), describe(w))
        w._kvfold_native = hit
    return hit[1]


def fp32_native_weights(w: torch.Tensor | QuantizedWeight | None, lib=None):
    """`native_weights` of a weight the fp32 kernels read (an fp32 parameter, or an FP8 / FP4
    weight of an fp32 model), else None."""
    return native_weights(w, (torch.float32,), lib) if w is not None and w.dtype == torch.float32 else None


class Linear(nn.Module):
    """y = x W^T with no bias. The input is cast to the weight dtype (fp32 weights compute in fp32).
    `weight` is a float parameter or a `QuantizedWeight` (read as stored or decoded per matmul:
    `weight_mm`).

    `act_quant` (reference numerics, on the release's FP8 GEMMs) rounds the input per token to
    FP8 in 1x128 blocks first, as the official kernels quantize activations."""

    act_quant = False
    quantizable = ("weight",)  # attributes the loader may keep quantized

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        if self.act_quant:
            x = act_quant_fp8(x, 128)
        w = self._parameters.get("weight")  # a float parameter (skips nn.Module.__getattr__), or
        if w is None or w.dtype is torch.bfloat16:
            return weight_mm(ops, x, self.weight)  # a QuantizedWeight submodule, or bf16
        return row_mm(ops, x if x.dtype == w.dtype else x.to(w.dtype), w)


class Norm(nn.Module):
    """RMSNorm with an fp32 weight."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        return rms_norm(ops, x, self._parameters["weight"], self.eps)

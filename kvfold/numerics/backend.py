"""The one dispatch point: which implementation of each op a model runs.

Every op has one torch reference (the functions in this package) and at most one kernel per
device kind: native.c on the CPU, Triton on CUDA (triton_kernels.py for the sequence ops,
triton_rows.py for the fixed-order row ops of batch-invariant mode). `OPS` lists them all.
A model builds one `Backend` per batch-invariant mode at set-up (`build_backend`), from its
device, dtype, numerics mode and `KernelSet`, and passes it explicitly down every call
(`RowBatch.ops`, then each layer's and op's `ops` argument). There is no ambient switch: what
runs is a property of the model, listed with its reason by `describe()` (`kvfold inspect`).

An op reads `ops.<name>`, a `Choice`, whose `native`, `triton` or `rows` field holds the kernel
it runs (at most one is set; none: the torch reference). A kernel that cannot take its inputs
raises `KernelError`, a bug: the choice was made at set-up and is never revisited per call.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import ConfigError, KvfoldError
from . import native

F32, BF16 = torch.float32, torch.bfloat16


class KernelError(KvfoldError):
    """A kernel chosen at set-up was handed inputs it cannot read: a bug in kvfold, never the caller's."""


@dataclass(frozen=True)
class Op:
    """An op: its torch reference, and its kernels by device kind (native.c symbols, triton_kernels
    and triton_rows functions). `dtypes`: the model dtypes whose tensors native.c's kernel reads.
    `when`: "always" (the kernel replaces the reference wherever it can run), "fixed_order" (only
    where the matmuls take the fixed-order dot: batch-invariant mode or reference numerics),
    "invariant" (only in batch-invariant mode)."""
    name: str
    reference: str
    native: tuple[str, ...] = ()
    triton: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = (F32,)
    when: str = "always"


OPS: tuple[Op, ...] = (
    Op("rms_norm", "numerics.norms: F.rms_norm, fp32", ("kv_rms_norm",), rows=("norm",)),
    Op("rope", "numerics.rope: complex multiply", ("kv_rope",), rows=("rope",)),
    Op("hc", "numerics.hc: float64 weights, Sinkhorn", ("kv_hc_collapse", "kv_hc_head", "kv_hc_expand"),
       rows=("hc_collapse", "hc_expand")),
    Op("row_mm", "F.linear (torch's GEMM)", ("kv_matmul",), rows=("mm",), dtypes=(F32, BF16), when="fixed_order"),
    Op("weight_mm", "dequantize, then row_mm", ("kv_matmul_weights", "kv_scan_fp8"), dtypes=(F32, BF16)),
    Op("unary", "torch.sigmoid / silu / softplus / cos / sin, l2norm", ("kv_unary", "kv_l2norm"),
       rows=("unary", "norm"), dtypes=(F32, BF16), when="fixed_order"),
    Op("swiglu", "F.silu(gate) * up, clamped", ("kv_swiglu",), rows=("swiglu",), when="invariant"),
    Op("route", "numerics.rows.biased_topk on torch scores", ("kv_route",), rows=("mm", "softmax", "unary"),
       when="invariant"),
    Op("moe_rows", "layers.moe: per-expert torch matmuls", ("kv_moe_rows",), triton=("expert_rows",),
       dtypes=(F32,)),
    Op("pool_windows", "numerics.fold: softmax over a window's slots", ("kv_pool_windows",),
       triton=("pool_windows",), dtypes=(F32, BF16)),
    Op("sparse_attention", "deepseek_v4.attention.sink_attention", ("kv_attend_one",), triton=("sparse_attend",)),
    Op("index_topk", "deepseek_v4.indexer: scores, then topk_lower_index", ("kv_index_topk_one",),
       triton=("index_scores", "topk_lower_index", "index_topk")),
    Op("attention_rows", "deepseek_v4.attention: the per-op projections and output",
       ("kv_attn_project", "kv_attn_output", "kv_attn_sequence_one")),
    Op("decode_block", "the per-op forward of a block", ("kv_block_decode_rows", "kv_model_decode_rows")),
)
# native.c's symbols that are no op of their own
NATIVE_SUPPORT = ("kv_abi_layout",)


@dataclass(frozen=True)
class Choice:
    """What one op runs for one model: `kind` ("torch", "native", "triton", "triton_rows"), the
    kernel itself in the matching field, and why."""
    op: str
    kind: str
    reason: str
    native: ctypes.CDLL | None = None
    triton: ModuleType | None = None
    rows: ModuleType | None = None


@dataclass(frozen=True)
class KernelSet:
    """Which kernel families a model may use, set explicitly (`model.set_kernels`); the defaults
    come from the environment once, at set-up: KVFOLD_NATIVE=0 turns native.c off, KVFOLD_TRITON=1
    turns the Triton sequence kernels on (CUDA, or any device under TRITON_INTERPRET=1).
    `triton_rows_on_cpu`: batch-invariant mode on the CPU runs the Triton row kernels (under the
    interpreter) as on CUDA: how the CPU tests check the CUDA path."""
    native: bool = True
    triton: bool = False
    triton_rows_on_cpu: bool = False

    @classmethod
    def from_env(cls) -> "KernelSet":
        return cls(native=os.environ.get("KVFOLD_NATIVE", "1") != "0", triton=os.environ.get("KVFOLD_TRITON") == "1")


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: triton installed, and CUDA or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class Backend:
    """One model's choice of implementation for every op in one batch-invariant mode (module
    docstring). Read-only once built; `ops.<op name>` is that op's `Choice`."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numerics: str, batch_invariant: bool,
                 kernels: KernelSet, lib: ctypes.CDLL | None, triton: ModuleType | None, rows: ModuleType | None,
                 native_note: str, dot: str = "fp32"):
        self.device, self.dtype, self.numerics, self.kernels = device, dtype, numerics, kernels
        self.batch_invariant = batch_invariant
        self.native_lib = lib
        # the dot product of the matmuls on weights held as stored (CausalLM.set_dot): "bf16" is
        # native.c's alone, and in a fixed order only, whatever the row count
        self.dot = dot
        # weight matmuls and the elementwise functions in a fixed order: batch-invariant mode,
        # reference numerics (whose decode and chunked prefill must see the same bits), the bf16 dot
        self.fixed_order = batch_invariant or (numerics == "reference" and lib is not None) or dot == "bf16"
        self.rows_kernels = rows if batch_invariant else None
        self.choices = tuple(self._choose(op, lib, triton, native_note) for op in OPS)
        for c in self.choices:
            setattr(self, c.op, c)

    def _choose(self, op: Op, lib, triton, native_note: str) -> Choice:
        if op.when == "invariant" and not self.batch_invariant:
            return Choice(op.name, "torch", "outside batch-invariant mode")
        if op.when == "fixed_order" and not self.fixed_order:
            return Choice(op.name, "torch", "outside batch-invariant mode and reference numerics")
        if op.rows and self.rows_kernels is not None:
            return Choice(op.name, "triton_rows", f"batch-invariant mode on {self.device.type}: fixed-order rows",
                          rows=self.rows_kernels)
        if op.triton and triton is not None:
            return Choice(op.name, "triton", "Triton kernels on (KernelSet.triton)", triton=triton)
        if op.native and lib is not None and self.dtype in op.dtypes:
            why = {"always": "", "invariant": ", batch-invariant mode",
                   "fixed_order": ", the fixed order of batch-invariant mode" if self.batch_invariant
                   else ", the fixed order of reference numerics" if self.numerics == "reference"
                   else ", the fixed order of the bf16 dot"}[op.when]
            if op.name == "weight_mm" and self.dot == "bf16":
                why += ", the bf16 dot (VDPBF16PS's order)"
            return Choice(op.name, "native", f"{_dtype_name(self.dtype)} model on the CPU{why}", native=lib)
        if op.native and lib is not None:
            return Choice(op.name, "torch", f"native.c reads {', '.join(map(_dtype_name, op.dtypes))} models")
        if op.native:
            return Choice(op.name, "torch", native_note)
        return Choice(op.name, "torch", "no kernel")

    def fresh_rows(self, length: int) -> bool:
        """Whether, in batch-invariant mode, a sequence of `length` rows gets them in a fresh buffer
        (`rows.own_rows`): chunks always; decode rows where the Triton row kernels serve the mode
        (native.c's decode rows read their inputs wherever they lie)."""
        return self.batch_invariant and (length > 1 or self.rows_kernels is not None)

    def describe(self) -> list[tuple[str, str, str]]:
        """(op, implementation, why) for every op: what `kvfold inspect` prints."""
        out = []
        for c in self.choices:
            op = next(o for o in OPS if o.name == c.op)
            impl = {"torch": f"torch ({op.reference})", "native": "native.c " + "/".join(op.native),
                    "triton": "triton_kernels." + "/".join(op.triton),
                    "triton_rows": "triton_rows." + "/".join(op.rows)}[c.kind]
            out.append((c.op, impl, c.reason))
        return out

    def key(self) -> tuple:
        """What a captured graph depends on: every choice's kind."""
        return (self.batch_invariant, self.fixed_order, self.dot) + tuple(c.kind for c in self.choices)

    def __repr__(self) -> str:
        return (f"Backend({self.device}, {self.dtype}, {self.numerics}, batch_invariant={self.batch_invariant}, "
                f"dot={self.dot})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kernels_on(device: torch.device, kernels: KernelSet):
    """(native.c or None, why not, triton_kernels or None, triton_rows or None) for this device."""
    lib, note = None, "not on the CPU"
    if device.type == "cpu":
        lib = native.library() if kernels.native else None
        note = "native.c is off (KVFOLD_NATIVE=0 or set_kernels(native=False))" if not kernels.native else \
            "native.c could not be built (no C compiler)" if lib is None else ""
    triton = rows = None
    if kernels.triton and triton_available(device):
        from . import triton_kernels as triton
    if (device.type == "cuda" or kernels.triton_rows_on_cpu) and triton_available(device):
        from . import triton_rows as rows
    return lib, note, triton, rows


def build_backend(device: torch.device | str, dtype: torch.dtype, numerics: str, batch_invariant: bool,
                  kernels: KernelSet, dot: str = "fp32") -> Backend:
    """The Backend of a model of this device, dtype and numerics in one batch-invariant mode.
    Raises ConfigError where the mode cannot run (`invariance_unsupported`)."""
    dev = torch.device(device)
    lib, note, triton, rows = _kernels_on(dev, kernels)
    if batch_invariant:
        why = invariance_unsupported(dev, dtype, kernels)
        if why is not None:
            raise ConfigError(why)
    return Backend(dev, dtype, numerics, batch_invariant, kernels, lib, triton, rows, note, dot)


def invariance_unsupported(device: torch.device | str, dtype: torch.dtype, kernels: KernelSet) -> str | None:
    """Why a model of this dtype and device, with these kernels, cannot run batch-invariant, or None."""
    device = torch.device(device)
    lib, _, _, rows = _kernels_on(device, kernels)
    if device.type == "cuda":
        if dtype not in (F32, BF16):
            return f"batch-invariant mode on CUDA runs fp32 and bf16 models (this one is {dtype})"
        if rows is None:
            return "batch-invariant mode on CUDA runs kvfold's Triton kernels: install triton (the gpu extra)"
        return None
    on_rows = device.type == "cpu" and rows is not None
    if device.type != "cpu" or dtype not in ((F32, BF16) if on_rows else (F32,)):
        return f"batch-invariant mode runs fp32 models on the CPU, fp32 and bf16 on CUDA (this one is {dtype} on {device})"
    if lib is None and not on_rows:
        return "batch-invariant mode needs kvfold's native CPU kernels (a C compiler, and KVFOLD_NATIVE not 0)"
    return None


def invariance_by_default(device: torch.device | str, dtype: torch.dtype, kernels: KernelSet) -> bool:
    """Whether a model starts (and an engine runs) batch-invariant unless told otherwise: fp32 on
    the CPU with native.c. On CUDA the mode runs the Triton row kernels, whose matmul uses no
    tensor cores, and it has not been timed there yet, so it is asked for (`set_batch_invariant`)."""
    return (torch.device(device).type == "cpu" and dtype == F32 and kernels.native
            and native.library() is not None)

"""One dispatch point (numerics/backend.py): every kernel kvfold has is registered in the one table,
every op a model runs is chosen once from it, and no module decides what runs through ambient
state (a context variable, a thread-local or a global switch)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold.errors import ConfigError
from kvfold.numerics import native_abi, norms
from kvfold.numerics.backend import NATIVE_SUPPORT, OPS, KernelError, KernelSet

from helpers import ops_for

ROOT = Path(kvfold.__file__).resolve().parent
NUMERICS = ROOT / "numerics"
SOURCES = sorted(ROOT.rglob("*.py"))


def _public_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def test_every_native_symbol_belongs_to_exactly_one_op():
    registered = [s for op in OPS for s in op.native] + list(NATIVE_SUPPORT)
    assert len(registered) == len(set(registered)), "a native symbol registered twice"
    assert set(registered) == set(native_abi.SIGNATURES), \
        "native.c's functions (native_abi.SIGNATURES) and backend.OPS must name the same symbols"


def test_every_triton_kernel_belongs_to_an_op_and_exists():
    kernels, rows = _public_functions(NUMERICS / "triton_kernels.py"), _public_functions(NUMERICS / "triton_rows.py")
    assert {f for op in OPS for f in op.triton} == kernels
    assert {f for op in OPS for f in op.rows} == rows


def test_native_symbols_are_called_only_through_the_op_that_registers_them():
    """Every `.kv_*(` call in the library names a symbol of the table, and is made by code that
    took the kernel from a Choice (`.native`) or a `lib` handed to it: no module loads native.c
    for itself (only native.py's loader, backend.py and the ABI check call `native.library()`)."""
    called = set()
    for path in SOURCES:
        text = path.read_text()
        called |= set(re.findall(r"(?:lib|native|_lib\(c\))\.(kv_[a-z0-9_]+)\(", text))  # (a layer's kv_proj is no symbol)
        if path.name not in ("native.py", "backend.py", "native_abi.py", "doctor.py"):
            assert "native.library()" not in text, f"{path.relative_to(ROOT)} loads native.c itself"
    assert called <= set(native_abi.SIGNATURES)
    assert called >= set(native_abi.SIGNATURES) - set(NATIVE_SUPPORT)


def test_no_module_dispatches_through_ambient_state():
    """No context variable or thread-local anywhere; `global` only in the loader's and the
    progress/profiling listeners' caches, none of which an op reads."""
    allowed_globals = {("numerics/native.py", "library"), ("progress.py", "quieted"),
                       ("profiling.py", "listening")}
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        assert "contextvars" not in text and "ContextVar" not in text and "threading.local" not in text, rel
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                if any(isinstance(n, ast.Global) for n in ast.walk(node)):
                    assert (rel, node.name) in allowed_globals, f"{rel}: {node.name} sets a global"
    for name in ("use_native", "use_triton", "fixed_rows_on_cpu", "batch_invariant_scope", "fixed_order_scope"):
        assert not any(re.search(rf"\b{name}\b", p.read_text()) for p in SOURCES), name


def test_a_model_chooses_each_op_once_and_reports_why(tiny):
    ops = tiny.backend()
    assert ops is tiny.backend()  # built once per mode, then the same object
    assert [c.op for c in ops.choices] == [op.name for op in OPS]
    for c in ops.choices:
        assert sum(k is not None for k in (c.native, c.triton, c.rows)) == (c.kind != "torch"), c
        assert c.reason
    assert ops.rms_norm.kind == "native" and ops.batch_invariant
    assert tiny.backend(False).row_mm.kind == "torch"  # outside the mode: torch's GEMM
    assert tiny.backend(True).row_mm.kind == "native"


def test_kernels_are_the_model_s_explicit_setting(tiny):
    other = kvfold.load_model("tiny-random")
    other.set_kernels(KernelSet(native=False))
    assert not other.batch_invariant  # the mode rests on native.c: turned off with it
    assert other.backend().rms_norm.kind == "torch" and "off" in other.backend().rms_norm.reason
    assert tiny.backend().rms_norm.kind == "native"  # another model object keeps its own
    with pytest.raises(ConfigError, match="native CPU kernels"):
        other.set_batch_invariant(True)


def test_a_bf16_model_runs_the_references_where_native_c_reads_fp32():
    ops = ops_for(dtype=torch.bfloat16)
    assert ops.rms_norm.kind == "torch" and "float32" in ops.rms_norm.reason
    assert ops.weight_mm.kind == "native"  # bf16 and FP8/FP4 weights read as stored


def test_a_kernel_handed_what_it_cannot_read_raises_instead_of_falling_back():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match="kv_rms_norm"):
        norms.rms_norm(ops_for(), x, torch.ones(8), 1e-6)


def test_inspect_lists_every_op_with_its_implementation_and_reason():
    out = subprocess.run([sys.executable, "-m", "kvfold", "inspect", "tiny-random"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    section = out[out.index("kernels ("):]
    for op in OPS:
        line = next(line for line in section.splitlines() if line.strip().startswith(op.name + " "))
        assert ("native.c" in line) == bool(op.native), line

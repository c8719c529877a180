"""native.c's C interface against its ctypes side (numerics/native_abi.py): the layout check the
loader runs, a wrong mirror refused by name, and every exported function declared once, with
its C arity."""
from __future__ import annotations

import ctypes
import re

import pytest

from kvfold.errors import NativeAbiError
from kvfold.numerics import native, native_abi
from kvfold.numerics.native_abi import HcParams

_SOURCES = (native._SOURCE, *native._HEADERS)
# an exported function's definition: at the start of a line, not static, its parameters up to ")"
_DEFINITION = re.compile(r"^(?!static\b)[a-z][\w ]*?\**\b(kv_\w+)\(([^)]*)\)\s*\{", re.M)


def _library() -> ctypes.CDLL:
    lib = native.library()
    if lib is None:
        pytest.skip("native kernels unavailable (no C compiler, or KVFOLD_NATIVE=0)")
    return lib


def _exported() -> dict[str, int]:
    """{name: parameter count} of every kv_* function native.c and its headers define."""
    found = {}
    for path in _SOURCES:
        for name, params in _DEFINITION.findall(path.read_text()):
            assert name not in found, f"{name} defined twice"
            found[name] = 0 if params.strip() in ("", "void") else params.count(",") + 1
    return found


def test_the_library_s_layout_matches_every_mirror():
    lib = _library()
    layout = native_abi.c_layout(lib)
    native_abi.check_layout(layout)  # what library() ran at load: no NativeAbiError
    assert set(layout) == {m.c_name for m in native_abi.MIRRORS}
    for mirror in native_abi.MIRRORS:  # the table lists every field of every mirror, and only those
        assert set(layout[mirror.c_name]) == {""} | {f[0] for f in mirror._fields_}, mirror.c_name
        assert layout[mirror.c_name][""][1] == ctypes.sizeof(mirror)


class _SwappedHcEntry(ctypes.Structure):
    c_name = "hc_entry"  # native_block.h's order is (hc, norm, eps)
    _fields_ = [("hc", HcParams), ("eps", ctypes.c_double), ("norm", ctypes.c_void_p)]


class _NarrowRoute(ctypes.Structure):
    c_name = "route_params"  # scoring is a C int: a c_int64 here moves every field after it
    _fields_ = [(n, ctypes.c_int64) for n in ("h", "e", "k", "n_group", "topk_group", "scoring")] + \
        [("renorm", ctypes.c_int), ("route_scale", ctypes.c_double), ("router_w", ctypes.c_void_p),
         ("bias", ctypes.c_void_p), ("tid2eid", ctypes.c_void_p)]


class _ShortIndexQuery(ctypes.Structure):
    c_name = "index_query"  # lacks the last field
    _fields_ = [("q", ctypes.c_void_p), ("w", ctypes.c_void_p), ("heads", ctypes.c_int64)]


class _LongIndexQuery(ctypes.Structure):
    c_name = "index_query"  # a field native.c does not have
    _fields_ = native_abi.IndexQuery._fields_ + [("extra", ctypes.c_int64)]


class _Unknown(ctypes.Structure):
    c_name = "no_such_struct"
    _fields_ = [("x", ctypes.c_int64)]


@pytest.mark.parametrize("mirror, struct, field", [
    (_SwappedHcEntry, "hc_entry", "eps"),
    (_NarrowRoute, "route_params", "scoring"),
    (_ShortIndexQuery, "index_query", "dim"),
    (_LongIndexQuery, "index_query", "extra"),
    (_Unknown, "no_such_struct", None),
])
def test_a_wrong_mirror_is_refused_naming_the_struct_and_the_field(mirror, struct, field):
    layout = native_abi.c_layout(_library())
    with pytest.raises(NativeAbiError) as caught:
        native_abi.check_layout(layout, [mirror])
    err = caught.value
    assert (err.struct, err.field) == (struct, field)
    assert (f"{struct}.{field}" if field else struct) in str(err)


def test_a_struct_size_native_c_disagrees_with_is_refused():
    """A difference in trailing padding only: every field agrees, the size does not."""
    layout = native_abi.c_layout(_library())
    offset, size = layout["model_rows"][""]
    layout["model_rows"][""] = (offset, size + 8)
    with pytest.raises(NativeAbiError, match="model_rows") as caught:
        native_abi.check_layout(layout)
    assert (caught.value.struct, caught.value.field) == ("model_rows", None)


def test_the_loader_refuses_a_library_whose_layout_differs(monkeypatch):
    """library() raises the NativeAbiError, on every call, and never returns the library."""
    _library()
    wrong = tuple(_SwappedHcEntry if m is native_abi.HcEntry else m for m in native_abi.MIRRORS)
    monkeypatch.setattr(native_abi, "MIRRORS", wrong)
    for name, value in (("_lib", None), ("_refused", None), ("_tried", False)):
        monkeypatch.setattr(native, name, value)  # a fresh load; monkeypatch puts the loaded one back
    for _ in range(2):
        with pytest.raises(NativeAbiError, match=r"hc_entry\.eps"):
            native.library()


def test_every_exported_function_is_declared_once_with_its_c_arity():
    lib = _library()
    exported = _exported()
    assert set(exported) == set(native_abi.SIGNATURES)
    for name, (_, argtypes) in native_abi.SIGNATURES.items():
        assert hasattr(lib, name), name
        assert len(argtypes) == exported[name], name  # ctypes checks types, not how many C takes
        assert len(argtypes) <= 8, f"{name}: pass a struct instead of {len(argtypes)} arguments"


def test_the_build_key_covers_every_header_native_c_includes():
    """native.py hashes the sources into the cached library's name: a header it skipped could be
    edited and a stale library reused."""
    included = set()
    for path in _SOURCES:
        included |= set(re.findall(r'^#include "(\w+\.h)"', path.read_text(), re.M))
    assert included and included <= {p.name for p in native._HEADERS}

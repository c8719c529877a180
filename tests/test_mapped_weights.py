"""Weights read in place from the mapped checkpoint files (models/mapped_files.py).

With weights="quantized", each held tensor is a view of its file's mapping, not a copy, and the
routed experts stay the separate tensors the release stores (each expert's w1, w3 and w2): the
kernels read a stack of such pieces through a pointer a piece, with the bits of the dense stack.
A header that points outside its file, or whose byte count does not fit its dtype and shape, is
refused before any tensor is read."""
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import kvfold
from kvfold.errors import CheckpointError
from kvfold.layers.basic import QuantizedWeight
from kvfold.models.mapped_files import MappedFile, ResidentPages, read_header
from kvfold.numerics import native
from kvfold.numerics.quant import dequant_fp4_blocks, dequant_fp8_blocks, quantize_fp4_blocks, quantize_fp8_blocks
from kvfold.numerics.rows import invariant_mm
from kvfold.numerics.weights_mm import describe_pieces, native_mm
from test_official_checkpoint import IDS, logits, official_tensors, tiny_v4, write_official

LIB = native.library()


def _pieces(fmt: str, experts: int, parts: int, rows: int, k: int, block, seed: int):
    """(pieces[e] = [(codes, scale)] * parts, dense [experts, parts * rows, k] they decode to)."""
    g = torch.Generator().manual_seed(seed)
    pieces, dense = [], []
    for _ in range(experts):
        mats, dec = [], []
        for _ in range(parts):
            w = torch.randn(rows, k, generator=g) * 0.05
            if fmt == "fp8":
                q, s = quantize_fp8_blocks(w, block)
                mats.append((q, s))
                dec.append(dequant_fp8_blocks(q, s, block))
            elif fmt == "fp4":
                q, s = quantize_fp4_blocks(w)
                mats.append((q, s))
                dec.append(dequant_fp4_blocks(q, s))
            else:
                mats.append((w.bfloat16(), None))
                dec.append(w.bfloat16().float())
        pieces.append(mats)
        dense.append(torch.cat(dec))
    return pieces, torch.stack(dense)


@pytest.mark.exactness
@pytest.mark.parametrize("fmt,block,rows,k,flags", [
    ("fp8", (8, 8), 12, 40, False),       # pieces of 12 rows: each starts its own 8-row blocks
    ("fp8", (8, 8), 12, 40, True),        # with subnormal-block flags a piece
    ("fp8", (128, 128), 300, 1024, False),  # the columns split over threads; blocks cross the piece edge
    ("fp4", (1, 32), 20, 96, False),
    ("fp4", (1, 32), 300, 1024, False),
    ("bf16", None, 10, 24, False),
])
def test_a_stack_read_piece_by_piece_has_the_bits_of_the_dense_stack(fmt, block, rows, k, flags):
    pieces, dense = _pieces(fmt, 3, 2, rows, k, block, seed=rows + k)
    found = describe_pieces(pieces, block, packed_fp4=fmt == "fp4", subnormal_flags=flags, lib=LIB)
    assert found is not None and found[1:] == (2 * rows, k)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 4, 5, 9, 33):  # decode rows, register tiles, panels
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                for e in range(3):
                    got = native_mm(LIB, x, *found, index=e)
                    torch.testing.assert_close(got, invariant_mm(LIB, x, dense[e]), rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


def test_pieces_of_unequal_shapes_are_refused():
    pieces, _ = _pieces("fp4", 2, 2, 20, 96, (1, 32), seed=1)
    pieces[1][1] = pieces[1][1][0][:10], pieces[1][1][1][:10]
    assert describe_pieces(pieces, (1, 32), packed_fp4=True, lib=LIB) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    original = tiny_v4()
    return write_official(tmp_path_factory.mktemp("mapped"), official_tensors(original), original.config)


def _held_tensors(model):
    return [(n, t) for w in model.quantized_weights().values() for n, t in w.named_buffers() if t.numel()]


def test_weights_held_as_stored_are_views_of_the_checkpoint_file(checkpoint):
    path = checkpoint / "model.safetensors"
    entries = read_header(path)
    model = kvfold.load_model(checkpoint, weights="quantized")
    offsets = {e.offset for e in entries.values()}
    held = _held_tensors(model)
    assert any(n.startswith("q_") for n, _ in held) and any(n == "q" for n, _ in held)  # experts and the rest
    for name, t in held:
        storage = t.untyped_storage()
        assert storage.nbytes() == path.stat().st_size, name  # the whole file, mapped
        assert t.data_ptr() - storage.data_ptr() in offsets, name  # where the header puts a tensor
    # each is described for the kernels at load (its FP8 code scan included), not at the first forward
    assert all(w.__dict__.get("_native", (None, None))[1] is not None for w in model.quantized_weights().values())
    # the mapping is read-only
    mapped = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(str(path))]
    assert mapped and all(fields[1].startswith("r-") for fields in mapped)


def test_logits_of_the_mapped_model_equal_the_dequantized_model(checkpoint):
    q, d = kvfold.load_model(checkpoint, weights="quantized"), kvfold.load_model(checkpoint)
    assert torch.equal(logits(q, IDS[:20]), logits(d, IDS[:20]))
    # a placement's copy of some experts joins their pieces into one stack, bit for bit
    gu = q.model.layers[2].mlp.experts.gate_up_proj
    joined = gu.take(torch.tensor([3, 0, 7]))
    assert isinstance(joined, QuantizedWeight) and joined.pieces == 0
    assert torch.equal(joined.dequant(), d.model.layers[2].mlp.experts.gate_up_proj[[3, 0, 7]])


def _may_lock(nbytes: int) -> bool:
    """Whether this process may lock `nbytes` more (CAP_IPC_LOCK, which root has, or room under RLIMIT_MEMLOCK)."""
    import os
    import resource
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or _vm_locked_kib() * 1024 + nbytes <= soft


def _vm_locked_kib() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmLck:")).split()[1])


@pytest.mark.parametrize("lock", [True, False])
def test_resident_pages_hold_only_the_pages_of_mapped_tensors(tmp_path, lock):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10000, dtype=torch.int32), "b": torch.ones(3)}, str(path))
    mappings: set = set()
    f = MappedFile(path, mappings)
    a = f.tensor(read_header(path)["a"])
    assert torch.equal(a, torch.arange(10000, dtype=torch.int32)) and len(mappings) == 1
    page = 4096
    first, last = a.data_ptr() // page, (a.data_ptr() + a.nbytes - 1) // page
    pages = ResidentPages(mappings, lock=lock)
    before = _locked_kib(path)
    pages.hold([a, torch.ones(5000), None])
    pages.hold([torch.ones(5000), a[100:200]])  # inside a's pages: merged
    assert _locked_kib(path) == before == 0  # nothing before settle
    pages.settle()
    pages.settle()  # nothing pending: nothing more
    held = (last - first + 1) * page
    if lock:  # locked where this process may lock (root, or room under RLIMIT_MEMLOCK), else noted
        assert pages.locked + pages.unlocked == held and _locked_kib(path) == pages.locked // 1024
        assert (pages.note() is None) == (pages.unlocked == 0)
    else:  # where locking is refused, the pages are only mapped in, and the load says so
        assert (pages.locked, pages.unlocked) == (0, held) and _locked_kib(path) == 0
        assert "not locked in memory" in pages.note() and "ulimit -l" in pages.note()


def _locked_kib(path) -> int:
    """KiB locked in this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if not first.endswith(":"):  # a mapping's header: address range, perms, ..., path
            inside = line.rstrip().endswith(str(path))
        elif inside and first == "Locked:":
            total += int(line.split()[1])
    return total


def test_a_loaded_model_keeps_its_weights_locked_in_memory(checkpoint, capsys):
    import gc
    gc.collect()  # earlier tests' models of this file unmapped
    path = checkpoint / "model.safetensors"
    assert _locked_kib(path) == 0
    model = kvfold.load_model(checkpoint, weights="quantized")
    held = sum(t.numel() * t.element_size() for _, t in _held_tensors(model))
    if _may_lock(held):
        assert _locked_kib(path) * 1024 >= held
    else:
        assert "not locked in memory" in capsys.readouterr().err
    del model
    gc.collect()
    assert _locked_kib(path) == 0  # unmapped with the model's last view


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header,why", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}, "not inside the file"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, "holds 16 bytes"),
    ({"w": {"dtype": "F32", "shape": [4]}}, "no dtype, shape and data_offsets"),
])
def test_a_header_that_does_not_describe_its_file_is_refused(tmp_path, header, why):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, bytes(16))
    with pytest.raises(CheckpointError, match=why):
        read_header(path)


def test_a_file_that_cannot_be_mapped_is_refused_with_what_to_do():
    from pathlib import Path
    from kvfold.models.mapped_files import Entry
    null = Path("/dev/null")  # an empty file: mmap refuses it
    with pytest.raises(CheckpointError, match="cannot memory-map"):
        MappedFile(null, set()).tensor(Entry(null, "U8", (1,), 0, 1))

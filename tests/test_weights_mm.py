"""native.c's matmuls on weights as the checkpoint stores them (numerics/weights_mm.py).

The kernels decode every FP8 / FP4 / bf16 weight to exactly the float32 value quant.py's
dequantizers write and then run native.c's one fixed-order dot, so each output must equal
`invariant_mm` over the dequantized weight bit for bit (NaN where it is NaN): for one row (decoded
in registers, alone or in tiles of a few rows) and for more (a decoded panel), at any thread count, with partial scale blocks,
all-tail rows, every FP8 code and the extreme e8m0 scales. The reference, `invariant_mm` over
quant.py's dequantization, is itself checked against torch's GEMM in test_native.py."""
import subprocess
import sys

import pytest
import torch

from kvfold.numerics import native
from kvfold.numerics.quant import (dequant_fp4_blocks, dequant_fp8_blocks, quantize_fp4_blocks,
                                   quantize_fp8_blocks)
from kvfold.numerics.rows import invariant_mm
from kvfold.numerics.weights_mm import describe as describe_in, native_mm, row_groups

LIB = native.library()  # native.c: the kernels these tests check (None would fail every test, loudly)


def describe(*args, **kwargs):
    """weights_mm.describe with the library that scans FP8 codes."""
    return describe_in(*args, lib=LIB, **kwargs)
pytestmark = pytest.mark.exactness  # bits against the dense reference: `make test` runs them under AVX2 too

SHAPES = [(37, 300), (130, 1000), (5, 8), (3, 62), (9, 6), (64, 256)]  # tails, partial blocks, k < 8
ROWS = [1, 2, 3, 4, 5, 8, 9, 33]  # a decode row; register tiles of 4 and 2 rows, and a last one; a panel


def exactly(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def weights(n, k, seed, scale=0.05):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale


def rows(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(1000 + seed))


@pytest.mark.parametrize("block", [(128, 128), (1, 128), (8, 8), (16, 32)])
@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_outputs_are_the_fixed_order_dot_over_the_dequantized_weight(n, k, block):
    q, s = quantize_fp8_blocks(weights(n, k, n * k), block)
    dense = dequant_fp8_blocks(q, s, block)
    found = describe(q, s, block)
    for m in ROWS:
        x = rows(m, k, m)
        exactly(native_mm(LIB, x, *found), invariant_mm(LIB, x, dense))


@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[1] % 2 == 0] + [(16, 80), (8, 34)])
def test_fp4_outputs_are_the_fixed_order_dot_over_the_dequantized_weight(n, k):
    packed, s = quantize_fp4_blocks(weights(n, k, n + k))
    dense = dequant_fp4_blocks(packed, s)
    found = describe(packed, s, (1, 32), packed_fp4=True)
    for m in ROWS:
        x = rows(m, k, m)
        exactly(native_mm(LIB, x, *found), invariant_mm(LIB, x, dense))


@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_outputs_are_the_fixed_order_dot_over_the_widened_weight(n, k):
    w = weights(n, k, 7 * n + k).bfloat16()
    for m in ROWS:
        x = rows(m, k, m)
        exactly(native_mm(LIB, x, *describe(w)), invariant_mm(LIB, x, w.float()))


def test_stacked_experts_read_only_the_selected_matrix():
    stack = weights(6 * 40, 96, 3).view(6, 40, 96)
    packed, s = quantize_fp4_blocks(stack)
    dense = dequant_fp4_blocks(packed, s)
    found = describe(packed, s, (1, 32), packed_fp4=True)
    x = rows(3, 96, 0)
    for e in range(6):
        exactly(native_mm(LIB, x, *found, index=e), invariant_mm(LIB, x, dense[e]))


@pytest.mark.parametrize("groups,block", [(4, (128, 128)), (3, (8, 8)), (6, (16, 32))])
def test_row_groups_read_their_rows_with_their_blocks_scales(groups, block):
    # a group's rows may start inside a scale block (row_phase): 4 x 40 rows in 128-row blocks
    n, k = 40 * groups if groups != 3 else 36, 136
    q, s = quantize_fp8_blocks(weights(n, k, groups), block)
    dense = dequant_fp8_blocks(q, s, block)
    parts = row_groups(describe(q, s, block), groups)
    per = n // groups
    x = rows(2, k, groups)
    for g, (desc, rows_, cols) in enumerate(parts):
        assert (rows_, cols) == (per, k)
        exactly(native_mm(LIB, x, desc, per, k), invariant_mm(LIB, x, dense[g * per:(g + 1) * per]))
    assert row_groups(describe(q, s, block), n + 1) is None


def test_every_fp8_code_and_extreme_scale_decodes_exactly():
    # every code (0x7F / 0xFF NaN, 0x80 negative zero, subnormals), against e8m0 exponents 0 (2^-127,
    # a float32 subnormal), 1, 127, 200, 254 (products overflow to inf) and 255 (NaN)
    codes = torch.arange(256, dtype=torch.uint8).repeat(6, 1)  # [6, 256]
    exps = torch.tensor([0, 1, 127, 200, 254, 255], dtype=torch.uint8).view(6, 1).expand(6, 2).contiguous()
    block = (1, 128)
    dense = dequant_fp8_blocks(codes.view(torch.float8_e4m3fn), exps, block)
    assert dense.isnan().any() and dense.isinf().any() and dense.signbit()[dense == 0].any()
    found = describe(codes.view(torch.float8_e4m3fn), exps, block)
    x = rows(9, 256, 5)
    for m in (1, 2, 3, 4, 9):
        exactly(native_mm(LIB, x[:m], *found), invariant_mm(LIB, x[:m], dense))
    # the finite ones value by value: a one-hot row picks one weight (0 * a NaN would spoil them all)
    finite = codes[:4].clone()
    finite[(finite & 0x7F) == 0x7F] = 0
    dense = dequant_fp8_blocks(finite.view(torch.float8_e4m3fn), exps[:4].contiguous(), block)
    eye = torch.eye(256)
    found = describe(finite.view(torch.float8_e4m3fn), exps[:4].contiguous(), block)
    assert torch.equal(native_mm(LIB, eye, *found), dense.t())
    assert torch.equal(torch.cat([native_mm(LIB, eye[i:i + 1], *found) for i in range(256)]), dense.t())


def _every_finite_fp8_code(rows_per_exponent: int, exponents: list[int], block, subnormals: bool = True):
    """[rows_per_exponent * len(exponents), 256] codes, each row every code but the two NaNs (0 in
    their places; without `subnormals`, the subnormal codes too), rolled so each code meets every
    lane; block rows of scales from `exponents`."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    if not subnormals:
        codes[((codes & 0x78) == 0) & ((codes & 0x07) != 0)] = 0
    q = torch.stack([codes.roll(i) for i in range(rows_per_exponent * len(exponents))])
    exps = torch.tensor(exponents, dtype=torch.uint8).view(-1, 1).expand(-1, 256 // block[1]).contiguous()
    return q.view(torch.float8_e4m3fn), exps


def test_fp8_scales_folded_into_a_decode_row_keep_every_product_exact():
    # Blocks of 16 or more rows let a decode row multiply x by 2^120 * scale once a block row
    # (native_weights.h, fold_fp8_scales). Every finite code, against e8m0 exponents where that
    # factor is tiny (0, 1), ordinary (120, 127), at its limit (133: 2^126) and past it (134, 200,
    # 254, 255), with activations whose folded products round to a subnormal, overflow or are 0, inf
    # or NaN: each output must still be the dot over the dequantized weight.
    # Subnormal codes send their blocks through halves (tile_subnormal), so the fold is tested on
    # the normal codes alone, and on all of them.
    # Without flags (the default on CPUs that take no assist: weights_mm.subnormal_assists) the
    # subnormal codes fold too, as float32 subnormal operands.
    block = (16, 128)
    for subnormals, flagged in ((False, True), (True, True), (True, False)):
        q, exps = _every_finite_fp8_code(16, [0, 1, 120, 127, 133, 134, 200, 254, 255], block, subnormals)
        dense = dequant_fp8_blocks(q, exps, block)
        found = describe(q, exps, block, subnormal_flags=flagged)
        assert not found[0].nan_codes and bool(found[0].subnormal_blocks) == (subnormals and flagged)
        for special in (None, 1e-39, 1e-30, 3e-36, 1e30, 3e38, 0.0, float("inf"), float("nan")):
            x = rows(6, 256, 3)
            if special is not None:  # in a decode row (row 0), and in later rows of tiles of rows 1..
                x[0, 5], x[0, 200], x[2, 5], x[3, 200] = special, -special, special, -special
            for picked in (x[:1], x[1:3], x[1:6]):  # a decode row; tiles of 2 rows, of 4 rows and 1
                exactly(native_mm(LIB, picked, *found), invariant_mm(LIB, picked, dense))


def test_fp8_decode_rows_stay_exact_with_denormals_read_as_zero():
    # Under torch.set_flush_denormal(True) (MXCSR's denormals-are-zero) a subnormal code's scaled-down
    # float32 would read as 0, so the decode row must not fold; the reference runs in the same mode.
    block = (128, 128)
    q, exps = _every_finite_fp8_code(128, [120], block)
    dense = dequant_fp8_blocks(q, exps, block)
    found = describe(q, exps, block)
    x = rows(5, 256, 4)
    assert torch.set_flush_denormal(True)
    try:
        for m in (1, 2, 5):
            exactly(native_mm(LIB, x[:m], *found), invariant_mm(LIB, x[:m], dense))
    finally:
        torch.set_flush_denormal(False)
    for m in (1, 2, 5):
        exactly(native_mm(LIB, x[:m], *found), invariant_mm(LIB, x[:m], dense))


def test_every_fp4_code_and_extreme_scale_decodes_exactly():
    # all 16 codes in every position of a 32-value block, against e8m0
    # exponents 0 (2^-127: products down to float32 subnormals), 1, 127, 200, 254 (6 * 2^127
    # overflows to inf) and 255 (NaN): the decode row's table scaled per block must equal quant.py's
    # value * scale for each of them
    codes = (torch.arange(64) % 16).roll(5).to(torch.uint8)  # [64] codes, two 32-value blocks
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(6, 1)  # [6, 32] bytes: low nibble the even column
    exps = torch.tensor([0, 1, 127, 200, 254, 255], dtype=torch.uint8).view(6, 1).expand(6, 2).contiguous()
    dense = dequant_fp4_blocks(packed, exps)
    assert dense.isnan().any() and dense.isinf().any() and (dense[0][dense[0] != 0].abs() < 2 ** -126).any()
    found = describe(packed, exps, (1, 32), packed_fp4=True)
    for m in (1, 2, 3, 4, 9):
        x = rows(m, 64, m)
        got, want = native_mm(LIB, x, *found), invariant_mm(LIB, x, dense)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: the NaN's sign too
    negative = torch.full((1, 16), 0x99, dtype=torch.uint8)  # 32 codes 9 (-0.5) under a NaN scale
    nan_scale = torch.tensor([[255]], dtype=torch.uint8)
    got = native_mm(LIB, rows(1, 32, 7), *describe(negative, nan_scale, (1, 32), packed_fp4=True))
    want = invariant_mm(LIB, rows(1, 32, 7), dequant_fp4_blocks(negative, nan_scale))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    finite = dense[:4]  # one-hot rows pick one weight each (0 * inf or 0 * NaN would spoil a sum)
    found = describe(packed[:4].contiguous(), exps[:4].contiguous(), (1, 32), packed_fp4=True)
    eye = torch.eye(64)
    assert torch.equal(torch.cat([native_mm(LIB, eye[i:i + 1], *found) for i in range(64)]), finite.t())


def test_fp4_release_layout_tiles_keep_every_bit_whatever_scale_sits_in_any_block():
    # The releases' layout (e8m0 scales on 1 x 32 blocks, k a multiple of 32) decodes columns four
    # at a time for 1, 2 or 4 rows of x, its scales widened 16 blocks at a time (native_weights.h,
    # fp4_tile_e8m0). k =
    # 1,088 is 34 blocks: two runs of 16 and a partial run of 2, whose masked load must stop at the
    # row's end. Exponents 0 (2^-127, a subnormal scale), 1 and 254 sit in random blocks; a NaN
    # scale (255) in one row sends its whole tile to the generic path, whose bits must be the same.
    n, k = 13, 1088
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(110, 140, (n, k // 32), generator=g, dtype=torch.uint8)
    spots = torch.randperm(n * (k // 32), generator=g)[:30]
    exps.view(-1)[spots[:10]] = 0
    exps.view(-1)[spots[10:20]] = 1
    exps.view(-1)[spots[20:30]] = 254
    for nan_at in (None, (6, 33), (1, 16)):  # no NaN; a NaN in the last, partial run; at a run's start
        e = exps.clone()
        if nan_at is not None:
            e[nan_at] = 255
        dense = dequant_fp4_blocks(packed, e)
        found = describe(packed, e, (1, 32), packed_fp4=True)
        for m in (1, 2, 3, 4, 5):  # a decode row; tiles of 2, of 2 and 1, of 4, of 4 and 1 rows
            x = rows(m, k, 40 + m) * 1e-3
            got, want = native_mm(LIB, x, *found), invariant_mm(LIB, x, dense)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (nan_at, m)


def test_fp4_zero_codes_keep_quant_py_s_sign_of_zero_even_after_an_underflow():
    # quant.py's weight for codes 0 and 8 is 0 * scale: +0 under an e8m0 scale, -0 under a negative
    # float32 one. A lane whose products so far rounded to -0 (a tiny negative x times a tiny weight)
    # stays -0 with a -0 weight and becomes +0 with a +0 one, and with a -0 tail that sign survives
    # to the output. Every lane: x = -2^-140 against a weight of 2^-128, then x = 1 against a zero
    # code, then x = -0 against 2^-128 again; the tail of 4 underflows as the first step does.
    tiny = -(2.0 ** -140)
    x = torch.tensor([[tiny] * 8 + [1.0] * 8 + [-0.0] * 16 + [tiny] * 4])
    cases = [(1, 8, torch.zeros(1, 2, dtype=torch.uint8)),  # e8m0 exponent 0: code 1 is 0.5 * 2^-127
             (9, 0, torch.full((1, 2), -(2.0 ** -127)))]  # code 9 is -0.5, times -2^-127
    for weight_code, zero_code, scale in cases:
        codes = torch.tensor([weight_code] * 8 + [zero_code] * 8 + [weight_code] * 20, dtype=torch.uint8)
        packed = (codes[0::2] | (codes[1::2] << 4)).view(1, 18)
        dense = dequant_fp4_blocks(packed, scale)
        assert dense[0, 0].item() == 2.0 ** -128 and dense[0, 8].item() == 0
        want = invariant_mm(LIB, x, dense)
        assert want.item() == 0 and torch.signbit(want).item() == (scale.dtype == torch.float32)
        got = native_mm(LIB, x, *describe(packed, scale, (1, 32), packed_fp4=True))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scale.dtype, got, want)


def _round_downward():
    """fesetround(FE_DOWNWARD) on this thread (x87 and MXCSR); returns the call that restores
    round-to-nearest. The kernels below run on this thread: their sizes are under rows.py's serial
    threshold."""
    import ctypes
    import ctypes.util
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    down, nearest = 0x400, 0  # glibc's FE_DOWNWARD and FE_TONEAREST on x86
    assert libm.fesetround(down) == 0 and libm.fegetround() == down
    return lambda: libm.fesetround(nearest)


def test_fp4_decode_rows_keep_every_bit_when_the_thread_rounds_downward():
    # AVX2's decode rows read an FP4 weight as its magnitude's table entry with the code's sign bit,
    # which is the value only under round-to-nearest: rounding down, -(v * s) is not (-v) * s for a
    # float32 scale, and code 8 (+0 in quant.py) read as -0 turns a zero sum's +0 into -0. Whatever
    # the path, every output's bits must be the dense reference's in the same rounding mode.
    codes = torch.tensor([8] * 64 + (list(range(16)) * 4)[3:] + [0, 1, 2], dtype=torch.uint8).view(2, 64)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).repeat(2, 1)  # [4, 32] bytes: rows of -0 codes, of all
    float_scales = torch.tensor([[0.1, -0.3], [-0.7, 1.3], [0.9, -1e-3], [3.7, 0.01]])
    exps = torch.tensor([[127, 120], [130, 127], [1, 200], [127, 127]], dtype=torch.uint8)
    x = rows(3, 64, 6).abs()  # positive: a row of -0 weights then sums -0 products (one row, and a tile of 2 + 1)
    third = lambda: (torch.tensor([1.0]) / 3).view(torch.int32).item()  # noqa: E731
    restore = _round_downward()
    try:
        assert third() == 0x3EAAAAAA  # the mode is on (to nearest, 1/3 rounds up to ...AB)
        for scale in (float_scales, exps):
            dense = dequant_fp4_blocks(packed, scale)
            for m in (1, 3):
                got = native_mm(LIB, x[:m], *describe(packed, scale, (1, 32), packed_fp4=True))
                want = invariant_mm(LIB, x[:m], dense)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scale.dtype, m, got, want)
    finally:
        restore()
    assert third() == 0x3EAAAAAB


def test_fp8_decode_rows_under_float32_scales_keep_every_bit_in_partial_and_overflowing_blocks():
    # Float32 block scales (GLM-5.3's release) do not fold into x: a decode row's tiles decode each
    # block's codes as halves times 2^8 * scale (native_weights.h, fp8_row_tile_scaled). k = 400
    # leaves a last block of 16 columns; one row's scale of 2^125 makes 2^8 * scale overflow, which
    # sends its tile to the generic path, value by value in that block: the bits must not change.
    block = (1, 128)
    q, s = quantize_fp8_blocks(weights(13, 400, 21), block)
    fs = torch.rand(s.shape, generator=torch.Generator().manual_seed(5)) * 1e-2 + 1e-3  # not powers of two
    fs[6, 2] = 2.0 ** 121
    dense = dequant_fp8_blocks(q, fs, block)
    found = describe(q, fs, block)
    assert found[0].scale_f32 and not found[0].nan_codes
    for m in (1, 2):
        x = rows(m, 400, 30 + m)
        exactly(native_mm(LIB, x, *found), invariant_mm(LIB, x, dense))


def test_float32_scales_multiply_as_stored():
    q, s = quantize_fp8_blocks(weights(20, 200, 2), (8, 8))
    fs = torch.rand(s.shape, generator=torch.Generator().manual_seed(3)) * 1e-2  # not powers of two
    dense = dequant_fp8_blocks(q, fs, (8, 8))
    for m in (1, 4):
        x = rows(m, 200, m)
        exactly(native_mm(LIB, x, *describe(q, fs, (8, 8))), invariant_mm(LIB, x, dense))


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(fmt):
    n, k = 512, 1024  # past rows.py's serial threshold: the columns split over threads
    w = weights(n, k, 11)
    if fmt == "fp8":
        found = describe(*quantize_fp8_blocks(w), (128, 128))
    elif fmt == "fp4":
        packed, s = quantize_fp4_blocks(w)
        found = describe(packed, s, (1, 32), packed_fp4=True)
    else:
        found = describe(w.bfloat16())
    x = rows(9, k, 0)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(native_mm(LIB, x, *found))
            for i in (0, 4, 8):
                assert torch.equal(native_mm(LIB, x[i:i + 1], *found)[0], outs[-1][i])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_weights_the_kernels_cannot_read_are_refused_before_any_call():
    q, s = quantize_fp8_blocks(weights(16, 30, 1), (4, 6))  # 6-column scale blocks: not lanes of 8
    assert describe(q, s, (4, 6)) is None
    assert describe(q.t(), s, (128, 128)) is None  # not contiguous
    assert describe(weights(4, 8, 0).half()) is None  # no fp16 kernel
    assert describe(q, None, (128, 128)) is None  # FP8 without its scales
    assert describe_in(q, s, (128, 128)) is None  # FP8 with no library to scan its codes (no weight_mm kernel)


_PROBE = ("import hashlib, torch\n"
          "from kvfold.numerics import native\n"
          "from kvfold.numerics.quant import quantize_fp4_blocks, quantize_fp8_blocks\n"
          "from kvfold.numerics.weights_mm import describe, native_mm\n"
          "g = torch.Generator().manual_seed(0)\n"
          "w = torch.randn(37, 270, generator=g)\n"
          "p, s4 = quantize_fp4_blocks(w)\n"
          "found = [describe(*quantize_fp8_blocks(w), (128, 128), lib=native.library()),\n"
          "         describe(p, s4, (1, 32), packed_fp4=True),\n"
          "         describe(w.bfloat16())]\n"
          "x = torch.randn(5, 270, generator=g)\n"
          "h = hashlib.sha256()\n"
          "for f in found:\n"
          "    for m in (1, 2, 5):\n"
          "        h.update(native_mm(native.library(), x[:m], *f).numpy().tobytes())\n"
          "print(native.available(), h.hexdigest())\n")


def test_a_build_without_avx2_decodes_to_the_same_bits(tmp_path):
    """Without -march=native the decoders run as scalar C (ldexpf, a table) and the dot lane by
    lane with fmaf: the same values and IEEE operations in the same order, so the same bits."""
    fake = tmp_path / "cc-no-march"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-march=native" ] && exit 1; done\nexec cc "$@"\n')
    fake.chmod(0o755)
    env = dict(CC=str(fake), KVFOLD_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                           env={**__import__("os").environ, **e}) for e in (env, {})]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split()[0] == "True" and runs[0].stdout == runs[1].stdout
    assert native.available()


def test_a_build_without_avx512_decodes_to_the_same_bits(tmp_path):
    """KVFOLD_NATIVE_ISA=avx2 builds the kernels as an AVX2 machine does (`make test` runs the
    batch-invariance tests with it): on an AVX-512 machine the compiler's vectorised loops then use
    other instructions, and the bits must not move."""
    env = dict(__import__("os").environ, KVFOLD_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                           env={**env, "KVFOLD_NATIVE_ISA": isa}) for isa in ("avx2", "native")]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout.split()[0] == "True" and runs[0].stdout == runs[1].stdout
    assert len(list((tmp_path / "cache").glob("native-*.so"))) == 2  # two builds, not one reused
    bad = subprocess.run([sys.executable, "-c", "from kvfold.numerics import native; native.library()"],
                         capture_output=True, text=True, timeout=300, env={**env, "KVFOLD_NATIVE_ISA": "avx9"})
    assert bad.returncode != 0 and "KVFOLD_NATIVE_ISA='avx9': use one of native, avx2" in bad.stderr


def test_a_bf16_linear_of_decode_rows_rounds_the_fixed_order_fp32_dot_once():
    from helpers import ops_for
    from kvfold.layers.basic import NATIVE_ROWS, Linear
    ops = ops_for(dtype=torch.bfloat16)  # a bf16 model on the CPU: its weight matmuls in native.c
    lin = Linear(136, 40, torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weights(40, 136, 9).bfloat16())
    for m in (1, 3, NATIVE_ROWS):
        x = rows(m, 136, m).bfloat16()
        got = lin(x, ops)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, invariant_mm(LIB, x.float(), lin.weight.float()).bfloat16())


@pytest.mark.parametrize("flags", [False, True])
def test_the_nan_code_scan_sees_every_row_and_column(flags):
    from kvfold.numerics.weights_mm import scan_fp8_codes
    codes = torch.zeros(1000, 300, dtype=torch.uint8)  # rows split over the threads
    assert not scan_fp8_codes(LIB, codes.view(torch.float8_e4m3fn), 8, flags)[0]
    for r, c in ((999, 299), (0, 0), (500, 150), (731, 7)):
        for code in (0x7F, 0xFF):
            codes[r, c] = code
            assert scan_fp8_codes(LIB, codes.view(torch.float8_e4m3fn), 8, flags)[0]
        codes[r, c] = 0x7E  # 448, the largest finite code
        assert not scan_fp8_codes(LIB, codes.view(torch.float8_e4m3fn), 8, flags)[0]


def _plant_subnormal_codes(q: torch.Tensor, spots) -> torch.Tensor:
    """q with a subnormal e4m3 code (exponent bits 0, mantissa 1-7) at each (.., row, column) spot."""
    codes = q.view(torch.uint8).clone()
    for i, spot in enumerate(spots):
        codes[spot] = (0x80 if i % 2 else 0x00) | (1 + i % 7)
    return codes.view(torch.float8_e4m3fn)


def test_subnormal_fp8_codes_flag_exactly_the_row_blocks_that_hold_them():
    # The flags say which row's column block a folded decode row must decode through halves (a
    # float32 subnormal operand costs Intel cores a microcode assist). Checked against the codes'
    # values: a subnormal e4m3 value is nonzero and below 2^-6, the smallest normal.
    q, _ = quantize_fp8_blocks(weights(3 * 40, 300, 11).view(3, 40, 300), (128, 128))
    q = _plant_subnormal_codes(q, [(0, 0, 0), (0, 5, 299), (1, 39, 130), (2, 17, 255), (2, 17, 256)])
    v = q.float()
    sub = (v != 0) & (v.abs() < 2 ** -6)
    want = torch.nn.functional.pad(sub, (0, 3 * 128 - 300)).view(3, 40, 3, 128).any(-1)
    assert 5 <= int(want.sum()) < want.numel()  # the planted ones, and any the quantizer wrote
    desc = describe(q, torch.full((3, 1, 3), 127, dtype=torch.uint8), (128, 128), subnormal_flags=True)[0]
    flags = desc.tensors[2]
    assert torch.equal(flags.bool(), want)
    assert desc.subnormal_blocks == flags.data_ptr() and desc.subnormal_stride == 40 * 3
    from kvfold.numerics.weights_mm import scan_fp8_codes
    assert torch.equal(scan_fp8_codes(LIB, q, 128)[1], flags)
    clean = q.view(torch.uint8).clone()
    clean[sub] = 0
    assert describe(clean.view(torch.float8_e4m3fn), torch.full((3, 1, 3), 127, dtype=torch.uint8),
                    (128, 128), subnormal_flags=True)[0].subnormal_blocks is None
    assert describe(q, torch.full((3, 1, 3), 127, dtype=torch.uint8), (128, 128),
                    subnormal_flags=False)[0].subnormal_blocks is None


def test_only_cpus_known_to_run_subnormal_operands_at_full_rate_drop_the_flags():
    from kvfold.numerics.weights_mm import subnormal_assists
    assert not subnormal_assists("AuthenticAMD")
    assert subnormal_assists("GenuineIntel") and subnormal_assists("") and subnormal_assists("HygonGenuine")


def test_fp8_decode_rows_stay_exact_where_a_tile_mixes_flagged_and_clean_blocks():
    # A folded tile of four rows takes the half-precision decode for a column block where any of its
    # rows holds a subnormal code and folds the others: each output must still be the dot over the
    # dequantized weight, in a stack of matrices and in row groups that start inside a tile.
    block = (128, 128)
    q, s = quantize_fp8_blocks(weights(2 * 64, 384, 12).view(2, 64, 384), block)
    q = _plant_subnormal_codes(q, [(0, 1, 3), (0, 6, 200), (0, 6, 201), (0, 63, 383), (1, 12, 128), (1, 40, 7)])
    dense = dequant_fp8_blocks(q, s, block)
    found = describe(q, s, block, subnormal_flags=True)
    assert found[0].subnormal_blocks
    x = rows(5, 384, 6)
    for m in (1, 2, 5):  # a decode row, a tile of two rows, tiles of four and one
        for e in range(2):
            exactly(native_mm(LIB, x[:m], *found, index=e), invariant_mm(LIB, x[:m], dense[e]))
        flat_q, flat_s = q[0].contiguous(), s[0].contiguous()
        for desc, per, k in row_groups(describe(flat_q, flat_s, block, subnormal_flags=True), 8):
            first = (desc.data - flat_q.data_ptr()) // 384
            exactly(native_mm(LIB, x[:m], desc, per, k), invariant_mm(LIB, x[:m], dense[0, first:first + per]))


@pytest.mark.parametrize("k, bc", [(256, 128), (200, 64), (96, 32)])
def test_the_code_scan_flags_exactly_the_blocks_holding_a_subnormal_and_finds_nans(k, bc):
    """scan_fp8_codes against the definition, code by code: a subnormal is exponent bits 0 with a
    nonzero mantissa (both signs), a NaN 0x7F or 0xFF; edge blocks of k % bc columns included."""
    from kvfold.numerics.weights_mm import scan_fp8_codes
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 256, (70, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x40  # no NaN yet
    codes[(codes & 0x78) == 0] = 0x38  # no subnormal yet (zeros too)
    for r, c, v in [(0, 0, 0x01), (3, k - 1, 0x87), (9, bc, 0x80), (11, bc - 1, 0x07), (12, 5, 0x00)]:
        codes[r, c] = v  # 0x80 and 0x00 are zeros, not subnormals
    want = torch.zeros(70, -(-k // bc), dtype=torch.uint8)
    for r, c in ((0, 0), (3, k - 1), (11, bc - 1)):
        want[r, c // bc] = 1
    nan, flags = scan_fp8_codes(LIB, codes.view(torch.float8_e4m3fn), bc)
    assert not nan and torch.equal(flags, want)
    codes[40, 7] = 0xFF
    assert scan_fp8_codes(LIB, codes.view(torch.float8_e4m3fn), bc)[0]
    clean = codes.clone()
    clean[(clean & 0x78) == 0] = 0x38
    clean[40, 7] = 0x7F
    nan, flags = scan_fp8_codes(LIB, clean.view(torch.float8_e4m3fn), bc)
    assert nan and flags is None

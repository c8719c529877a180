"""The bf16 dot (dot="bf16", native_bf16dot.h): every kernel path equals the definition written in
torch (numerics/bf16_dot.py) bit for bit, under AVX512-BF16 and under AVX2 alike (make test runs
the `exactness` tests again with KVFOLD_NATIVE_ISA=avx2); its error stays within the bound
derived from bf16's rounding; a model that takes it still agrees with itself across prefill,
chunks, decode and batches; and where it cannot run it is refused with nothing changed."""
from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.errors import ConfigError
from kvfold.numerics import native
from kvfold.numerics.bf16_dot import bf16_dot_mm, round_bf16
from kvfold.numerics.quant import dequant_fp4_blocks, dequant_fp8_blocks, quantize_fp4_blocks
from kvfold.numerics.weights_mm import describe, describe_pieces, native_mm
from helpers import fp32_paths_bound
from test_official_checkpoint import IDS, official_tensors, tiny_v4, write_official

LIB = native.library()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations with rounding ties (low 16 bits 0x8000, odd and even), a float32 subnormal and a
    negative zero among the random ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3
    bits = x.view(torch.int32)
    bits[:, 0::7] = (bits[:, 0::7] & ~0xFFFF) | 0x8000
    bits[:, 1::11] = (bits[:, 1::11] & ~0x1FFFF) | 0x18000
    x[:, 3] = 1e-40
    x[:, 4] = -0.0
    return x


def _fp8(n: int, k: int, seed: int, e8m0: bool):
    """FP8 codes with every class (subnormal codes 1..7, zeros of both signs, normal), blocks of
    128; e8m0 or float scales with one block row out of the shortcut's range."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (they take the general path anyway)
    codes[0, :8] = torch.arange(8, dtype=torch.uint8)
    codes[1, :8] = torch.arange(8, dtype=torch.uint8) | 0x80
    blocks = (-(-n // 128), -(-k // 128))
    if e8m0:
        scale = torch.randint(110, 135, blocks, generator=g, dtype=torch.uint8)
        scale[-1, 0] = 250  # 2^123: out of the shortcut's range, decoded value by value
        return codes.view(torch.float8_e4m3fn), scale, dequant_fp8_blocks(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    scale = torch.rand(blocks, generator=g) * 0.01 + 1e-3
    scale[-1, 0] = 1e-37  # below 2^-117: its products could be subnormal, decoded value by value
    return codes.view(torch.float8_e4m3fn), scale, dequant_fp8_blocks(codes.view(torch.float8_e4m3fn), scale, (128, 128))


def _fp4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    codes[0, :8] = torch.tensor([0x80, 0x08, 0x88, 0x00, 0x12, 0x9F, 0xF7, 0x71], dtype=torch.uint8)  # "-0" codes
    scale = torch.randint(115, 135, (n, -(-k // 32)), generator=g, dtype=torch.uint8)
    scale[2, 0], scale[3, 1] = 2, 254  # out of the shortcut's range
    return codes, scale, dequant_fp4_blocks(codes, scale, 32)


def _weight(fmt: str, n: int, k: int, seed: int):
    """(descriptor found, dequantized fp32 weight) with dot='bf16'."""
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)
        w.view(torch.int16)[0, :3] = torch.tensor([1, -32767, 0x0040], dtype=torch.int16)  # stored subnormals
        return describe(w, lib=LIB, dot="bf16"), w.float()
    if fmt == "fp4":
        codes, scale, dense = _fp4(n, k, seed)
        return describe(codes, scale, (1, 32), packed_fp4=True, lib=LIB, dot="bf16"), dense
    codes, scale, dense = _fp8(n, k, seed, e8m0=fmt == "fp8-e8m0")
    return describe(codes, scale, (128, 128), lib=LIB, dot="bf16"), dense


@pytest.mark.exactness
@pytest.mark.parametrize("fmt", ["bf16", "fp8-e8m0", "fp8-float-scales", "fp4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_every_kernel_path_computes_the_definition(fmt, rows):
    # k 256 and 160: whole steps, and a padded last step (fp8 keeps whole 128 blocks); n 260 and 21
    # cross tiles, thread blocks and panels
    for k, n in ([(256, 260), (384, 21)] if fmt.startswith("fp8") else [(256, 260), (160, 21)]):
        found, dense = _weight(fmt, n, k, seed=rows)
        assert found is not None and found[0].dot == 1
        x = _x(rows, k, seed=rows + k)
        got = native_mm(LIB, x, *found)
        want = bf16_dot_mm(x, dense)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (fmt, rows, k)


@pytest.mark.exactness
def test_pieces_read_as_the_joined_stack():
    parts = [_fp4(16, 128, seed) for seed in range(4)]
    pieces = [[(parts[2 * e + i][0], parts[2 * e + i][1]) for i in range(2)] for e in range(2)]
    found = describe_pieces(pieces, (1, 32), packed_fp4=True, lib=LIB, dot="bf16")
    x = _x(3, 128, seed=5)
    for e in range(2):
        dense = torch.cat([parts[2 * e][2], parts[2 * e + 1][2]])
        got, want = native_mm(LIB, x, *found, index=e), bf16_dot_mm(x, dense)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_error_stays_within_the_bound_bf16_rounding_gives():
    # each of x and w moves by at most 2^-9 of itself when rounded (to nearest, 8 significant bits),
    # so a product by at most 2^-8 + 2^-18 of itself; the fp32 sums add gamma_n = n u / (1 - n u),
    # u = 2^-24, n = k / 16 fused steps a lane plus 4 halving adds, over the products' magnitudes
    k, n = 4096, 64
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    found, dense = _weight("fp8-float-scales", n, k, seed=3)
    got = native_mm(LIB, x, *found).double()
    exact = x.double() @ dense.double().T
    mags = x.double().abs() @ dense.double().abs().T
    steps = k // 16 + 4
    gamma = steps * 2.0 ** -24 / (1 - steps * 2.0 ** -24)
    bound = mags * ((2.0 ** -8 + 2.0 ** -18) + (1 + 2.0 ** -8 + 2.0 ** -18) * gamma)
    assert bool(((got - exact).abs() <= bound).all())
    assert not torch.equal(got, exact)  # it is a rounding: the bound is not vacuous here


def test_rounding_to_bf16_is_to_nearest_even_with_subnormals_flushed():
    x = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1e-40, -1e-40, 2.0 ** -126, float("inf")])
    assert round_bf16(x).tolist() == [1.0, 1 + 2 ** -6, 0.0, 0.0, 2.0 ** -126, float("inf")]
    assert math.copysign(1, round_bf16(x)[3].item()) == -1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    original = tiny_v4()
    return write_official(tmp_path_factory.mktemp("bf16dot"), official_tensors(original), original.config)


@pytest.mark.batch_invariance
def test_a_bf16_dot_model_keeps_batch_invariance_and_its_paths_agree(checkpoint):
    model = kvfold.load_model(checkpoint, weights="quantized", dot="bf16")
    fp32 = kvfold.load_model(checkpoint, weights="quantized")
    ids = IDS[:24]
    whole = model.forward(ids, model.new_state(capacity=40))
    assert not torch.equal(whole, fp32.forward(ids, fp32.new_state(capacity=40)))  # the dot is in use
    # a row's bits do not depend on what shares its call: prefill chunks and decode rows
    alone = model.forward(ids[:5], model.new_state(capacity=40))
    other = model.new_state(capacity=40)
    model.forward(IDS[30:37], other)
    both = model.forward_batch([(ids[:5], model.new_state(capacity=40)), (IDS[30:33], other)], last_only=False)
    assert torch.equal(both[0], alone)
    st, st2 = model.new_state(capacity=40), model.new_state(capacity=40)
    model.forward(ids[:6], st), model.forward(ids[:6], st2)
    one = model.forward([ids[6]], st)
    assert torch.equal(model.forward_batch([([ids[6]], st2), ([3], other)])[0], one)
    # chunks and decode see the same dot; their attention's fp32 roundings may flip an activation's
    # bf16 rounding, so they agree within the paths bound at bf16's eps (helpers.fp32_paths_bound)
    st = model.new_state(capacity=40)
    chunked = torch.cat([model.forward(ids[:10], st), model.forward(ids[10:17], st)]
                        + [model.forward([t], st) for t in ids[17:]])
    bound = fp32_paths_bound(whole, model.config.num_hidden_layers, torch.bfloat16)
    assert (chunked - whole).abs().max().item() < bound


def test_the_bf16_dot_is_refused_where_it_cannot_run_and_changes_nothing(checkpoint):
    with pytest.raises(ConfigError, match="weights='quantized'"):
        kvfold.load_model(checkpoint, dot="bf16")
    with pytest.raises(ConfigError, match="'fp32' or 'bf16'"):
        kvfold.load_model(checkpoint, weights="quantized", dot="fp16")
    model = kvfold.load_model(checkpoint, weights="quantized", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="fp32 models"):
        model.set_dot("bf16")
    assert model.dot == "fp32" and all(w.dot == "fp32" for w in model.quantized_weights().values())
    bf = kvfold.load_model(checkpoint, weights="quantized", dot="bf16")
    assert "bf16 dot" in dict((op, why) for op, _, why in bf.backend().describe())["weight_mm"]
    bf.set_dot("fp32")  # and back: the fp32 dot's bits again
    fp32 = kvfold.load_model(checkpoint, weights="quantized")
    assert torch.equal(bf.forward(IDS[:9], bf.new_state(capacity=9)), fp32.forward(IDS[:9], fp32.new_state(capacity=9)))

"""FP8 / FP4 weight formats and the REF quantization simulations (kvfold.numerics.quant), each
against exact values or an independent brute-force construction."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.numerics.quant import (act_quant_fp8, dequant_fp4_blocks, dequant_fp8_blocks, dequant_fp8_into,
                                   e2m1_round, e4m3_round, e8m0_to_float, fp4_e2m1_simulate, fp8_e4m3_simulate,
                                   hadamard, pack_fp4, quantize_act_fp8, quantize_fp4_blocks, quantize_fp8_blocks,
                                   sylvester_matrix, unpack_fp4)

FP4_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 codes 0..7


def fp4_value(nibble: int) -> float:
    mag = FP4_MAGNITUDES[nibble & 7]
    return -mag if nibble & 8 else mag


def e4m3_grid() -> list[tuple[float, int]]:
    """Every finite non-negative e4m3fn value with its code, decoded from the bit layout (s.eeee.mmm, bias 7)."""
    out = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        out.append(((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))
    return out


def nearest_even(x: float, grid: list[tuple[float, int]]) -> float:
    """Brute force: the grid value nearest |x| (ties -> even code), saturating at the top, with x's sign."""
    a = min(abs(x), grid[-1][0])
    best = min(grid, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return math.copysign(best[0], x) if best[0] else 0.0


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) for e8m0 exponent bytes, exactly."""
    return torch.ldexp(torch.ones(e.shape), e.to(torch.int32) - 127)


E2M1_GRID = [(v, c) for c, v in enumerate(FP4_MAGNITUDES)]
E4M3_GRID = e4m3_grid()


# ---- e8m0 scales --------------------------------------------------------------------------------

def test_e8m0_bytes_decode_to_powers_of_two_in_every_storage_dtype():
    e = torch.tensor([0, 1, 100, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0 ** -127, 2.0 ** -126, 2.0 ** -27, 0.5, 1.0, 2.0, 2.0 ** 127]
    got = e8m0_to_float(e)
    assert got.dtype == torch.float32 and got[:-1].tolist() == want and math.isnan(got[-1])
    assert torch.equal(e8m0_to_float(e.view(torch.float8_e8m0fnu))[:-1], got[:-1])
    assert torch.equal(e8m0_to_float(e.view(torch.float8_e8m0fnu))[:-1], e.view(torch.float8_e8m0fnu).float()[:-1])
    f = torch.tensor([0.3, 2.0])
    assert torch.equal(e8m0_to_float(f), f)  # HF weight_scale_inv: used as a multiplier as it is
    with pytest.raises(TypeError):
        e8m0_to_float(torch.zeros(2, dtype=torch.int32))


# ---- FP8 weights --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (7, 129), (2, 130, 140)])
def test_dequant_fp8_blocks_matches_the_formula_elementwise(shape):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    *lead, r, c = shape
    sshape = (*lead, math.ceil(r / 128), math.ceil(c / 128))
    e = torch.randint(110, 140, sshape, generator=g, dtype=torch.int32).to(torch.uint8)
    got = dequant_fp8_blocks(q, e)
    assert got.dtype == torch.float32 and got.shape == q.shape
    qf, el = q.float().reshape(-1, r, c), e.reshape(-1, *sshape[-2:]).tolist()
    want = torch.empty(qf.shape)
    for b in range(qf.shape[0]):
        for i in range(r):
            for jb in range(sshape[-1]):
                j = slice(jb * 128, min((jb + 1) * 128, c))
                want[b, i, j] = qf[b, i, j] * 2.0 ** (el[b][i // 128][jb] - 127)
    assert torch.equal(got, want.reshape(shape))
    assert torch.equal(dequant_fp8_blocks(q, e.view(torch.float8_e8m0fnu)), got)
    assert torch.equal(dequant_fp8_blocks(q, e8m0_to_float(e)), got)  # already-float scales


def test_dequant_fp8_with_non_power_of_two_float_scales_and_into_bf16():
    q = torch.tensor([[1.0, -2.0, 448.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.3]])
    assert torch.equal(dequant_fp8_blocks(q, s), torch.tensor([[1.0, -2.0, 448.0]]) * torch.tensor(0.3))
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(130, 260, generator=g) * 50).to(torch.float8_e4m3fn)
    e = torch.randint(100, 150, (2, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(130, 260, dtype=torch.bfloat16)
    dequant_fp8_into(out, q, e)
    assert torch.equal(out, dequant_fp8_blocks(q, e).to(torch.bfloat16))  # exact: e4m3 * 2^k fits bf16


def test_dequant_rejects_a_scale_of_the_wrong_shape():
    q = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale of shape"):
        dequant_fp8_blocks(q, torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale of shape"):
        dequant_fp4_blocks(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))


def test_quantize_fp8_scale_rule_at_the_amax_448_boundaries():
    w = torch.zeros(256, 512)
    w[0, 0] = 448.0                                     # block (0,0): amax/448 = 1 -> scale 2^0
    w[0, 128] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))  # just above -> 2^1
    w[0, 256] = 224.0                                   # exactly half -> 2^-1
    w[128, 0] = 225.0                                   # above half -> 2^0
    w[128, 128] = 1.0                                   # ceil(log2(1/448)) = -8
    w[128, 256] = -3.5 * 2.0 ** -20                     # sign ignored: amax 3.5*2^-20 -> ceil(log2(3.5/448)) - 20 = -27
    q, e = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and e.dtype == torch.uint8 and e.shape == (2, 4)
    k = e.to(torch.int32) - 127
    assert k[0, :3].tolist() == [0, 1, -1] and k[1, :3].tolist() == [0, -8, -27]
    assert k[0, 3].item() == -127 and k[1, 3].item() == -127  # all-zero blocks: the smallest scale
    assert q.float()[0, 0] == 448 and q.float()[0, 128] == 224 and q.float()[0, 256] == 448
    assert q.float()[128, 128] == 256 and q.float()[128, 256] == -448


def test_quantize_fp8_blocks_round_trips_grid_values_and_rounds_others_to_nearest():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 2, 200)
    q, e = quantize_fp8_blocks(w)
    d = dequant_fp8_blocks(q, e)
    assert e.shape == (3, 2)
    # each value is the e4m3 rounding of w / s, times s
    s = pow2(e).repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert torch.equal(d, e4m3_round(w / s) * s)
    q2, e2 = quantize_fp8_blocks(d)  # already on the grid: lossless
    assert torch.equal(dequant_fp8_blocks(q2, e2), d)


# ---- FP4 weights --------------------------------------------------------------------------------

def test_dequant_fp4_every_byte_low_nibble_is_the_even_column():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).reshape(2, 128)
    e = torch.arange(120, 136, dtype=torch.int32).to(torch.uint8).reshape(2, 8)  # [2, 256/32]
    got = dequant_fp4_blocks(packed, e)
    assert got.shape == (2, 256)
    for r in range(2):
        for j in range(128):
            byte = r * 128 + j
            for col, nib in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                want = fp4_value(nib) * 2.0 ** (e[r, col // 32].item() - 127)
                assert got[r, col].item() == want, (r, col, byte)
    assert torch.equal(dequant_fp4_blocks(packed.view(torch.uint8), e), got)
    assert torch.equal(dequant_fp4_blocks(packed.view(torch.float4_e2m1fn_x2), e.view(torch.float8_e8m0fnu)), got)


def test_pack_fp4_layout_and_hand_checked_bytes():
    codes = torch.tensor([[1, 7, 15, 8, 2, 12]], dtype=torch.uint8)
    p = pack_fp4(codes)
    assert p.dtype == torch.int8 and p.view(torch.uint8).tolist() == [[0x71, 0x8F, 0xC2]]
    assert unpack_fp4(p).tolist() == [[0.5, 6.0, -6.0, 0.0, 1.0, -2.0]]  # code 8 (-0) decodes to +0
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))


def test_quantize_fp4_scale_rule_ties_to_even_and_packing():
    # one row, 4 blocks of 32; block 0 has amax 6 (scale 1) and every tie of the e2m1 grid
    w = torch.zeros(1, 128)
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.2, -0.8]
    w[0, :len(ties)] = torch.tensor(ties)
    w[0, 32] = torch.nextafter(torch.tensor(6.0), torch.tensor(9.0))  # block 1 -> scale 2
    w[0, 64] = 3.0                                                   # block 2 -> scale 1/2
    w[0, 96] = -0.001                                                # block 3 -> ceil(log2(0.001/6)) = -12
    p, e = quantize_fp4_blocks(w)
    assert p.shape == (1, 64) and p.dtype == torch.int8 and e.shape == (1, 4)
    assert (e.to(torch.int32) - 127).tolist() == [[0, 1, -1, -12]]
    d = dequant_fp4_blocks(p, e)
    assert d[0, :len(ties)].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 0.0, -1.0]
    assert d[0, 32].item() == 6.0 and d[0, 64].item() == 3.0  # 6.0000005 / 2 rounds to 3
    assert d[0, 96].item() == -4.0 * 2.0 ** -12  # -0.001 / 2^-12 = -4.096 -> -4
    assert p.view(torch.uint8)[0, 0].item() == 0x07  # cols (6.0 -> code 7, 0.25 -> code 0): low nibble first


def test_quantize_fp4_matches_brute_force_nearest_even_and_round_trips():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 16, 96, generator=g)  # stacked experts [E, R, C]
    p, e = quantize_fp4_blocks(w)
    assert p.shape == (3, 16, 48) and e.shape == (3, 16, 3)
    d = dequant_fp4_blocks(p, e)
    s = pow2(e).repeat_interleave(32, -1)
    want = torch.tensor([nearest_even(v, E2M1_GRID) for v in (w / s).flatten().tolist()]).reshape(w.shape) * s
    assert torch.equal(d, want)
    p2, e2 = quantize_fp4_blocks(d)
    assert torch.equal(dequant_fp4_blocks(p2, e2), d)


# ---- grids --------------------------------------------------------------------------------------

def test_rounding_ties_to_even_and_saturation_on_both_grids():
    assert e2m1_round(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, -0.75, -5.5])).tolist() == \
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -6.0]
    x = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 2.0 ** -10, 3 * 2.0 ** -10, 464.0, 500.0, -1e9, 240.0, 272.0])
    assert e4m3_round(x).tolist() == [1.0, 1.25, 0.0, 2.0 ** -8, 448.0, 448.0, -448.0, 240.0, 256.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=40))
def test_simulations_pick_the_nearest_even_grid_point_with_the_power_of_two_scale(vals):
    x = torch.tensor(vals, dtype=torch.float32)
    for sim, grid, qmax, floor, block in ((fp8_e4m3_simulate, E4M3_GRID, 448.0, 1e-4, 64),
                                          (fp4_e2m1_simulate, E2M1_GRID, 6.0, 6 * 2.0 ** -126, 32)):
        got = sim(x, block)
        for b0 in range(0, len(vals), block):
            blk = vals[b0:b0 + block]
            amax = max(max(abs(v) for v in blk), floor)
            k = math.ceil(math.log2(float(torch.tensor(amax, dtype=torch.float32) / qmax)))
            s = 2.0 ** k
            assert float(torch.tensor(amax) / s) <= qmax
            want = [nearest_even(v / s, grid) * s for v in blk]
            assert got[b0:b0 + block].tolist() == pytest.approx(want, rel=0, abs=0), (blk, s)


def test_fp8_simulation_scale_boundaries_and_floor():
    one = torch.tensor([448.0, 1.0 + 1 / 16, 3 * 2.0 ** -10, 0.0])  # amax 448 -> s = 1
    assert fp8_e4m3_simulate(one, 4).tolist() == [448.0, 1.0, 2.0 ** -8, 0.0]
    up = torch.tensor([448.0 * (1 + 2.0 ** -20), 17.0])  # just above 448 -> s = 2: [224.0002, 8.5] -> [224, 8]
    assert fp8_e4m3_simulate(up, 2).tolist() == [448.0, 16.0]
    _, s_up = quantize_act_fp8(up, 2)
    assert s_up.tolist() == [2.0]
    tiny = torch.tensor([1e-6, -3e-7])  # amax below the 1e-4 floor: s = 2^ceil(log2(1e-4/448)) = 2^-22
    s = 2.0 ** -22
    assert fp8_e4m3_simulate(tiny, 2).tolist() == [4.0 * s, -(1.25 * s)]
    assert fp8_e4m3_simulate(torch.zeros(3, 64)).abs().sum() == 0


def test_fp4_simulation_scale_boundaries_and_floor():
    assert fp4_e2m1_simulate(torch.tensor([6.0, 0.25, 0.75, 5.0]), 4).tolist() == [6.0, 0.0, 1.0, 4.0]
    # amax 12 -> s = 2: [6, .5, 1.5, -2.5] -> [6, .5, 1.5, -2] (tie to even)
    assert fp4_e2m1_simulate(torch.tensor([12.0, 1.0, 3.0, -5.0]), 4).tolist() == [12.0, 1.0, 3.0, -4.0]
    up = torch.tensor([6.0 * (1 + 2.0 ** -20), 1.0])  # just above 6 -> s = 2: [3.0000029, 0.5] -> [3, 0.5]
    assert fp4_e2m1_simulate(up, 2).tolist() == [6.0, 1.0]
    sub = torch.tensor([1e-39, 0.0])  # under the 6*2^-126 floor: s = 2^-126
    assert fp4_e2m1_simulate(sub, 2).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulations_are_idempotent_and_keep_dtype(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 448, generator=g) * torch.logspace(-8, 3, 448)).to(dtype)
    x[1, :64] = 0
    x[2, :32] = 1e-30
    for sim, block in ((fp8_e4m3_simulate, 64), (fp4_e2m1_simulate, 32), (act_quant_fp8, 128)):
        y = sim(x, block)
        assert y.dtype == dtype and y.shape == x.shape
        assert torch.equal(sim(y, block), y)


def test_act_quant_fp8_is_per_token_1x128_with_power_of_two_scales():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=g)
    x[1, 128:] *= 1000
    q, s = quantize_act_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    m, _ = torch.frexp(s)
    assert torch.all(m == 0.5)  # powers of two
    assert s[1, 1] > 500 * s[1, 0]  # blocks scale independently
    assert torch.equal(act_quant_fp8(x), q.float() * s.repeat_interleave(128, -1))
    assert torch.equal(act_quant_fp8(x), fp8_e4m3_simulate(x, 128))


# ---- Hadamard -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_hadamard_is_the_scaled_sylvester_matrix_and_orthonormal(n):
    brute = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)])
    assert torch.equal(sylvester_matrix(n), brute)
    h = hadamard(torch.eye(n))  # row i = H e_i = column i of H (symmetric)
    assert torch.allclose(h, brute * n ** -0.5, atol=1e-7, rtol=0)
    assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-6)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 3, n, generator=g)
    assert torch.allclose(hadamard(x), x @ brute.T * n ** -0.5, atol=1e-5)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)
    xb = x.to(torch.bfloat16)
    assert hadamard(xb).dtype == torch.bfloat16


def test_hadamard_of_integer_vectors_is_exact_before_scaling():
    x = torch.arange(16, dtype=torch.float32)
    assert torch.equal(hadamard(x) * 4, sylvester_matrix(16) @ x)
    with pytest.raises(ValueError):
        hadamard(torch.zeros(2, 12))

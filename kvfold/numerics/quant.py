"""Low-precision formats of DeepSeek-V4: checkpoint weights and the reference (REF) simulations.

Weights, as the official release stores them:
* FP8 e4m3 with one ue8m0 scale per 128x128 block:  W[i, j] = q[i, j] * 2^(e[i//128, j//128] - 127).
* FP4 e2m1, two values per byte (LOW nibble = even column), one ue8m0 scale per 1x32 block along
  the input (last) dim:  W[i, j] = fp4(q[i, j]) * 2^(e[i, j//32] - 127).
A scale tensor may come as `float8_e8m0fnu`, as raw exponent bytes (`uint8`), or as ordinary floats
(HF's `weight_scale_inv`, or `scale_dtype: fp32` checkpoints), which are used as multipliers as they are.
Every dequantizer also takes stacked tensors (leading dims, e.g. experts [E, R, C]).

Simulations (REF's bf16 numerics), all with power-of-two scales over blocks of the last dim:
* `fp8_e4m3_simulate(x, 64)`: s = 2^ceil(log2(max(amax, 1e-4)/448)),  x <- e4m3(clamp(x/s, +-448)) * s
* `fp4_e2m1_simulate(x, 32)`: s = 2^ceil(log2(max(amax, 6*2^-126)/6)), x <- e2m1(clamp(x/s, +-6)) * s
* `act_quant_fp8(x, 128)`: per-token 1x128 e4m3 activations before FP8/FP4 GEMMs (same rule as the
  FP8 simulation, REF's `act_quant`).
* `hadamard(x)`: Sylvester Hadamard over the last dim, scaled by dim^-0.5, no random signs.
All rounding is to nearest, ties to even (the even code of the target grid).
"""
from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
FP8_BLOCK = (128, 128)
FP4_BLOCK = 32
ACT_AMAX_FLOOR = 1e-4              # REF act_quant / FP8 KV simulation
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # REF fp4_act_quant

# e2m1 code (sign bit 3, magnitude bits 0-2) -> value. Code 8 ("-0") decodes to +0 as in REF's table.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_TABLE = torch.tensor(FP4_VALUES, dtype=torch.float32)
# byte -> (value of the low nibble, value of the high nibble)
_FP4_BYTE_TABLE = torch.stack([_FP4_TABLE[torch.arange(256) & 0xF], _FP4_TABLE[torch.arange(256) >> 4]], dim=-1)
_QUANT_FLOAT_DTYPES = (torch.float8_e4m3fn,)


# ---- scales -----------------------------------------------------------------------------------

def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32 multipliers: e8m0 bytes (`float8_e8m0fnu` or raw `uint8` exponents)
    decode to 2^(e-127) exactly (e = 255 is NaN); float scales are returned as float32 unchanged."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        e = scale.view(torch.uint8).to(torch.int32)
        bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # 2^-127 is a float32 subnormal
        out = bits.view(torch.float32).clone()
        out[e == 255] = float("nan")
        return out
    if scale.dtype.is_floating_point:
        return scale.to(torch.float32)
    raise TypeError(f"a block scale must be float8_e8m0fnu, uint8 exponents or a float tensor; got {scale.dtype}")


def pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) as int32 for positive finite x (float32), via frexp, no log rounding."""
    m, e = torch.frexp(x.to(torch.float32))
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def _exp2_int(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for int k in [-149, 127], exact."""
    return torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.to(torch.int32))


def _pow2_scale(amax: torch.Tensor, qmax: float, floor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent k int32, 2^k float32) with k = ceil(log2(amax/qmax)), the ratio computed in float32
    like REF; amax is floored first when `floor` is given; k is clamped to e8m0's range [-127, 127]."""
    a = amax.to(torch.float32)
    if floor is not None:
        a = a.clamp_min(floor)
    ratio = a / qmax
    k = torch.where(ratio > 0, pow2_ceil_exponent(torch.where(ratio > 0, ratio, torch.ones_like(ratio))),
                    torch.full_like(ratio, -E8M0_BIAS, dtype=torch.int32))
    k = k.clamp(-E8M0_BIAS, E8M0_BIAS)
    return k, _exp2_int(k)


# ---- grids ------------------------------------------------------------------------------------

def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to the even code), saturating
    at +-6; returns uint8 codes (sign in bit 3; zero always gets code 0)."""
    a = x.to(torch.float32).abs()
    # thresholds between neighbours; a tie goes up only when the upper code is even
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    mag = torch.where(torch.isnan(a), torch.zeros_like(mag), mag)
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the e2m1 grid (float32), as `e2m1_codes` then decoded."""
    return _FP4_TABLE.to(x.device)[e2m1_codes(x).long()]


def e4m3_saturate(x: torch.Tensor) -> torch.Tensor:
    """x as float8_e4m3fn (nearest, ties to even), saturating at +-448 (a plain cast does not
    saturate everywhere): how FP8 KV storage writes its rows."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8_e4m3fn (nearest, ties to even), saturating at +-448, as float32."""
    return e4m3_saturate(x.to(torch.float32)).to(torch.float32)


# ---- FP4 packing ------------------------------------------------------------------------------

def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., C] (C even) -> int8 [..., C/2]; column 2j in the low nibble, 2j+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes [..., C/2] (int8, uint8 or float4_e2m1fn_x2) -> unscaled values float32 [..., C]."""
    b = packed.view(torch.uint8)
    vals = _FP4_BYTE_TABLE.to(b.device).index_select(0, b.reshape(-1).to(torch.int32))  # [N, 2]
    return vals.view(*b.shape[:-1], 2 * b.shape[-1])


# ---- weight dequantization --------------------------------------------------------------------

_LOOKUP_CHUNK = 1 << 20  # bytes decoded per table lookup: bounds the int32 index temporary (4 MiB)
_BYTE_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _byte_table(fmt: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """byte -> what it decodes to in `dtype`, for one lookup per byte: "fp8" one e4m3fn value [256];
    "fp4" the (low, high) nibble values, as one integer twice the dtype's width [256] when there is one,
    else [256, 2]. Built from `.to(dtype)` of each code, so a lookup equals a conversion bit for bit."""
    key = (fmt, dtype, device)
    table = _BYTE_TABLES.get(key)
    if table is None:
        if fmt == "fp8":
            table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype)
        else:
            table = _FP4_BYTE_TABLE.to(dtype)
            wide = _INT_OF_SIZE.get(2 * table.element_size())
            if wide is not None:
                table = table.view(wide).squeeze(-1)
        table = _BYTE_TABLES[key] = table.to(device)
    return table


def _decode_bytes_(out: torch.Tensor, b: torch.Tensor, fmt: str) -> None:
    """Fill the contiguous float tensor `out` with the values of the uint8 codes `b` (FP8: one value a
    byte; FP4: two, low nibble first) by table lookup, much faster on CPU than a float8 conversion."""
    table = _byte_table(fmt, out.dtype, out.device)
    flat = out.view(-1)
    if table.dtype != out.dtype:  # FP4 pairs as one wider integer
        flat = flat.view(table.dtype)
    elif fmt == "fp4":
        flat = flat.view(-1, 2)
    codes = b.reshape(-1)
    for i in range(0, codes.numel(), _LOOKUP_CHUNK):
        torch.index_select(table, 0, codes[i:i + _LOOKUP_CHUNK].to(torch.int32), out=flat[i:i + _LOOKUP_CHUNK])


def _check_fp8_scale(shape, scale_shape, block) -> None:
    *lead, r, c = shape
    want = (*lead, math.ceil(r / block[0]), math.ceil(c / block[1]))
    if tuple(scale_shape) != want:
        raise ValueError(f"FP8 weight {tuple(shape)} with {block[0]}x{block[1]} blocks needs a scale of shape "
                         f"{want}, got {tuple(scale_shape)}")


def _check_fp4_scale(shape, scale_shape, block) -> None:
    *lead, r, c = shape
    want = (*lead, r, math.ceil(c / block))
    if tuple(scale_shape) != want:
        raise ValueError(f"FP4 weight {tuple(shape)} with 1x{block} blocks needs a scale of shape {want}, "
                         f"got {tuple(scale_shape)}")


def _mul_block_scales_(out: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> None:
    """out[..., i, j] *= s[..., i // br, j // bc] in place, without materialising the expanded scale:
    the full blocks and the partial last row / column blocks are each one broadcast multiply."""
    br, bc = block
    r, c = out.shape[-2], out.shape[-1]
    fr, fc = r - r % br, c - c % bc
    for r0, r1, h in ((0, fr, br), (fr, r, r - fr)):
        for c0, c1, w in ((0, fc, bc), (fc, c, c - fc)):
            if r1 > r0 and c1 > c0:
                nr, nc = (r1 - r0) // h, (c1 - c0) // w
                part = out[..., r0:r1, c0:c1].unflatten(-1, (nc, w)).unflatten(-3, (nr, h))
                part.mul_(s[..., r0 // br:r0 // br + nr, c0 // bc:c0 // bc + nc].unsqueeze(-1).unsqueeze(-3))


@torch.no_grad()
def dequant_fp8_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Write q * scale (FP8 block dequantization) into the float tensor `out` of q's shape, in place:
    q is converted into `out`, then multiplied by its block's scale (one rounding to out's dtype,
    the same result as dequantizing in float32 and casting). No temporary beyond the float32 scales."""
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"output {tuple(out.shape)} and FP8 weight {tuple(q.shape)} differ in shape")
    _check_fp8_scale(q.shape, scale.shape, block)
    if q.dtype == torch.float8_e4m3fn and out.is_contiguous():
        _decode_bytes_(out, q.view(torch.uint8), "fp8")
    else:  # a float weight with block scales, or a strided destination
        out.copy_(q)
    _mul_block_scales_(out, e8m0_to_float(scale).to(out.device), block)
    return out


@torch.no_grad()
def dequant_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 [..., R, C] with block scales [..., ceil(R/128), ceil(C/128)] -> float32 [..., R, C]:
    W[i, j] = q[i, j] * 2^(e[i//128, j//128] - 127) (or * scale for float scales)."""
    return dequant_fp8_into(torch.empty(q.shape, dtype=torch.float32, device=q.device), q, scale, block)


@torch.no_grad()
def dequant_fp4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     block: int = FP4_BLOCK) -> torch.Tensor:
    """Write the FP4 dequantization of `packed` [..., R, C/2] into the contiguous `out` [..., R, C],
    in place, a few rows at a time."""
    *lead, r, half = packed.shape
    c = 2 * half
    if tuple(out.shape) != (*lead, r, c):
        raise ValueError(f"output {tuple(out.shape)} does not hold packed FP4 {tuple(packed.shape)} "
                         f"(expected {(*lead, r, c)})")
    _check_fp4_scale(out.shape, scale.shape, block)
    s = e8m0_to_float(scale).to(out.device)
    p2 = packed.view(torch.uint8).reshape(-1, half)
    o2 = out.view(-1, c)
    s2 = s.reshape(-1, s.shape[-1])
    step = max(1, _LOOKUP_CHUNK // max(half, 1))
    for i in range(0, p2.shape[0], step):
        o = o2[i:i + step]
        _decode_bytes_(o, p2[i:i + step], "fp4")
        _mul_block_scales_(o, s2[i:i + step], (1, block))
    return out


@torch.no_grad()
def dequant_fp4_blocks(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed FP4 e2m1 [..., R, C/2] (int8/uint8/float4_e2m1fn_x2; low nibble = even column) with
    scales [..., R, C/32] -> float32 [..., R, C]."""
    *lead, r, half = packed.shape
    return dequant_fp4_into(torch.empty(*lead, r, 2 * half, dtype=torch.float32, device=packed.device),
                            packed, scale, block)


# ---- weight quantization ----------------------------------------------------------------------

def _block_view(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, int, int]:
    """Zero-pad the last two dims to block multiples; -> ([..., R/br, br, C/bc, bc], R, C)."""
    r, c = w.shape[-2], w.shape[-1]
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        w = torch.nn.functional.pad(w, (0, pc, 0, pr))
    return w.unflatten(-1, (w.shape[-1] // bc, bc)).unflatten(-3, (w.shape[-2] // br, br)), r, c


@torch.no_grad()
def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (q float8_e4m3fn [..., R, C], scale uint8 e8m0 exponents [..., ceil(R/128), ceil(C/128)]),
    scale = 2^ceil(log2(amax/448)) per block (an all-zero block gets 2^-127)."""
    wf = w.detach().to(torch.float32)
    blocks, r, c = _block_view(wf, *block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R/br, C/bc]
    k, s = _pow2_scale(amax, E4M3_MAX, None)
    q = (blocks / s.unsqueeze(-1).unsqueeze(-3)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-2).flatten(-3, -2)[..., :r, :c].contiguous()
    return q, (k + E8M0_BIAS).to(torch.uint8)


@torch.no_grad()
def quantize_fp4_blocks(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C even) -> (packed int8 [..., R, C/2], scale uint8 e8m0 exponents [..., R, ceil(C/32)]),
    scale = 2^ceil(log2(amax/6)) per 1x32 block, values rounded to nearest-even on the e2m1 grid."""
    wf = w.detach().to(torch.float32)
    c = wf.shape[-1]
    if c % 2:
        raise ValueError(f"FP4 weights need an even number of input columns, got {c}")
    pad = (-c) % block
    wp = torch.nn.functional.pad(wf, (0, pad)) if pad else wf
    blocks = wp.unflatten(-1, (wp.shape[-1] // block, block))
    amax = blocks.abs().amax(dim=-1)  # [..., R, C/32]
    k, s = _pow2_scale(amax, E2M1_MAX, None)
    codes = e2m1_codes(blocks / s.unsqueeze(-1)).flatten(-2)[..., :c]
    return pack_fp4(codes).contiguous(), (k + E8M0_BIAS).to(torch.uint8)


# ---- REF simulations --------------------------------------------------------------------------

def _last_dim_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    xf = x.to(torch.float32)
    d = xf.shape[-1]
    pad = (-d) % block
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.unflatten(-1, (xf.shape[-1] // block, block)), d


@torch.no_grad()
def quantize_act_fp8(x: torch.Tensor, block: int = 128, amax_floor: float = ACT_AMAX_FLOOR
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1 x `block` e4m3 quantization of the last dim with power-of-two scales:
    -> (q float8_e4m3fn [..., D], scale float32 [..., ceil(D/block)])."""
    blocks, d = _last_dim_blocks(x, block)
    _, s = _pow2_scale(blocks.abs().amax(dim=-1), E4M3_MAX, amax_floor)
    q = (blocks / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :d], s


@torch.no_grad()
def fp8_e4m3_simulate(x: torch.Tensor, block: int = 64, amax_floor: float = ACT_AMAX_FLOOR) -> torch.Tensor:
    """REF's FP8 simulation over blocks of the last dim (KV nope dims use block 64):
    s = 2^ceil(log2(max(amax, 1e-4)/448)), x <- e4m3(clamp(x/s, +-448)) * s. Same dtype as x."""
    blocks, d = _last_dim_blocks(x, block)
    _, s = _pow2_scale(blocks.abs().amax(dim=-1), E4M3_MAX, amax_floor)
    s = s.unsqueeze(-1)
    y = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    return y.flatten(-2)[..., :d].to(x.dtype)


def act_quant_fp8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Activation simulation before an FP8/FP4 GEMM: per-token 1x128 e4m3 with power-of-two scales
    (REF `act_quant`, amax floored at 1e-4); returns the dequantized activations in x's dtype."""
    return fp8_e4m3_simulate(x, block)


@torch.no_grad()
def fp4_e2m1_simulate(x: torch.Tensor, block: int = 32, amax_floor: float = FP4_AMAX_FLOOR) -> torch.Tensor:
    """REF's FP4 simulation (indexer q and keys) over blocks of the last dim:
    s = 2^ceil(log2(max(amax, 6*2^-126)/6)), x <- e2m1(clamp(x/s, +-6)) * s. Same dtype as x."""
    blocks, d = _last_dim_blocks(x, block)
    _, s = _pow2_scale(blocks.abs().amax(dim=-1), E2M1_MAX, amax_floor)
    s = s.unsqueeze(-1)
    y = e2m1_round((blocks / s).clamp(-E2M1_MAX, E2M1_MAX)) * s
    return y.flatten(-2)[..., :d].to(x.dtype)


@torch.no_grad()
def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Sylvester Hadamard transform over the last dim (a power of two), scaled by dim^-0.5 (orthonormal,
    no random signs); computed in float32 by the fast butterfly, returned in x's dtype."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {n}")
    y = x.to(torch.float32).reshape(-1, n)
    h = 1
    while h < n:
        # H_2n = [[H, H], [H, -H]]: one butterfly per bit of the index (the factors commute)
        y = y.view(y.shape[0], n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * n ** -0.5).to(x.dtype)


def sylvester_matrix(n: int) -> torch.Tensor:
    """The unscaled n x n Sylvester Hadamard matrix (entries +-1), H_1 = [1], H_2n = [[H, H], [H, -H]]."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h

"""GLM-5.3's absorbed MLA products (kvfold/models/glm5/absorb.py) read kv_b_proj as held: an FP8
weight's codes in place (W_UV) or re-laid out (W_UK^T), never a decoded copy, with the bits of the
float weight of the same values wherever a `Linear` would give them (batch-invariant mode: every
row count; outside it, native.c's reads up to NATIVE_ROWS rows), and the same math as the einsum
over the decoded weight."""
from types import SimpleNamespace

import pytest
import torch

from helpers import TORCH_OPS, ops_for
from kvfold.layers.basic import NATIVE_ROWS, QuantizedWeight
from kvfold.models.glm5.absorb import absorbed_q, absorbed_v, uk_transposed
from kvfold.numerics.rows import invariant_mm
from kvfold.numerics import native

INVARIANT = ops_for(invariant=True)
FAST = ops_for(invariant=False)  # native.c reads the codes up to NATIVE_ROWS rows only


def fp8_kv_b(nh, dn, dv, lat, block, seed=0, scale_dtype=torch.uint8):
    """A kv_b_proj held as FP8 with random codes (subnormal ones among them) and scales."""
    g = torch.Generator().manual_seed(seed)
    w = QuantizedWeight("fp8", (nh * (dn + dv), lat), torch.float32, block, scale_dtype)
    w.q.copy_((torch.randn(w.q.shape, generator=g) * 40).clamp(-440, 440).to(torch.float8_e4m3fn))
    if scale_dtype == torch.uint8:
        w.scale.copy_(torch.randint(118, 130, w.scale.shape, generator=g).to(torch.uint8))  # e8m0 exponents
    else:
        w.scale.copy_(torch.rand(w.scale.shape, generator=g) / 100)
    return w


def mla_of(weight, nh, dn, dv):
    return SimpleNamespace(kv_b_proj=SimpleNamespace(weight=weight), nh=nh, dn=dn, dv=dv)


def fixed_order(x, heads):
    """x [T, H, k] through heads [H, n, k] (float), one fixed-order matmul per head."""
    lib = INVARIANT.row_mm.native
    return torch.stack([invariant_mm(lib, x[:, h], heads[h].contiguous()) for h in range(heads.shape[0])], dim=1)


SHAPES = [  # (heads, dn, dv, lat, block, W_UK^T held as: "read" by native.c, "decoded" per call, None)
    (4, 16, 8, 32, (8, 8), "read"),
    (3, 16, 16, 40, (16, 8), "read"),  # a cropped column block
    (2, 8, 8, 16, (128, 128), "read"),  # one cropped block: each head's W_UK rows inside it
    (4, 16, 8, 32, (12, 8), "decoded"),  # transposed blocks 8 x 12: native.c reads multiples of 8 columns
    (2, 16, 8, 32, (1, 8), "decoded"),  # per-row scales: transposed blocks 8 x 1
    (3, 16, 8, 32, (16, 8), None),  # head 1's W_UK rows 24..39 straddle row blocks: not re-laid out
    (64, 256, 256, 512, (128, 128), "read"),  # GLM-5.3-Flash
]


@pytest.mark.parametrize("nh,dn,dv,lat,block,uk", SHAPES)
def test_absorbed_products_of_fp8_codes_equal_the_float_weights_bit_for_bit(nh, dn, dv, lat, block, uk):
    w = fp8_kv_b(nh, dn, dv, lat, block, scale_dtype=torch.float32 if block == (16, 8) else torch.uint8)
    full = w.dequant()
    heads = full.view(nh, dn + dv, lat)
    quantized, dequant = mla_of(w, nh, dn, dv), mla_of(full, nh, dn, dv)
    g = torch.Generator().manual_seed(1)
    for t in (1, 5, 40):
        q, pooled = torch.randn(t, nh, dn, generator=g), torch.randn(t, nh, lat, generator=g)
        want_q = fixed_order(q, heads[:, :dn].transpose(1, 2))
        want_v = fixed_order(pooled, heads[:, dn:])
        assert torch.equal(absorbed_q(dequant, q, INVARIANT), absorbed_q(quantized, q, INVARIANT))
        assert torch.equal(absorbed_v(dequant, pooled, INVARIANT), absorbed_v(quantized, pooled, INVARIANT))
        assert torch.equal(absorbed_q(quantized, q, INVARIANT), want_q)
        assert torch.equal(absorbed_v(quantized, pooled, INVARIANT), want_v)
        if t <= NATIVE_ROWS:  # read as stored outside batch-invariant mode too: the same bits
            assert torch.equal(absorbed_v(quantized, pooled, FAST), want_v)
            if uk == "read":
                assert torch.equal(absorbed_q(quantized, q, FAST), want_q)
        # the same math as the einsum over the decoded weight, on every path: two fp32 sums of k
        # terms each within k u sum|x w| of the exact one (u = 2^-24)
        for ops in (INVARIANT, FAST, TORCH_OPS):
            for got, spec, x, wh in ((absorbed_q(quantized, q, ops), "thd,hdl->thl", q, heads[:, :dn]),
                                     (absorbed_v(quantized, pooled, ops), "thl,hvl->thv", pooled, heads[:, dn:])):
                bound = 2 * x.shape[-1] * 2.0 ** -24 * torch.einsum(spec, x.abs(), wh.abs())
                assert ((got - torch.einsum(spec, x, wh)).abs() <= bound).all()


@pytest.mark.parametrize("nh,dn,dv,lat,block,uk", SHAPES)
def test_w_uk_transposed_is_the_codes_re_laid_out(nh, dn, dv, lat, block, uk):
    """The held W_UK^T layout: FP8 codes and scales (no decoded values) that decode to exactly the
    transposed W_UK; None where a head's rows straddle scale blocks."""
    w = fp8_kv_b(nh, dn, dv, lat, block, seed=2)
    held = uk_transposed(w, nh, dn)
    if uk is None:
        assert held is None
        return
    assert held.q.dtype == torch.float8_e4m3fn and held.q.shape == (nh, lat, dn)
    assert held.q.nbytes == nh * dn * lat
    want = w.dequant().view(nh, dn + dv, lat)[:, :dn].transpose(1, 2)
    assert torch.equal(held.dequant().view(torch.int32), want.contiguous().view(torch.int32))
    assert (held.native(lib=native.library()) is not None) == (uk == "read")


def test_the_layout_is_cached_on_the_weight_and_dropped_when_it_is_loaded_again():
    nh, dn, dv, lat, block = 4, 16, 8, 32, (8, 8)
    w = fp8_kv_b(nh, dn, dv, lat, block)
    mla, q, pooled = mla_of(w, nh, dn, dv), torch.randn(3, nh, dn), torch.randn(3, nh, lat)
    first = absorbed_q(mla, q, INVARIANT)
    absorbed_v(mla, pooled, INVARIANT)
    held = w.__dict__["_derived"][("uk_t", nh, dn)][1]
    absorbed_q(mla, q, INVARIANT)
    assert w.__dict__["_derived"][("uk_t", nh, dn)][1] is held  # made once
    # nothing decoded is kept: the W_UK^T codes and scales, and descriptors of W_UV's rows in place
    assert held.q.dtype == torch.float8_e4m3fn and held.scale.dtype == torch.uint8
    uv = w.__dict__["_derived"][("uv_rows", nh, dn, dv)][1]
    assert [desc.data - w.q.data_ptr() for desc, _, _ in uv] == [h * (dn + dv) * lat + dn * lat for h in range(nh)]
    other = fp8_kv_b(nh, dn, dv, lat, block, seed=5)
    w.load_(other.q, other.scale, block)  # in place: same storage, new codes
    assert "_derived" not in w.__dict__
    got = absorbed_q(mla, q, INVARIANT)
    assert torch.equal(got, absorbed_q(mla_of(other.dequant(), nh, dn, dv), q, INVARIANT))
    assert not torch.equal(got, first)


def test_bf16_held_kv_b_of_an_fp32_model_reads_as_stored_with_the_fp32_bits():
    """A bf16 kv_b_proj held as stored in an fp32 model (the loader's BF16 residency): W_UK^T is its
    bf16 values re-laid out, and both products give the fp32 parameter's bits."""
    nh, dn, dv, lat = 4, 16, 8, 32
    g = torch.Generator().manual_seed(3)
    w = QuantizedWeight("bf16", (nh * (dn + dv), lat), torch.float32, (1, 1))
    w.q.copy_(torch.randn(w.q.shape, generator=g).bfloat16())
    held = uk_transposed(w, nh, dn)
    assert held.q.dtype == torch.bfloat16 and held.native(lib=native.library()) is not None
    full = w.dequant()
    q, pooled = torch.randn(3, nh, dn, generator=g), torch.randn(3, nh, lat, generator=g)
    for ops in (INVARIANT, FAST):
        held_as, fp32 = mla_of(w, nh, dn, dv), mla_of(full, nh, dn, dv)
        assert torch.equal(absorbed_q(held_as, q, ops), absorbed_q(fp32, q, INVARIANT))
        assert torch.equal(absorbed_v(held_as, pooled, ops), absorbed_v(fp32, pooled, INVARIANT))

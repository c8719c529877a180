"""Every native kernel (kvfold/numerics/native.c) against the torch reference it stands for, from
one table of cases that must cover them all, and the kernels that share one parallel region
keeping each output's bits (split from tests/test_native.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import TORCH_OPS, ops_for

from kvfold.numerics import apply_rope, native, rms_norm
from kvfold.numerics.backend import KernelSet
from kvfold.numerics.hc import hc_collapse, hc_expand, hc_head
from kvfold.numerics.native_abi import SIGNATURES

from test_native import NATIVE, _hc_params, _reference_attend

INVARIANT = ops_for(invariant=True)  # batch-invariant mode on the CPU: native.c's fixed-order kernels

# ---- one table: every native kernel against the torch reference it stands for --------------------
def _case_rms_norm(g):
    x, w = torch.randn(5, 96, generator=g) * 3, torch.randn(96, generator=g)
    return rms_norm(NATIVE, x, w, 1e-6), rms_norm(TORCH_OPS, x, w, 1e-6)


def _case_rope(g):
    from kvfold.numerics import RopeTable
    cos, sin = RopeTable(32, 10000.0).cos_sin(NATIVE, torch.arange(40, 45))
    x = torch.randn(5, 3, 64, generator=g)
    return apply_rope(NATIVE, x, cos, sin), apply_rope(TORCH_OPS, x, cos, sin)


def _case_hc_collapse(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=int(torch.randint(0, 99, (1,), generator=g)))
    got = torch.cat([t.flatten() for t in hc_collapse(NATIVE, streams, fn, base, scale, 20, 1e-6, 1e-6)])
    want = torch.cat([t.flatten() for t in hc_collapse(TORCH_OPS, streams, fn, base, scale, 20, 1e-6, 1e-6)])
    return got, want


def _case_hc_head(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=11)
    args = (streams, fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous(), 1e-6, 1e-6)
    return hc_head(NATIVE, *args), hc_head(TORCH_OPS, *args)


def _case_hc_expand(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=12)
    _, post, comb = hc_collapse(NATIVE, streams, fn, base, scale, 20, 1e-6, 1e-6)
    y = torch.randn(3, 64, generator=g)
    return hc_expand(NATIVE, streams, y, post, comb), hc_expand(TORCH_OPS, streams, y, post, comb)


def _case_pool_windows(g):
    from kvfold.numerics import pool_windows
    kv, sc = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    return pool_windows(NATIVE, kv, sc, 4, True), pool_windows(TORCH_OPS, kv, sc, 4, True)


def _tiny_moe(layer, seed):
    from kvfold.models.deepseek_v4.moe import MoE
    from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
    cfg = tiny_config(n_shared_experts=1)
    moe = MoE(cfg, layer, torch.float32)
    moe.config = cfg
    init_random_(moe, seed=seed)
    return moe, cfg


def _case_moe_rows(g):
    moe, cfg = _tiny_moe(1, 3)
    x, ids = torch.randn(5, cfg.hidden_size, generator=g), torch.tensor([5, 0, 77, 5, 300])
    with torch.inference_mode():
        return moe._native_rows(x, ids, NATIVE), moe(x, ids, TORCH_OPS)


def _case_route(g):
    moe, cfg = _tiny_moe(1, 4)
    x, ids = torch.randn(9, cfg.hidden_size, generator=g), torch.randint(0, 200, (9,), generator=g)
    w, e = moe.gate(x, ids, INVARIANT)
    w_t, e_t = moe.gate(x, ids, TORCH_OPS)
    order = e_t.argsort(dim=1)  # the reference keeps routing order; the kernel ascends
    assert torch.equal(e, e_t.gather(1, order))
    return w, w_t.gather(1, order)


def _case_swiglu(g):
    from kvfold.numerics.rows import swiglu
    gate, up = torch.randn(7, 40, generator=g) * 5, torch.randn(7, 40, generator=g) * 5
    return swiglu(INVARIANT, gate, up, 4.0), swiglu(TORCH_OPS, gate, up, 4.0)


def _case_unary(g):
    from kvfold.numerics.rows import unary
    x = torch.randn(7, 45, generator=g) * 12  # past softplus's linear threshold of 20 too
    names = ("sigmoid", "silu", "softplus", "cos", "sin")
    got = torch.stack([unary(INVARIANT, name, x) for name in names])
    return got, torch.stack([unary(TORCH_OPS, name, x) for name in names])


def _case_l2norm(g):
    from kvfold.numerics.rows import l2norm
    x = torch.randn(5, 3, 37, generator=g)
    return l2norm(INVARIANT, x), l2norm(TORCH_OPS, x)


def test_invariant_elementwise_rows_do_not_move_with_the_call_length():
    """A row's sigmoid / silu / softplus / cos / sin / L2 norm is the same bits whether 1 or 40
    rows share the call, at any offset: native.c computes each element on its own (where a
    vectorised loop's tail, which moves with the call's length, would take other code)."""
    from kvfold.numerics.rows import l2norm, unary
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(3)) * 6
    fns = [lambda a, op=op: unary(INVARIANT, op, a) for op in ("sigmoid", "silu", "softplus", "cos", "sin")]
    fns.append(lambda a: l2norm(INVARIANT, a))
    for fn in fns:
        alone = torch.cat([fn(x[i:i + 1]) for i in range(40)])
        for t in (3, 7, 40):
            assert torch.equal(torch.cat([fn(x[a:a + t]) for a in range(0, 40, t)]), alone)


def test_a_rope_tables_rows_do_not_move_with_the_other_positions_of_the_call():
    """In batch-invariant mode the cos / sin of a position are the same bits whatever other
    positions share the call (a batch's rows are one call), and within an ulp of float64's."""
    from kvfold.numerics import RopeTable
    table = RopeTable(64, 10000.0)
    positions = torch.cat([torch.arange(0, 300), torch.arange(4000, 4017), torch.tensor([65000])])
    cos, sin = table.cos_sin(INVARIANT, positions)
    for lo, hi in ((0, 1), (5, 12), (299, 318), (317, 318)):
        c, s = table.cos_sin(INVARIANT, positions[lo:hi])
        assert torch.equal(c, cos[lo:hi]) and torch.equal(s, sin[lo:hi])
    angle = torch.outer(positions.float(), table.inv_freq).double()  # the fp32 angles, exactly
    eps = torch.finfo(torch.float32).eps
    assert ((cos.double() - angle.cos()).abs() <= eps).all() and ((sin.double() - angle.sin()).abs() <= eps).all()


def _case_matmul(g):
    from kvfold.numerics.rows import invariant_mm
    x, w = torch.randn(13, 70, generator=g), torch.randn(9, 70, generator=g)
    return invariant_mm(native.library(), x, w), x @ w.t()


def _case_matmul_weights(g):
    from kvfold.numerics.quant import dequant_fp4_blocks, quantize_fp4_blocks
    from kvfold.numerics.weights_mm import describe, native_mm
    x, w = torch.randn(3, 94, generator=g), torch.randn(11, 94, generator=g)
    packed, s = quantize_fp4_blocks(w)
    return (native_mm(native.library(), x, *describe(packed, s, (1, 32), packed_fp4=True, lib=native.library())),
            x @ dequant_fp4_blocks(packed, s).t())


def _case_scan_fp8(g):
    """The FP8 code scan (a weight_mm descriptor's): subnormal-block flags and the NaN check,
    against their definition over the codes' values."""
    from kvfold.numerics.weights_mm import scan_fp8_codes
    codes = torch.randint(0, 256, (37, 300), generator=g, dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    nan, flags = scan_fp8_codes(native.library(), q, 128)
    v = q.float()
    sub = (v != 0) & (v.abs() < 2 ** -6) & ~v.isnan()
    want = torch.nn.functional.pad(sub, (0, 3 * 128 - 300)).view(37, 3, 128).any(-1)
    return (torch.cat([flags.flatten().float(), torch.tensor([float(nan)])]),
            torch.cat([want.flatten().float(), torch.tensor([float(v.isnan().any())])]))


def _case_attend_one(g):
    from kvfold.models.deepseek_v4.attention import _native_attend_one
    from kvfold.state.kv_rows import KvRows
    q, local, sinks = torch.randn(1, 4, 64, generator=g) * 0.3, torch.randn(17, 64, generator=g), torch.randn(4)
    pool = KvRows(40, 64, torch.float32, "cpu")
    pool.data.copy_(torch.randn(40, 64, generator=g))
    got = _native_attend_one(NATIVE, q, [local[:5], local[5:16], local[16:]], pool, None, 9, sinks,
                             "heavily_compressed_attention")
    return got[0], _reference_attend(q[0], local, pool.data[:9], sinks)


def _case_index_topk_one(g):
    from kvfold.models.deepseek_v4.indexer import _native_topk_one
    from kvfold.numerics import topk_lower_index
    from kvfold.state.kv_rows import KvRows
    q, w = torch.randn(1, 4, 32, generator=g), torch.rand(1, 4, generator=g)
    pool = KvRows(50, 32, torch.float32, "cpu")
    pool.data.copy_(torch.randn(50, 32, generator=g))
    scores = (w[0][None, :] * torch.relu(pool.data @ q[0].t())).sum(-1)
    return _native_topk_one(NATIVE, q, w, 4, 32, pool, 50, 16).float(), topk_lower_index(scores[None], 16).float()


def _tiny_attention(seed):
    """The tiny config's first CSA attention layer (compressor and indexer) with random weights,
    and the cos / sin of its rope table at 7 positions."""
    from kvfold.models.deepseek_v4.attention import Attention
    from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
    from kvfold.numerics import RopeTable
    cfg = tiny_config()
    attn = Attention(cfg, 1, torch.float32)
    attn.config = cfg
    init_random_(attn, seed=seed)
    positions = torch.tensor([0, 3, 4, 31, 32, 97, 1000])
    cos, sin = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn).cos_sin(NATIVE, positions)
    return attn, cfg, positions, cos, sin


def _case_attn_project(g):
    from helpers import flat_rows
    from kvfold.models.deepseek_v4.native_attention import project_rows
    attn, cfg, positions, cos, sin = _tiny_attention(5)
    x = torch.randn(7, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        got = project_rows(NATIVE, attn, x, positions, cos, sin)
        want = attn.project(x, positions, None, cos, sin, TORCH_OPS)
    assert set(got) == set(want)
    return flat_rows(got), flat_rows(want)


def _case_attn_output(g):
    from kvfold.models.deepseek_v4.native_attention import output_rows
    attn, cfg, _, cos, sin = _tiny_attention(6)
    o = torch.randn(7, attn.n_heads, attn.head_dim, generator=g)

    def per_op(o, ops):
        rotated = apply_rope(ops, o, cos, sin, inverse=True)
        return attn.o_b_proj(attn.o_a_proj(rotated.reshape(7, attn.o_groups, -1), ops), ops)
    with torch.inference_mode():
        return output_rows(NATIVE, attn, o, cos, sin), per_op(o, TORCH_OPS)


def _case_attn_sequence_one(g):
    """A CSA layer's decode row at a position that closes a compressor window: the one native call
    against the per-op torch path on a copy of the same state."""
    import kvfold
    from kvfold.layers.rows import Segment
    from kvfold.models.deepseek_v4.native_attention import sequence_row
    model = kvfold.load_model("tiny-random")
    model.set_batch_invariant(False)
    ops = model.backend()
    ids = torch.randint(0, model.config.vocab_size, (63,), generator=g).tolist()
    with torch.inference_mode():
        st = model.new_state(capacity=128)
        model.forward(ids, st)  # position 63 closes window 15 (ratio 4)
        twin = model.new_state(capacity=128)
        twin.restore(st.snapshot())
        attn = model.model.layers[1].self_attn
        x = torch.randn(1, model.config.hidden_size, generator=g)
        positions = torch.tensor([63])
        cos, sin = model.rope_compress.cos_sin(ops, positions)
        rows = attn.project(x, positions, 63, cos, sin, ops)
        got = sequence_row(ops, attn, st.layers[1], 63, rows, lambda a: a, model.rope_compress)
        want = attn._one_sequence(Segment(0, 1, 63, twin), lambda a: a, rows, model.rope_compress, TORCH_OPS)
    return got, want


def _prefilled_pairs(model, g, lengths):
    """Per prompt length: a state after that prompt and a restored copy of it (the torch path's)."""
    pairs = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        st = model.new_state(capacity=128)
        model.forward(ids, st)
        twin = model.new_state(capacity=128)
        twin.restore(st.snapshot())
        pairs.append((st, twin))
    return pairs


# three sequences' decode rows: position 63 closes a CSA window (ratio 4) and an HCA one, 41 and
# 10 close none
DECODE_ROW_PROMPTS = (63, 41, 10)


def _case_block_decode_rows(g):
    """A CSA block's decode rows of three sequences, one of them closing a compressor window: the
    one native call (native_block.h) against Block.forward in torch, the native kernels off, on
    copies of the states."""
    import kvfold
    from kvfold.layers.rows import RowBatch, Segment
    from kvfold.models.deepseek_v4.config import SLIDING
    from kvfold.models.deepseek_v4.native_block import block_row
    model = kvfold.load_model("tiny-random")
    model.set_batch_invariant(False)
    tokens = torch.randint(0, model.config.vocab_size, (len(DECODE_ROW_PROMPTS),), generator=g)

    def batch(states, ops):
        positions = torch.tensor(DECODE_ROW_PROMPTS)
        b = RowBatch(tokens, positions, [Segment(r, r + 1, p, st) for r, (p, st) in
                                         enumerate(zip(DECODE_ROW_PROMPTS, states))], ops)
        b.rope[SLIDING] = (model.rope_main, *model.rope_main.cos_sin(ops, b.positions))
        b.rope["compressed"] = (model.rope_compress, *model.rope_compress.cos_sin(ops, b.positions))
        return b
    with torch.inference_mode():
        states, twins = zip(*_prefilled_pairs(model, g, DECODE_ROW_PROMPTS))
        block = model.model.layers[1]
        streams = torch.randn(len(states), model.config.hc_mult, model.config.hidden_size, generator=g)
        got = block_row(block, streams, batch(states, model.backend()))
        want = block.forward(streams, batch(twins, TORCH_OPS))
    return got, want


def _case_model_decode_rows(g):
    """The whole model's decode rows of three sequences, one of them closing compressor windows
    (batch-invariant, so the fp32 lm_head is native too): the one native call against the forward
    in torch (native kernels and batch invariance off) on copies of the states."""
    import kvfold
    from kvfold.models.deepseek_v4 import native_block
    model = kvfold.load_model("tiny-random")
    model.set_batch_invariant(True)
    tokens = torch.randint(0, model.config.vocab_size, (len(DECODE_ROW_PROMPTS),), generator=g).tolist()
    used = []
    fused = native_block.model_row
    with torch.inference_mode():
        states, twins = zip(*_prefilled_pairs(model, g, DECODE_ROW_PROMPTS))
        from kvfold.models.deepseek_v4 import model as model_module
        model_module.model_row = lambda *a: used.append(fused(*a)) or used[-1]
        try:
            got = torch.cat(model.forward_batch([([t], st) for t, st in zip(tokens, states)]))
        finally:
            model_module.model_row = fused
        model.set_batch_invariant(False)  # the torch path's mode (it needs no native kernels)
        model.set_kernels(KernelSet(native=False))
        want = torch.cat([model.forward([t], twin) for t, twin in zip(tokens, twins)])
    assert used and used[0] is not None  # the rows took the one native call
    return got, want


NATIVE_CASES = {
    "kv_rms_norm": _case_rms_norm, "kv_rope": _case_rope, "kv_hc_collapse": _case_hc_collapse,
    "kv_hc_head": _case_hc_head, "kv_hc_expand": _case_hc_expand, "kv_pool_windows": _case_pool_windows,
    "kv_moe_rows": _case_moe_rows, "kv_route": _case_route, "kv_swiglu": _case_swiglu, "kv_matmul": _case_matmul,
    "kv_unary": _case_unary, "kv_l2norm": _case_l2norm,
    "kv_matmul_weights": _case_matmul_weights, "kv_scan_fp8": _case_scan_fp8,
    "kv_attend_one": _case_attend_one, "kv_index_topk_one": _case_index_topk_one,
    "kv_attn_project": _case_attn_project, "kv_attn_output": _case_attn_output,
    "kv_attn_sequence_one": _case_attn_sequence_one, "kv_block_decode_rows": _case_block_decode_rows,
    "kv_model_decode_rows": _case_model_decode_rows,
}


def test_the_table_covers_every_native_kernel():
    assert set(NATIVE_CASES) == set(SIGNATURES) - {"kv_abi_layout"}  # the layout: test_native_abi.py


@pytest.mark.parametrize("name", sorted(NATIVE_CASES))
def test_every_native_kernel_matches_its_torch_reference(name):
    """fp32 against fp32 in another summation order: within a few hundred ulps of the output's
    scale (a length-K dot product's rounding grows like sqrt(K) ulps; K <= 512 here)."""
    got, want = NATIVE_CASES[name](torch.Generator().manual_seed(len(name)))
    assert got.shape == want.shape
    scale = want.abs().max().item() or 1.0
    assert (got - want).abs().max().item() <= 256 * torch.finfo(torch.float32).eps * scale, name


def test_matrices_sharing_one_parallel_region_keep_each_output_s_bits():
    """kv_attn_project, kv_attn_output and a MoE row run the matrices that read the same finished
    input in one OpenMP region (weights_many). With matrices large enough to split across two
    threads, every output equals the one-thread call's (each matrix alone, serially) bit for bit,
    and the torch path's within fp32 rounding (256 ulps of the output's scale, as above)."""
    from kvfold.models.deepseek_v4.attention import Attention
    from kvfold.models.deepseek_v4.moe import MoE
    from kvfold.models.deepseek_v4.native_attention import output_rows, project_rows
    from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
    from kvfold.numerics import RopeTable
    from helpers import flat_rows
    cfg = tiny_config(hidden_size=1024, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, q_lora_rank=512,
                      o_groups=4, o_lora_rank=256, index_n_heads=8, index_head_dim=64, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=384, n_shared_experts=1)
    attn, moe = Attention(cfg, 1, torch.float32), MoE(cfg, 1, torch.float32)
    attn.config = moe.config = cfg
    init_random_(attn, seed=21)
    init_random_(moe, seed=22)
    g = torch.Generator().manual_seed(23)
    positions = torch.tensor([97])
    cos, sin = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn).cos_sin(NATIVE, positions)
    x = torch.randn(1, cfg.hidden_size, generator=g)
    o = torch.randn(1, attn.n_heads, attn.head_dim, generator=g)
    ids = torch.tensor([41])

    def run():
        with torch.inference_mode():
            return torch.cat([flat_rows(project_rows(NATIVE, attn, x, positions, cos, sin)),
                              output_rows(NATIVE, attn, o, cos, sin).flatten(),
                              moe._native_rows(x, ids, NATIVE).flatten()])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(2)
        shared = run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(shared, alone)
    with torch.inference_mode():
        rotated = apply_rope(TORCH_OPS, o, cos, sin, inverse=True).reshape(1, attn.o_groups, -1)
        want = torch.cat([flat_rows(attn.project(x, positions, int(positions[0]), cos, sin, TORCH_OPS)),
                          attn.o_b_proj(attn.o_a_proj(rotated, TORCH_OPS), TORCH_OPS).flatten(),
                          moe(x, ids, TORCH_OPS).flatten()])
    assert (shared - want).abs().max().item() <= 256 * torch.finfo(torch.float32).eps * want.abs().max().item()

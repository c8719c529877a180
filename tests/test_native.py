"""The native fp32 CPU kernels (kvfold/numerics/native.c) against the torch formulas they replace,
their row independence, and the fallback when they cannot be built."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvfold.numerics import apply_rope, native, rms_norm, unweighted_rms_norm
from kvfold.numerics.hc import hc_collapse, hc_expand, hc_head, hc_head_weights, hc_weights, weighted_streams
from kvfold.numerics.native_abi import SIGNATURES, IndexQuery


EPS = torch.finfo(torch.float32).eps


def torch_path(fn, *args):
    with native.use_native(False):
        return fn(*args)


def test_native_kernels_build_on_a_machine_with_a_c_compiler():
    assert native.available(), "cc is on this machine: the kernels must build and load"


@pytest.mark.parametrize("shape", [(1, 256), (5, 128), (3, 4, 64), (2, 7)])
def test_rms_norm_native_matches_torch(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    # each side within (d/2 + 5) u of every output: the d squares summed to gamma_d (d u) relative,
    # halved by the reciprocal square root, then the mean, + eps, 1/sqrt (one ulp) and the two
    # products, one rounding each; two sides, so (d/2 + 5) eps apart, relative to each output
    d = shape[-1]
    for got, want in ((rms_norm(x, w, 1e-6), torch_path(rms_norm, x, w, 1e-6)),
                      (unweighted_rms_norm(x, 1e-6), torch_path(unweighted_rms_norm, x, 1e-6))):
        assert ((got - want).abs() <= (d / 2 + 5) * EPS * want.abs()).all()


def test_rope_native_matches_torch_and_inverts():
    from kvfold.numerics import RopeTable
    g = torch.Generator().manual_seed(1)
    table = RopeTable(32, 10000.0)
    cos, sin = table.cos_sin(torch.arange(100, 107))
    for x in (torch.randn(7, 4, 128, generator=g), torch.randn(7, 64, generator=g)):
        # an output a c -+ b s rounds two products and a sum: within 2u (|a| + |b|) <= 2 eps m,
        # m = max|x|, on each side; |y_a| + |y_b| <= sqrt(2) |(a, b)| <= 2m, so the inverse too. Back
        # to x adds the forward rounding (rotated: sqrt(2) 2 eps m), the inverse's (2 eps m) and the
        # table's cos^2 + sin^2 - 1 (each within an ulp: 2 eps m): 7 eps m. A wrong pair, angle or
        # sign moves an output by O(m).
        m = x.abs().max().item()
        y = apply_rope(x, cos, sin)
        assert (y - torch_path(apply_rope, x, cos, sin)).abs().max().item() <= 4 * EPS * m
        assert torch.equal(y[..., :-32], x[..., :-32])  # the nope dims are copied, not touched
        back = apply_rope(y, cos, sin, inverse=True)
        assert (back - torch_path(apply_rope, y, cos, sin, True)).abs().max().item() <= 4 * EPS * m
        assert (back - x).abs().max().item() <= 7 * EPS * m


def _hc_params(hc: int, d: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    return (torch.randn(3, hc, d, generator=g), torch.randn(n, hc * d, generator=g) * 0.05,
            torch.randn(n, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5)


@pytest.mark.parametrize("hc", [2, 4])
def test_hc_collapse_native_matches_the_weights_then_the_weighted_sum(hc):
    streams, fn, base, scale = _hc_params(hc, 64)
    x, post, comb = hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)
    pre, post_t, comb_t = torch_path(hc_weights, streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert torch.allclose(post, post_t, atol=1e-5)
    assert torch.allclose(comb, comb_t, atol=1e-5)
    assert torch.allclose(x, weighted_streams(pre, streams), atol=1e-5)
    # comb stays doubly stochastic (up to the eps in each normalisation)
    assert torch.allclose(comb.sum(-1), torch.ones(3, hc), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(3, hc), atol=1e-3)


def test_hc_head_and_expand_native_match_torch():
    hc, d = 4, 64
    streams, fn, base, scale = _hc_params(hc, d, seed=3)
    fn_h, base_h, scale_h = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
    got = hc_head(streams, fn_h, base_h, scale_h, 1e-6, 1e-6)
    pre = torch_path(hc_head_weights, streams, fn_h, base_h, scale_h, 1e-6, 1e-6)
    assert torch.allclose(got, weighted_streams(pre, streams), atol=1e-5)
    y = torch.randn(3, d)
    _, post, comb = hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert torch.allclose(hc_expand(streams, y, post, comb), torch_path(hc_expand, streams, y, post, comb),
                          atol=1e-5)


def test_native_rows_are_bit_identical_alone_or_in_any_batch():
    """Each kernel treats a row alone: its bits never depend on the other rows of the call."""
    hc, d = 4, 64
    g = torch.Generator().manual_seed(4)
    streams = torch.randn(37, hc, d, generator=g)
    _, fn, base, scale = _hc_params(hc, d)
    w = torch.randn(d, generator=g)
    x_all, post_all, comb_all = hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)
    norm_all = rms_norm(streams[:, 0].contiguous(), w, 1e-6)
    for i in (0, 5, 36):
        x1, post1, comb1 = hc_collapse(streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6)
        assert torch.equal(x1[0], x_all[i]) and torch.equal(post1[0], post_all[i])
        assert torch.equal(comb1[0], comb_all[i])
        assert torch.equal(rms_norm(streams[i:i + 1, 0].contiguous(), w, 1e-6)[0], norm_all[i])


def test_non_fp32_or_strided_inputs_take_the_torch_path():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=g)
    w = torch.randn(128, generator=g)
    strided = x[:, ::2]
    assert torch.allclose(rms_norm(strided, w[:64], 1e-6), torch_path(rms_norm, strided, w[:64], 1e-6))
    xb = x.bfloat16()
    assert torch.equal(rms_norm(xb, w, 1e-6), torch_path(rms_norm, xb, w, 1e-6))


def _fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_kvfold_native_0_turns_the_kernels_off():
    r = _fresh_python("from kvfold.numerics import native; print(native.available())", KVFOLD_NATIVE="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_a_failed_build_warns_once_and_the_model_still_runs(tmp_path):
    code = ("import warnings, torch\n"
            "warnings.simplefilter('always')\n"
            "from kvfold.numerics import native, rms_norm\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    y = rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
            "    y = rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
            "print(native.available(), len(caught), 'native CPU kernels unavailable' in str(caught[0].message),"
            " bool(torch.allclose(y, torch.ones(2, 8), atol=1e-5)))\n")
    r = _fresh_python(code, CC="/bin/false", KVFOLD_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "1", "True", "True"]


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_one_row_moe_native_matches_the_torch_experts(scoring):
    from kvfold.models.deepseek_v4.moe import MoE
    from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
    cfg = tiny_config(scoring_func=scoring, n_shared_experts=1)
    g = torch.Generator().manual_seed(6)
    for layer in (0, 1):  # hash routing, then biased top-k
        moe = MoE(cfg, layer, torch.float32)
        moe.config = cfg
        init_random_(moe, seed=layer)
        with torch.inference_mode():
            for token in (3, 200):
                x = torch.randn(1, cfg.hidden_size, generator=g)
                ids = torch.tensor([token])
                got = moe(x, ids)
                want = torch_path(moe, x, ids)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (layer, token)
                # and the native path really ran: the torch path is a different computation
                assert moe._native_rows(x, ids) is not None


def _reference_attend(q, keys_w, keys_c, sinks):
    """softmax over [window logits | compressed logits | sink] per head; K = V."""
    logits = torch.cat([q @ keys_w.t(), q @ keys_c.t(), sinks[:, None]], dim=-1)
    p = torch.softmax(logits, dim=-1)
    return p[:, :-1] @ torch.cat([keys_w, keys_c])


def _attend_bound(q, keys_w, keys_c):
    """How far the native kernel and `_reference_attend` may be apart: each within
    2 (d eps max|q| @ |k|^T + (M + 4) eps) max|k| of exact (tests/test_triton_ops.py's bound: a
    logit's d-term dot moves p by as much relatively, the softmax and the sum over M keys add
    (M + 4) eps; |out| <= max|k|, K = V), so twice that apart."""
    keys = torch.cat([keys_w, keys_c])
    dots = q.shape[-1] * EPS * (q.abs() @ keys.abs().t()).max().item()
    return 4 * (dots + (keys.shape[0] + 4) * EPS) * keys.abs().max().item()


def test_decode_attention_native_matches_the_softmax_with_sink():
    from kvfold.models.deepseek_v4.attention import _native_attend_one
    from kvfold.state.kv_rows import KvRows
    g = torch.Generator().manual_seed(7)
    h, d = 4, 64
    q = torch.randn(1, h, d, generator=g) * 0.3
    local = torch.randn(17, d, generator=g)
    sinks = torch.randn(h, generator=g)
    pool = KvRows(40, d, torch.float32, "cpu")
    pool.data.copy_(torch.randn(40, d, generator=g))
    # HCA: the first n entries
    got = _native_attend_one(q, [local], pool, None, 9, sinks, "heavily_compressed_attention")
    want = _reference_attend(q[0], local, pool.data[:9], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, pool.data[:9])
    # CSA: picked entries, -1 = none
    sel = torch.tensor([[3, 8, 21, -1, -1]])
    got = _native_attend_one(q, [local], pool, sel, 5, sinks, "compressed_sparse_attention")
    want = _reference_attend(q[0], local, pool.data[[3, 8, 21]], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, pool.data[[3, 8, 21]])
    # the window alone
    got = _native_attend_one(q, [local], None, None, 0, sinks, "sliding_attention")
    want = _reference_attend(q[0], local, local[:0], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, local[:0])
    # the window in three runs (a wrapped ring and the new row) reads as the one buffer, bit for bit
    runs = [local[:6].clone(), local[6:16].clone(), local[16:].clone()]
    got = _native_attend_one(q, runs, pool, sel, 5, sinks, "compressed_sparse_attention")
    assert torch.equal(got, _native_attend_one(q, [local], pool, sel, 5, sinks, "compressed_sparse_attention"))


def test_indexer_topk_native_keeps_the_tie_rule():
    """Higher score first, ties to the lower entry index, returned in ascending order."""
    from kvfold.numerics import topk_lower_index
    g = torch.Generator().manual_seed(8)
    h, d, n = 4, 32, 300
    q = torch.randn(h, d, generator=g)
    w = torch.rand(h, generator=g)
    keys = torch.randn(n, d, generator=g)
    keys[7] = 5 * q.mean(0)
    keys[100:140] = keys[7]  # 41 entries share the top score exactly: ties straddle the k-th place
    lib = native.library()
    scratch = torch.empty(n)
    for k in (1, 16, 64, 300):
        out = torch.empty(1, k, dtype=torch.long)
        lib.kv_index_topk_one(IndexQuery(q.data_ptr(), w.data_ptr(), h, d), keys.data_ptr(), None, n, k,
                              out.data_ptr(), scratch.data_ptr())
        scores = (w[None, :] * torch.relu(keys @ q.t())).sum(-1)
        # the same set as the torch rule on these scores (a tie at the k-th place included)
        want = topk_lower_index(scores[None], k)
        assert torch.equal(out, want), k
        if k == 16:
            assert out[0].tolist() == [7, *range(100, 115)]


@pytest.mark.parametrize("overlap", [True, False])
def test_compressor_pooling_native_matches_torch(overlap):
    from kvfold.numerics import pool_windows
    g = torch.Generator().manual_seed(9)
    r, c, n_w = 4, 16, 3
    m = 2 if overlap else 1
    rows = (n_w + 1) * r if overlap else n_w * r
    kv = torch.randn(rows, m * c, generator=g)
    sc = torch.randn(rows, m * c, generator=g) * 3
    if overlap:  # window 0's missing predecessor: kv 0, score -inf (as the compressor pads it)
        kv[:r] = 0
        sc[:r] = float("-inf")
    got = pool_windows(kv, sc, r, overlap)
    assert got.shape == (n_w, c)
    # each side within (2 n_slots + 4) eps max|kv| of exact (tests/test_triton_ops.py's pooling bound)
    n_slots = 2 * r if overlap else r
    bound = 2 * (2 * n_slots + 4) * EPS * kv.abs().max()
    assert (got - torch_path(pool_windows, kv, sc, r, overlap)).abs().max() <= bound
    # rows alone: each window's entry does not depend on the other windows of the call
    w = 1
    span = slice(w * r, (w + 2) * r) if overlap else slice(w * r, (w + 1) * r)
    assert torch.equal(pool_windows(kv[span].contiguous(), sc[span].contiguous(), r, overlap)[0], got[w])


def test_invariant_collapse_is_native_per_row_at_any_thread_count():
    """In batch-invariant mode every row takes the native collapse, whatever the row count and the
    number of torch threads (a path chosen by size would let a row's bits depend on its batch)."""
    from kvfold.numerics.rows import invariant_rows
    g = torch.Generator().manual_seed(10)
    streams = torch.randn(64, 4, 512, generator=g)
    _, fn, base, scale = _hc_params(4, 512, seed=10)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with invariant_rows():
                whole = hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)
                rows = [hc_collapse(streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6) for i in range(64)]
            for part, got in enumerate(whole):
                assert torch.equal(got, torch.cat([r[part] for r in rows]))
    finally:
        torch.set_num_threads(before)


_MM_PROBE = ("import hashlib, torch\n"
             "from kvfold.numerics import native\n"
             "from kvfold.numerics.rows import invariant_mm\n"
             "g = torch.Generator().manual_seed(0)\n"
             "x, w = torch.randn(9, 203, generator=g), torch.randn(7, 203, generator=g)\n"
             "print(native.available(), hashlib.sha256(invariant_mm(x, w).numpy().tobytes()).hexdigest())\n")


def test_a_compiler_without_march_native_still_builds_the_kernels_with_the_same_bits(tmp_path):
    """Without -march=native the fixed-order dot runs lane by lane with fmaf instead of AVX2
    fused multiply-adds: the same IEEE operations in the same order, so the same bits."""
    fake = tmp_path / "cc-no-march"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-march=native" ] && exit 1; done\nexec cc "$@"\n')
    fake.chmod(0o755)
    r = _fresh_python(_MM_PROBE, CC=str(fake), KVFOLD_CACHE_DIR=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    here = _fresh_python(_MM_PROBE)
    assert here.returncode == 0, here.stderr
    assert r.stdout.split()[0] == "True"
    assert r.stdout == here.stdout
    assert len(list((tmp_path / "cache").glob("native-*.so"))) == 1


# ---- one table: every native kernel against the torch reference it stands for --------------------
def _case_rms_norm(g):
    x, w = torch.randn(5, 96, generator=g) * 3, torch.randn(96, generator=g)
    return rms_norm(x, w, 1e-6), torch_path(rms_norm, x, w, 1e-6)


def _case_rope(g):
    from kvfold.numerics import RopeTable
    cos, sin = RopeTable(32, 10000.0).cos_sin(torch.arange(40, 45))
    x = torch.randn(5, 3, 64, generator=g)
    return apply_rope(x, cos, sin), torch_path(apply_rope, x, cos, sin)


def _case_hc_collapse(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=int(torch.randint(0, 99, (1,), generator=g)))
    got = torch.cat([t.flatten() for t in hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)])
    want = torch.cat([t.flatten() for t in torch_path(hc_collapse, streams, fn, base, scale, 20, 1e-6, 1e-6)])
    return got, want


def _case_hc_head(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=11)
    args = (streams, fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous(), 1e-6, 1e-6)
    return hc_head(*args), torch_path(hc_head, *args)


def _case_hc_expand(g):
    streams, fn, base, scale = _hc_params(4, 64, seed=12)
    _, post, comb = hc_collapse(streams, fn, base, scale, 20, 1e-6, 1e-6)
    y = torch.randn(3, 64, generator=g)
    return hc_expand(streams, y, post, comb), torch_path(hc_expand, streams, y, post, comb)


def _case_pool_windows(g):
    from kvfold.numerics import pool_windows
    kv, sc = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    return pool_windows(kv, sc, 4, True), torch_path(pool_windows, kv, sc, 4, True)


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
        return moe._native_rows(x, ids), torch_path(moe, x, ids)


def _case_route(g):
    from kvfold.numerics.rows import invariant_rows
    moe, cfg = _tiny_moe(1, 4)
    x, ids = torch.randn(9, cfg.hidden_size, generator=g), torch.randint(0, 200, (9,), generator=g)
    with invariant_rows():
        w, e = moe.gate(x, ids)
    w_t, e_t = moe.gate(x, ids)
    order = e_t.argsort(dim=1)  # the reference keeps routing order; the kernel ascends
    assert torch.equal(e, e_t.gather(1, order))
    return w, w_t.gather(1, order)


def _case_swiglu(g):
    from kvfold.numerics.rows import invariant_rows, swiglu
    gate, up = torch.randn(7, 40, generator=g) * 5, torch.randn(7, 40, generator=g) * 5
    with invariant_rows():
        got = swiglu(gate, up, 4.0)
    return got, swiglu(gate, up, 4.0)


def _case_unary(g):
    from kvfold.numerics.rows import invariant_rows, unary
    x = torch.randn(7, 45, generator=g) * 12  # past softplus's linear threshold of 20 too
    ops = ("sigmoid", "silu", "softplus", "cos", "sin")
    with invariant_rows():
        got = torch.stack([unary(op, x) for op in ops])
    return got, torch.stack([unary(op, x) for op in ops])


def _case_l2norm(g):
    from kvfold.numerics.rows import invariant_rows, l2norm
    x = torch.randn(5, 3, 37, generator=g)
    with invariant_rows():
        got = l2norm(x)
    return got, l2norm(x)


def test_invariant_elementwise_rows_do_not_move_with_the_call_length():
    """A row's sigmoid / silu / softplus / cos / sin / L2 norm is the same bits whether 1 or 40
    rows share the call, at any offset: native.c computes each element on its own (where a
    vectorised loop's tail, which moves with the call's length, would take other code)."""
    from kvfold.numerics.rows import invariant_rows, l2norm, unary
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(3)) * 6
    fns = [lambda a, op=op: unary(op, a) for op in ("sigmoid", "silu", "softplus", "cos", "sin")] + [l2norm]
    with invariant_rows():
        for fn in fns:
            alone = torch.cat([fn(x[i:i + 1]) for i in range(40)])
            for t in (3, 7, 40):
                assert torch.equal(torch.cat([fn(x[a:a + t]) for a in range(0, 40, t)]), alone)


def test_a_rope_tables_rows_do_not_move_with_the_other_positions_of_the_call():
    """In batch-invariant mode the cos / sin of a position are the same bits whatever other
    positions share the call (a batch's rows are one call), and within an ulp of float64's."""
    from kvfold.numerics import RopeTable
    from kvfold.numerics.rows import invariant_rows
    table = RopeTable(64, 10000.0)
    positions = torch.cat([torch.arange(0, 300), torch.arange(4000, 4017), torch.tensor([65000])])
    with invariant_rows():
        cos, sin = table.cos_sin(positions)
        for lo, hi in ((0, 1), (5, 12), (299, 318), (317, 318)):
            c, s = table.cos_sin(positions[lo:hi])
            assert torch.equal(c, cos[lo:hi]) and torch.equal(s, sin[lo:hi])
    angle = torch.outer(positions.float(), table.inv_freq).double()  # the fp32 angles, exactly
    eps = torch.finfo(torch.float32).eps
    assert ((cos.double() - angle.cos()).abs() <= eps).all() and ((sin.double() - angle.sin()).abs() <= eps).all()


def _case_matmul(g):
    from kvfold.numerics.rows import invariant_mm
    x, w = torch.randn(13, 70, generator=g), torch.randn(9, 70, generator=g)
    return invariant_mm(x, w), x @ w.t()


def _case_matmul_weights(g):
    from kvfold.numerics.quant import dequant_fp4_blocks, quantize_fp4_blocks
    from kvfold.numerics.weights_mm import describe, native_mm
    x, w = torch.randn(3, 94, generator=g), torch.randn(11, 94, generator=g)
    packed, s = quantize_fp4_blocks(w)
    return native_mm(x, *describe(packed, s, (1, 32), packed_fp4=True)), x @ dequant_fp4_blocks(packed, s).t()


def _case_attend_one(g):
    from kvfold.models.deepseek_v4.attention import _native_attend_one
    from kvfold.state.kv_rows import KvRows
    q, local, sinks = torch.randn(1, 4, 64, generator=g) * 0.3, torch.randn(17, 64, generator=g), torch.randn(4)
    pool = KvRows(40, 64, torch.float32, "cpu")
    pool.data.copy_(torch.randn(40, 64, generator=g))
    got = _native_attend_one(q, [local[:5], local[5:16], local[16:]], pool, None, 9, sinks,
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
    return _native_topk_one(q, w, 4, 32, pool, 50, 16).float(), topk_lower_index(scores[None], 16).float()


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
    cos, sin = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn).cos_sin(positions)
    return attn, cfg, positions, cos, sin


def _case_attn_project(g):
    from helpers import flat_rows
    from kvfold.models.deepseek_v4.native_attention import project_rows
    attn, cfg, positions, cos, sin = _tiny_attention(5)
    x = torch.randn(7, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        got, want = project_rows(attn, x, positions, cos, sin), torch_path(attn.project, x, positions, None, cos, sin)
    assert set(got) == set(want)
    return flat_rows(got), flat_rows(want)


def _case_attn_output(g):
    from kvfold.models.deepseek_v4.native_attention import output_rows
    attn, cfg, _, cos, sin = _tiny_attention(6)
    o = torch.randn(7, attn.n_heads, attn.head_dim, generator=g)

    def per_op(o):
        rotated = apply_rope(o, cos, sin, inverse=True)
        return attn.o_b_proj(attn.o_a_proj(rotated.reshape(7, attn.o_groups, -1)))
    with torch.inference_mode():
        return output_rows(attn, o, cos, sin), torch_path(per_op, o)


def _case_attn_sequence_one(g):
    """A CSA layer's decode row at a position that closes a compressor window: the one native call
    against the per-op torch path on a copy of the same state."""
    import kvfold
    from kvfold.layers.rows import Segment
    from kvfold.models.deepseek_v4.native_attention import sequence_row
    model = kvfold.load_model("tiny-random")
    model.set_batch_invariant(False)
    ids = torch.randint(0, model.config.vocab_size, (63,), generator=g).tolist()
    with torch.inference_mode():
        st = model.new_state(capacity=128)
        model.forward(ids, st)  # position 63 closes window 15 (ratio 4)
        twin = model.new_state(capacity=128)
        twin.restore(st.snapshot())
        attn = model.model.layers[1].self_attn
        x = torch.randn(1, model.config.hidden_size, generator=g)
        positions = torch.tensor([63])
        cos, sin = model.rope_compress.cos_sin(positions)
        rows = attn.project(x, positions, 63, cos, sin)
        got = sequence_row(attn, st.layers[1], 63, rows, lambda a: a, model.rope_compress)
        want = torch_path(attn._one_sequence, Segment(0, 1, 63, twin), lambda a: a, rows, model.rope_compress)
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

    def batch(states):
        positions = torch.tensor(DECODE_ROW_PROMPTS)
        b = RowBatch(tokens, positions, [Segment(r, r + 1, p, st) for r, (p, st) in
                                         enumerate(zip(DECODE_ROW_PROMPTS, states))])
        b.rope[SLIDING] = (model.rope_main, *model.rope_main.cos_sin(b.positions))
        b.rope["compressed"] = (model.rope_compress, *model.rope_compress.cos_sin(b.positions))
        return b
    with torch.inference_mode():
        states, twins = zip(*_prefilled_pairs(model, g, DECODE_ROW_PROMPTS))
        block = model.model.layers[1]
        streams = torch.randn(len(states), model.config.hc_mult, model.config.hidden_size, generator=g)
        got = block_row(block, streams, batch(states))
        want = torch_path(block.forward, streams, batch(twins))
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
        want = torch.cat([torch_path(model.forward, [t], twin) for t, twin in zip(tokens, twins)])
    assert used and used[0] is not None  # the rows took the one native call
    return got, want


NATIVE_CASES = {
    "kv_rms_norm": _case_rms_norm, "kv_rope": _case_rope, "kv_hc_collapse": _case_hc_collapse,
    "kv_hc_head": _case_hc_head, "kv_hc_expand": _case_hc_expand, "kv_pool_windows": _case_pool_windows,
    "kv_moe_rows": _case_moe_rows, "kv_route": _case_route, "kv_swiglu": _case_swiglu, "kv_matmul": _case_matmul,
    "kv_unary": _case_unary, "kv_l2norm": _case_l2norm,
    "kv_matmul_weights": _case_matmul_weights,
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
    cos, sin = RopeTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn).cos_sin(positions)
    x = torch.randn(1, cfg.hidden_size, generator=g)
    o = torch.randn(1, attn.n_heads, attn.head_dim, generator=g)
    ids = torch.tensor([41])

    def run():
        with torch.inference_mode():
            return torch.cat([flat_rows(project_rows(attn, x, positions, cos, sin)),
                              output_rows(attn, o, cos, sin).flatten(), moe._native_rows(x, ids).flatten()])

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
        want = torch.cat([flat_rows(torch_path(attn.project, x, positions, int(positions[0]), cos, sin)),
                          torch_path(lambda: attn.o_b_proj(attn.o_a_proj(
                              apply_rope(o, cos, sin, inverse=True).reshape(1, attn.o_groups, -1)))).flatten(),
                          torch_path(moe, x, ids).flatten()])
    assert (shared - want).abs().max().item() <= 256 * torch.finfo(torch.float32).eps * want.abs().max().item()

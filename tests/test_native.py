"""The native fp32 CPU kernels (kvfold/numerics/native.c) against the torch formulas they replace,
their row independence, and the fallback when they cannot be built."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import TORCH_OPS, ops_for

from kvfold.numerics import apply_rope, native, rms_norm, unweighted_rms_norm
from kvfold.numerics.backend import KernelError
from kvfold.numerics.hc import hc_collapse, hc_expand, hc_head, hc_head_weights, hc_weights, weighted_streams
from kvfold.numerics.native_abi import IndexQuery


EPS = torch.finfo(torch.float32).eps
NATIVE = ops_for()  # an fp32 CPU model's ops: native.c wherever it has the kernel (numerics/backend.py)


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
    for got, want in ((rms_norm(NATIVE, x, w, 1e-6), rms_norm(TORCH_OPS, x, w, 1e-6)),
                      (unweighted_rms_norm(NATIVE, x, 1e-6), unweighted_rms_norm(TORCH_OPS, x, 1e-6))):
        assert ((got - want).abs() <= (d / 2 + 5) * EPS * want.abs()).all()


def test_rope_native_matches_torch_and_inverts():
    from kvfold.numerics import RopeTable
    g = torch.Generator().manual_seed(1)
    table = RopeTable(32, 10000.0)
    cos, sin = table.cos_sin(NATIVE, torch.arange(100, 107))
    for x in (torch.randn(7, 4, 128, generator=g), torch.randn(7, 64, generator=g)):
        # an output a c -+ b s rounds two products and a sum: within 2u (|a| + |b|) <= 2 eps m,
        # m = max|x|, on each side; |y_a| + |y_b| <= sqrt(2) |(a, b)| <= 2m, so the inverse too. Back
        # to x adds the forward rounding (rotated: sqrt(2) 2 eps m), the inverse's (2 eps m) and the
        # table's cos^2 + sin^2 - 1 (each within an ulp: 2 eps m): 7 eps m. A wrong pair, angle or
        # sign moves an output by O(m).
        m = x.abs().max().item()
        y = apply_rope(NATIVE, x, cos, sin)
        assert (y - apply_rope(TORCH_OPS, x, cos, sin)).abs().max().item() <= 4 * EPS * m
        assert torch.equal(y[..., :-32], x[..., :-32])  # the nope dims are copied, not touched
        back = apply_rope(NATIVE, y, cos, sin, inverse=True)
        assert (back - apply_rope(TORCH_OPS, y, cos, sin, True)).abs().max().item() <= 4 * EPS * m
        assert (back - x).abs().max().item() <= 7 * EPS * m


def _hc_params(hc: int, d: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    return (torch.randn(3, hc, d, generator=g), torch.randn(n, hc * d, generator=g) * 0.05,
            torch.randn(n, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5)


@pytest.mark.parametrize("hc", [2, 4])
def test_hc_collapse_native_matches_the_weights_then_the_weighted_sum(hc):
    streams, fn, base, scale = _hc_params(hc, 64)
    x, post, comb = hc_collapse(NATIVE, streams, fn, base, scale, 20, 1e-6, 1e-6)
    pre, post_t, comb_t = hc_weights(TORCH_OPS, streams, fn, base, scale, 20, 1e-6, 1e-6)
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
    got = hc_head(NATIVE, streams, fn_h, base_h, scale_h, 1e-6, 1e-6)
    pre = hc_head_weights(TORCH_OPS, streams, fn_h, base_h, scale_h, 1e-6, 1e-6)
    assert torch.allclose(got, weighted_streams(pre, streams), atol=1e-5)
    y = torch.randn(3, d)
    _, post, comb = hc_collapse(NATIVE, streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert torch.allclose(hc_expand(NATIVE, streams, y, post, comb), hc_expand(TORCH_OPS, streams, y, post, comb),
                          atol=1e-5)


def test_native_rows_are_bit_identical_alone_or_in_any_batch():
    """Each kernel treats a row alone: its bits never depend on the other rows of the call."""
    hc, d = 4, 64
    g = torch.Generator().manual_seed(4)
    streams = torch.randn(37, hc, d, generator=g)
    _, fn, base, scale = _hc_params(hc, d)
    w = torch.randn(d, generator=g)
    x_all, post_all, comb_all = hc_collapse(NATIVE, streams, fn, base, scale, 20, 1e-6, 1e-6)
    norm_all = rms_norm(NATIVE, streams[:, 0].contiguous(), w, 1e-6)
    for i in (0, 5, 36):
        x1, post1, comb1 = hc_collapse(NATIVE, streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6)
        assert torch.equal(x1[0], x_all[i]) and torch.equal(post1[0], post_all[i])
        assert torch.equal(comb1[0], comb_all[i])
        assert torch.equal(rms_norm(NATIVE, streams[i:i + 1, 0].contiguous(), w, 1e-6)[0], norm_all[i])


@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_tile_of_the_matmul_gives_a_row_its_lone_bits(threads):
    """native_dot.h's matmul tiles 4, 3, 2 or 1 rows at a time (a verify step's 2 to 5 rows share
    each weight load): whatever tile a row lands in, its outputs are its bits alone, for column
    counts with every remainder and a K with a tail past the 8 lanes."""
    from kvfold.numerics.rows import row_mm
    ops = ops_for(invariant=True)
    g = torch.Generator().manual_seed(6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((37, 77), (64, 256)):
            w = torch.randn(n, k, generator=g)
            x = torch.randn(9, k, generator=g)
            alone = torch.cat([row_mm(ops, x[i:i + 1], w) for i in range(9)])
            # a K-term fp32 sum of fp32 products: within k * eps * sum |x w| of the exact dot
            bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
            assert ((alone.double() - x.double() @ w.double().t()).abs() <= bound).all()
            for m in range(1, 10):
                assert torch.equal(row_mm(ops, x[:m], w), alone[:m]), (n, k, m)
    finally:
        torch.set_num_threads(before)


def test_strided_inputs_run_native_and_inputs_the_kernel_cannot_read_are_refused():
    """The kernel chosen at set-up serves every call (numerics/backend.py): strided fp32 rows are
    made contiguous and run native.c (the bits of the contiguous rows); a bf16 tensor handed to an
    fp32 model's native rms_norm is a bug, refused with KernelError, never a silent torch
    fallback; a bf16 model's Backend chooses torch for rms_norm."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=g)
    w = torch.randn(128, generator=g)
    strided = x[:, ::2]
    assert NATIVE.rms_norm.kind == "native"
    got = rms_norm(NATIVE, strided, w[:64], 1e-6)
    assert torch.equal(got, rms_norm(NATIVE, strided.contiguous(), w[:64], 1e-6))
    assert torch.allclose(got, rms_norm(TORCH_OPS, strided, w[:64], 1e-6))
    xb = x.bfloat16()
    with pytest.raises(KernelError):
        rms_norm(NATIVE, xb, w, 1e-6)
    bf16_ops = ops_for(dtype=torch.bfloat16)
    assert bf16_ops.rms_norm.kind == "torch"
    assert torch.equal(rms_norm(bf16_ops, xb, w, 1e-6), rms_norm(TORCH_OPS, xb, w, 1e-6))


def _fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_kvfold_native_0_turns_the_kernels_off():
    """KVFOLD_NATIVE=0 is read once, into a loaded model's KernelSet (`KernelSet.from_env`): the
    model then runs torch everywhere; without it, the same model runs native.c."""
    code = "import kvfold; print(kvfold.load_model('tiny-random').backend().rms_norm.kind)"
    off = _fresh_python(code, KVFOLD_NATIVE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "torch"
    on = _fresh_python(code, KVFOLD_NATIVE="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip() == "native"


def test_a_failed_build_warns_once_and_the_model_still_runs(tmp_path):
    code = ("import warnings, torch\n"
            "warnings.simplefilter('always')\n"
            "from kvfold.numerics import native, rms_norm\n"
            "from kvfold.numerics.backend import KernelSet, build_backend\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    for _ in range(2):  # two models' set-up: one warning\n"
            "        ops = build_backend('cpu', torch.float32, 'hf', False, KernelSet())\n"
            "        y = rms_norm(ops, torch.ones(2, 8), torch.ones(8), 1e-6)\n"
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
                got = moe(x, ids, NATIVE)
                want = moe(x, ids, TORCH_OPS)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (layer, token)
                # and the native path really ran: the torch path is a different computation
                assert moe._native_rows(x, ids, NATIVE) is not None


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
    got = _native_attend_one(NATIVE, q, [local], pool, None, 9, sinks, "heavily_compressed_attention")
    want = _reference_attend(q[0], local, pool.data[:9], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, pool.data[:9])
    # CSA: picked entries, -1 = none
    sel = torch.tensor([[3, 8, 21, -1, -1]])
    got = _native_attend_one(NATIVE, q, [local], pool, sel, 5, sinks, "compressed_sparse_attention")
    want = _reference_attend(q[0], local, pool.data[[3, 8, 21]], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, pool.data[[3, 8, 21]])
    # the window alone
    got = _native_attend_one(NATIVE, q, [local], None, None, 0, sinks, "sliding_attention")
    want = _reference_attend(q[0], local, local[:0], sinks)
    assert (got[0] - want).abs().max().item() <= _attend_bound(q[0], local, local[:0])
    # the window in three runs (a wrapped ring and the new row) reads as the one buffer, bit for bit
    runs = [local[:6].clone(), local[6:16].clone(), local[16:].clone()]
    got = _native_attend_one(NATIVE, q, runs, pool, sel, 5, sinks, "compressed_sparse_attention")
    one_run = _native_attend_one(NATIVE, q, [local], pool, sel, 5, sinks, "compressed_sparse_attention")
    assert torch.equal(got, one_run)


def _attend_and_select(h, d, pool, phys, sel, window, q, sinks, iq, iw, threads):
    """kv_attend_one (window runs, then the pool's picked rows) and kv_index_topk_one (over the pool's
    rows as index keys) called directly, on `threads` threads; phys: the pool's paging or None."""
    import ctypes
    from kvfold.numerics.native_abi import AttendKeys
    lib = native.library()
    ptr = ctypes.c_void_p
    keys = AttendKeys((ptr * 3)(*[w.data_ptr() for w in window]), (ctypes.c_int64 * 3)(*[w.shape[0] for w in window]),
                      pool.data_ptr(), None if phys is None else phys.data_ptr(), sel.data_ptr(), sel.numel())
    n = sum(w.shape[0] for w in window) + sel.numel()
    out, scratch = torch.empty(h, d), torch.empty(h * n)
    lib.kv_attend_one(q.data_ptr(), h, d, keys, sinks.data_ptr(), out.data_ptr(), scratch.data_ptr(), threads)
    n_entries, hi, di = pool.shape[0], iq.shape[0], iq.shape[1]
    picked, score = torch.empty(1, 64, dtype=torch.long), torch.empty(n_entries)
    lib.kv_index_topk_one(IndexQuery(iq.data_ptr(), iw.data_ptr(), hi, di), pool.data_ptr(),
                          None if phys is None else phys.data_ptr(), n_entries, 64, picked.data_ptr(),
                          score.data_ptr(), threads)
    return out, picked


def test_decode_attention_and_selection_keep_their_bits_on_any_thread_count_and_paging():
    """The heads (attention) and the entries (index scores) split over threads, and keys side by
    side in memory take wider tiles than paged ones: every output is still the one `dot` and the
    sums in key order, so the bits are the same however the work is split or the rows stored."""
    g = torch.Generator().manual_seed(11)
    h, d, n_entries = 16, 128, 301  # past native.c's KV_SERIAL_MACS in both kernels, so threads split them
    q, sinks = torch.randn(h, d, generator=g) * 0.1, torch.randn(h, generator=g)
    iq, iw = torch.randn(8, d, generator=g), torch.rand(8, generator=g)
    local = torch.randn(29, d, generator=g)
    window = [local[:7], local[7:28], local[28:]]
    pool = torch.randn(n_entries, d, generator=g)
    sel = torch.cat([torch.arange(0, 90), torch.tensor([-1, 95, 96, 200, 201, 202, -1, 300])])
    base = _attend_and_select(h, d, pool, None, sel, window, q, sinks, iq, iw, 1)
    order = torch.randperm(n_entries, generator=g)  # entry j stored at physical row order[j]
    paged = torch.empty_like(pool)
    paged[order] = pool
    for threads in (1, 2, 3):
        for store, phys in ((pool, None), (paged, order)):
            got = _attend_and_select(h, d, store, phys, sel, window, q, sinks, iq, iw, threads)
            assert torch.equal(got[0].view(torch.int32), base[0].view(torch.int32)), (threads, phys is None)
            assert torch.equal(got[1], base[1]), (threads, phys is None)
    want = _reference_attend(q, local, pool[sel[sel >= 0]], sinks)
    assert (base[0] - want).abs().max().item() <= _attend_bound(q, local, pool[sel[sel >= 0]])


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
                              out.data_ptr(), scratch.data_ptr(), 1)
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
    got = pool_windows(NATIVE, kv, sc, r, overlap)
    assert got.shape == (n_w, c)
    # each side within (2 n_slots + 4) eps max|kv| of exact (tests/test_triton_ops.py's pooling bound)
    n_slots = 2 * r if overlap else r
    bound = 2 * (2 * n_slots + 4) * EPS * kv.abs().max()
    assert (got - pool_windows(TORCH_OPS, kv, sc, r, overlap)).abs().max() <= bound
    # rows alone: each window's entry does not depend on the other windows of the call
    w = 1
    span = slice(w * r, (w + 2) * r) if overlap else slice(w * r, (w + 1) * r)
    assert torch.equal(pool_windows(NATIVE, kv[span].contiguous(), sc[span].contiguous(), r, overlap)[0], got[w])


def test_invariant_collapse_is_native_per_row_at_any_thread_count():
    """In batch-invariant mode every row takes the native collapse, whatever the row count and the
    number of torch threads (a path chosen by size would let a row's bits depend on its batch)."""
    ops = ops_for(invariant=True)
    g = torch.Generator().manual_seed(10)
    streams = torch.randn(64, 4, 512, generator=g)
    _, fn, base, scale = _hc_params(4, 512, seed=10)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            whole = hc_collapse(ops, streams, fn, base, scale, 20, 1e-6, 1e-6)
            rows = [hc_collapse(ops, streams[i:i + 1], fn, base, scale, 20, 1e-6, 1e-6) for i in range(64)]
            for part, got in enumerate(whole):
                assert torch.equal(got, torch.cat([r[part] for r in rows]))
    finally:
        torch.set_num_threads(before)


_MM_PROBE = ("import hashlib, torch\n"
             "from kvfold.numerics import native\n"
             "from kvfold.numerics.rows import invariant_mm\n"
             "g = torch.Generator().manual_seed(0)\n"
             "x, w = torch.randn(9, 203, generator=g), torch.randn(7, 203, generator=g)\n"
             "y = invariant_mm(native.library(), x, w)\n"
             "print(native.available(), hashlib.sha256(y.numpy().tobytes()).hexdigest())\n")


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

"""The Triton kernels for the sparse parts (kvfold/numerics/triton_kernels.py), run on the CPU by
Triton's interpreter (tests/conftest.py turns it on before anything imports triton), each against
the formula it stands for: float64 for the attention and the index scores (tolerances from the
fp32 rounding of the sums involved), kvfold's torch `pool_windows` and `topk_lower_index` for the
pooling and the top-k (the tie rule exactly)."""
import os

import pytest
import torch
from helpers import TORCH_OPS, ops_for

from kvfold.numerics import triton_kernels as T
from kvfold.numerics.backend import OPS, KernelSet, triton_available
from kvfold.numerics.fold import pool_windows
from kvfold.numerics.topk import topk_lower_index

EPS = torch.finfo(torch.float32).eps


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_they_are_off_unless_asked_for():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert triton_available(torch.device("cpu")) and triton_available(torch.device("cuda"))
    assert not KernelSet().triton
    with_triton = [op.name for op in OPS if op.triton]
    assert with_triton
    assert all(getattr(ops_for(), name).triton is None for name in with_triton)
    on = ops_for(triton=True)
    assert all(getattr(on, name).kind == "triton" and getattr(on, name).triton is T for name in with_triton)


@pytest.mark.parametrize("ratio,overlap,c", [(4, True, 24), (4, True, 130), (8, False, 64), (16, False, 5)])
def test_pool_windows_is_the_torch_pooling(ratio, overlap, c):
    n_w = 5
    rows = (n_w + 1) * ratio if overlap else n_w * ratio
    width = 2 * c if overlap else c
    kv, score = torch.randn(rows, width, generator=gen(c)) * 3, torch.randn(rows, width, generator=gen(c + 1)) * 4
    if overlap:
        score[:ratio, :c] = float("-inf")  # positions before 0: the first window's missing slots
    want = pool_windows(TORCH_OPS, kv, score, ratio, overlap)
    got = T.pool_windows(kv, score, ratio, overlap)
    # softmax weights within (n_slots + 3) eps relative of exact, summing to 1; the weighted sum adds
    # n_slots eps of its magnitude: each side within (2 n_slots + 4) eps * max|kv|, so twice that apart
    n_slots = 2 * ratio if overlap else ratio
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 2 * (2 * n_slots + 4) * EPS * kv.abs().max()


def _attend64(q, kw, iw, kc, ic, sinks):
    q, kw, kc, sinks = q.double(), kw.double(), kc.double(), sinks.double()
    out, bound = torch.empty_like(q), torch.empty(q.shape[0])
    for i in range(q.shape[0]):
        keys = torch.cat([kw[iw[i][iw[i] >= 0]], kc[ic[i][ic[i] >= 0]]])
        p = torch.softmax(torch.cat([q[i] @ keys.t(), sinks[:, None]], 1), 1)
        out[i] = p[:, :-1] @ keys
        # a logit's fp32 dot is within d eps sum|q k| of exact, which moves p by as much relatively;
        # the online softmax and the sum over M keys add (M + 4) eps; |out| <= max|k|
        ds = q.shape[-1] * EPS * (q[i].abs() @ keys.abs().t()).max() if keys.numel() else 0.0
        bound[i] = 2 * (float(ds) + (keys.shape[0] + 4) * EPS) * (keys.abs().max() if keys.numel() else 0.0)
    return out, bound


@pytest.mark.parametrize("t,h,d,nw,nc", [(1, 4, 32, 9, 40), (5, 16, 64, 16, 70), (3, 20, 48, 7, 0)])
def test_sparse_attention_is_the_softmax_over_window_entries_and_sink(t, h, d, nw, nc):
    g = gen(t * h + d)
    q = torch.randn(t, h, d, generator=g) * d ** -0.5
    kw, kc = torch.randn(30, d, generator=g), torch.randn(50, d, generator=g)
    iw = torch.randint(0, 30, (t, nw), generator=g)
    iw[0, nw // 2:] = -1  # a query whose window is not full
    ic = torch.randint(0, 50, (t, nc), generator=g)
    if nc:
        ic[-1, ::3] = -1  # "no entry" slots among the selected
    sinks = torch.randn(h, generator=g)
    got = T.sparse_attend(q, kw, iw, kc, ic, sinks)
    want, bound = _attend64(q, kw, iw, kc, ic, sinks)
    err = (got.double() - want).abs().amax(dim=(1, 2))
    assert (err <= bound).all(), (err, bound)
    # each query is one program: its result does not depend on the others in the launch
    for i in range(t):
        assert torch.equal(T.sparse_attend(q[i:i + 1], kw, iw[i:i + 1], kc, ic[i:i + 1], sinks)[0], got[i])


def test_a_query_with_no_keys_attends_only_to_the_sink():
    q, kw = torch.randn(1, 4, 16), torch.randn(3, 16)
    got = T.sparse_attend(q, kw, torch.full((1, 5), -1), None, None, torch.randn(4))
    assert torch.equal(got, torch.zeros(1, 4, 16))
    # an index past the keys reads nothing (never memory beyond them)
    assert torch.equal(T.sparse_attend(q, kw, torch.tensor([[3, 7, -1]]), None, None, torch.randn(4)), got)


def test_index_scores_are_the_weighted_relu_dots():
    g = gen(7)
    t, h, d, n = 4, 8, 64, 90
    q, w, keys = torch.randn(t, h, d, generator=g), torch.rand(t, h, generator=g), torch.randn(n, d, generator=g)
    visible = torch.tensor([0, 17, 90, 64])
    got = T.index_scores(q, w, keys, visible)
    dots = q.double() @ keys.double().t()  # [t, h, n]
    want = (w.double()[:, :, None] * torch.relu(dots)).sum(1)
    hidden = torch.arange(n)[None, :] >= visible[:, None]
    assert torch.equal(got.isinf(), hidden) and (got[hidden] == float("-inf")).all()
    # each dot within d eps sum|q k|, the head sum adds h eps sum|w relu|: in units of sum_h |w| sum_d |q k|
    scale = (w.double()[:, :, None] * (q.double().abs() @ keys.double().abs().t())).sum(1)
    assert ((got.double() - want).abs()[~hidden] <= ((d + h + 2) * EPS * scale)[~hidden]).all()


def test_a_querys_index_scores_do_not_depend_on_how_many_entries_the_call_holds():
    """A graph step scores every entry below its context bound, which follows the batch: the
    scores of a query's first entries must be the same bits over 20, 100 or 300 entries (the
    program's entry block is a constant, INDEX_BLOCK), in place through rows or not."""
    t, h, d = 3, 4, 32
    q = torch.randn(t, h, d, generator=gen(31))
    w = torch.randn(t, h, generator=gen(32))
    keys = torch.randn(300, d, generator=gen(33))
    visible = torch.tensor([20, 7, 15])
    ref = T.index_scores(q, w, keys[:20], visible)
    for n in (100, 300):
        assert torch.equal(T.index_scores(q, w, keys[:n], visible)[:, :20], ref)
        rows = torch.arange(n).expand(t, n)
        assert torch.equal(T.index_scores(q, w, keys, visible, rows=rows)[:, :20], ref)


def test_topk_keeps_the_tie_rule_and_skips_minus_infinity():
    g = gen(3)
    s = torch.randint(-3, 4, (6, 200), generator=g).float()  # many exact ties
    s[0, 50:] = float("-inf")
    s[1] = float("-inf")  # nothing selectable: all -1
    s[2, ::2] = -0.0  # negative zeros tie with zeros
    s[2, 1::2] = 0.0
    s[3, 7] = float("inf")
    for k in (1, 64, 300):
        assert torch.equal(T.topk_lower_index(s, k), topk_lower_index(s, k)), k


def test_index_topk_picks_as_the_model_does():
    g = gen(11)
    t, h, d, n, k = 3, 4, 32, 120, 16
    q, w, keys = torch.randn(t, h, d, generator=g), torch.rand(t, h, generator=g), torch.randn(n, d, generator=g)
    visible = torch.tensor([120, 40, 9])
    scores = T.index_scores(q, w, keys, visible)
    assert torch.equal(T.index_topk(q, w, keys, visible, k), topk_lower_index(scores, k))
    # and the same set as fp64 scores pick, where no two scores are within the rounding of each other
    dots = (w.double()[:, :, None] * torch.relu(q.double() @ keys.double().t())).sum(1)
    dots = dots.masked_fill(torch.arange(n)[None, :] >= visible[:, None], float("-inf"))
    assert torch.equal(T.index_topk(q, w, keys, visible, k), topk_lower_index(dots.float(), k))


def test_the_model_through_the_kernels_is_the_model():
    # the tiny DeepSeek-V4 (sliding, CSA and HCA layers) with the kernels switched on, in the
    # interpreter: prefill, then decode, against the default path (torch and native.c), within the
    # rounding two fp32 paths may differ by (tests/helpers.py)
    from helpers import fp32_paths_bound
    from kvfold.models.deepseek_v4.model import Dsv4Model
    from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
    # a window of 8, 4 CSA entries of which the indexer picks 2, 2 HCA entries
    model = Dsv4Model(tiny_config(sliding_window=8, compress_ratios=(0, 4, 8, 4), index_topk=2,
                                  num_nextn_predict_layers=0), dtype=torch.float32)
    init_random_(model, 0)
    ids = [(7 * i + 3) % 250 for i in range(16)]

    def run():
        st = model.new_state(capacity=16)
        return torch.cat([model.forward(ids[:12], st)] + [model.forward(ids[i:i + 1], st) for i in range(12, 16)])

    want = run()
    model.set_kernels(KernelSet(triton=True))
    got = run()
    assert (got - want).abs().max() <= fp32_paths_bound(want, model.config.num_hidden_layers)


@pytest.mark.parametrize("per_slot", [False, True])
def test_expert_rows_are_each_rows_expert_matmuls_read_in_place(per_slot):
    """Each (row, slot) output against float64, within the fp32 rounding of its K-term sum
    (K eps sum |w x| for each side); a row alone gets the bits it gets in the batch."""
    n, k, e, n_out, k_in = 5, 3, 6, 70, 150
    w = torch.randn(e, n_out, k_in, generator=gen(1))
    x = torch.randn(n * k if per_slot else n, k_in, generator=gen(2))
    ids = torch.randint(0, e, (n, k), generator=gen(3))
    got = T.expert_rows(x, w, ids, per_slot=per_slot)
    xs = x.view(n, k, k_in) if per_slot else x[:, None, :].expand(n, k, k_in)
    want = torch.einsum("nkoi,nki->nko", w.double()[ids], xs.double())
    bound = 2 * k_in * EPS * torch.einsum("nkoi,nki->nko", w.double().abs()[ids], xs.double().abs())
    assert got.shape == (n, k, n_out) and ((got.double() - want).abs() <= bound).all()
    alone = T.expert_rows(x[k:2 * k] if per_slot else x[1:2], w, ids[1:2], per_slot=per_slot)
    assert torch.equal(alone[0], got[1])


def test_a_graph_decode_step_through_the_kernels_is_the_torch_step():
    """The tiny V4's capturable decode step with the Triton kernels (experts, attention and index
    scores reading the arena and the pool in place) against its torch gathers, within the bound
    of two fp32 evaluations (helpers.fp32_paths_bound)."""
    import kvfold
    from helpers import fp32_paths_bound, random_ids
    model = kvfold.load_model("tiny-random")
    model.set_batch_invariant(False)
    pool = model.new_page_pool(12)
    arenas = [model.new_decode_arena(2, 256, pool) for _ in range(2)]
    lens = (9, 70)
    states = [[], []]
    for n in lens:
        for arena, group in zip(arenas, states):
            st = model.new_state(capacity=256, pages=pool, arena=arena)
            model.forward(random_ids(n, model.config.vocab_size, seed=n), st)
            group.append(st)
    tokens = torch.tensor([5, 9])
    with torch.inference_mode():
        want, _ = model.decode_graph_step(model.backend(), arenas[1], tokens, torch.tensor(lens),
                                          torch.tensor([s.slot for s in states[1]]))
        model.set_kernels(KernelSet(triton=True))
        got, _ = model.decode_graph_step(model.backend(), arenas[0], tokens, torch.tensor(lens),
                                         torch.tensor([s.slot for s in states[0]]))
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, model.config.num_hidden_layers)


def test_the_kernels_read_bf16_key_tables_in_place_as_their_fp32_values():
    """sparse_attend and index_scores on a bf16 table give the bits of the same table in fp32
    (the kernels upcast each key as they load it); index_scores through `rows` gives each query
    the bits it gets over its own rows as a table of their own."""
    q = torch.randn(3, 4, 16, generator=gen(9)) * 0.3
    table = torch.randn(40, 16, generator=gen(10)).to(torch.bfloat16)
    idx = torch.randint(-1, 40, (3, 12), generator=gen(11))
    sinks = torch.randn(4, generator=gen(12))
    assert torch.equal(T.sparse_attend(q, table, idx, table, idx.flip(1), sinks),
                       T.sparse_attend(q, table.float(), idx, table.float(), idx.flip(1), sinks))
    w = torch.randn(3, 4, generator=gen(13))
    rows = torch.randint(0, 40, (3, 20), generator=gen(14))
    visible = torch.tensor([20, 7, 13])
    got = T.index_scores(q, w, table, visible, rows=rows)
    for t in range(3):
        alone = T.index_scores(q[t:t + 1], w[t:t + 1], table[rows[t]].float(), visible[t:t + 1])
        assert torch.equal(got[t:t + 1], alone)

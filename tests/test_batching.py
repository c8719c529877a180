"""One model call advances many sequences, and each gets exactly the bits it would get alone."""
import pytest
import torch

from helpers import random_ids
from kvfold.errors import CapacityError
from kvfold.numerics.rows import ROW_MULTIPLE, ROW_TILE, invariant_rows, pad_index, padded_count, row_mm


def prefill(model, ids, capacity=600, kv_dtype=None):
    st = model.new_state(capacity=capacity, kv_dtype=kv_dtype)
    if len(ids):
        model.forward(ids, st, last_only=True)
    return st


@pytest.fixture
def invariant(tiny):
    tiny.set_batch_invariant(True)
    yield tiny
    tiny.set_batch_invariant(False)


@pytest.mark.parametrize("rows", [4, 8, 12, 100, 256, 260, 600])
def test_row_mm_gives_each_row_the_same_bits_in_any_padded_batch(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(700, 64, generator=g), torch.randn(96, 64, generator=g)
    with invariant_rows():
        for offset in (0, 3):  # each row as the top row of a 4-row call vs inside a call of `rows` rows
            want = torch.cat([row_mm(x[i:i + 4], w)[:1] for i in range(offset, offset + rows)])
            assert torch.equal(row_mm(x[offset:offset + rows], w), want)


def test_row_tiles_only_inside_invariant_rows():
    x, w = torch.randn(600, 32), torch.randn(16, 32)
    calls = []
    real = torch.nn.functional.linear

    def spy(a, b):
        calls.append(a.shape[0])
        return real(a, b)
    torch.nn.functional.linear = spy
    try:
        row_mm(x, w)
        with invariant_rows():
            row_mm(x, w)
        row_mm(x, w)
    finally:
        torch.nn.functional.linear = real
    assert calls == [600, ROW_TILE, ROW_TILE, 600 - 2 * ROW_TILE, 600]


def test_padding_rules():
    assert [padded_count(n) for n in (1, 7, 8, 9, 17)] == [8, 8, 8, 16, 24]
    assert [padded_count(n, 4) for n in (1, 3, 4, 5)] == [4, 4, 4, 8]
    assert pad_index(torch.tensor([7, 2, 5])).tolist() == [7, 2, 5, 7]
    assert pad_index(torch.tensor([1, 2, 3, 4])).tolist() == [1, 2, 3, 4]
    assert ROW_TILE % ROW_MULTIPLE == 0


def test_mixed_batch_of_prefills_and_decodes_is_bit_identical_to_each_alone(invariant):
    tiny = invariant
    v = tiny.config.vocab_size
    # sequences at different positions: fresh, mid-window, past fold and window edges
    prompts = [random_ids(n, v, seed=n) for n in (0, 5, 37, 130, 200)]
    feeds = [random_ids(n, v, seed=100 + n) for n in (3, 1, 1, 17, 1)]
    alone_states = [prefill(tiny, p) for p in prompts]
    batch_states = [prefill(tiny, p) for p in prompts]
    alone = [tiny.forward(f, st, last_only=False) for f, st in zip(feeds, alone_states)]
    batched = tiny.forward_batch(list(zip(feeds, batch_states)), last_only=False)
    for a, b, sa, sb in zip(alone, batched, alone_states, batch_states):
        assert torch.equal(a, b)
        assert sa.pos == sb.pos and sa.snapshot() == sb.snapshot()
    # and decoding on, in batches of changing composition, stays identical to decoding alone
    for step in range(6):
        tok = [[(step * 7 + i) % v] for i in range(len(prompts))]
        members = [i for i in range(len(prompts)) if (i + step) % 3]  # who joins this step's batch
        got = tiny.forward_batch([(tok[i], batch_states[i]) for i in members])
        for i, lg in zip(members, got):
            assert torch.equal(lg, tiny.forward(tok[i], alone_states[i], last_only=True))
    assert all(sa.snapshot() == sb.snapshot() for sa, sb in zip(alone_states, batch_states))


def test_long_prefill_in_a_batch_runs_in_invariant_tiles(invariant):
    tiny = invariant
    v = tiny.config.vocab_size
    long_feed = random_ids(300, v, seed=3)  # > ROW_TILE rows with the decode rows beside it
    s_alone, s_batch = prefill(tiny, []), prefill(tiny, [])
    d_alone, d_batch = prefill(tiny, random_ids(20, v, seed=4)), prefill(tiny, random_ids(20, v, seed=4))
    want = [tiny.forward(long_feed, s_alone, last_only=False), tiny.forward([9], d_alone, last_only=False)]
    got = tiny.forward_batch([(long_feed, s_batch), ([9], d_batch)], last_only=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert s_alone.snapshot() == s_batch.snapshot()


def test_fp8_and_plain_states_share_a_batch(invariant):
    tiny = invariant
    v = tiny.config.vocab_size
    p = random_ids(40, v, seed=5)
    a8, b8 = prefill(tiny, p, kv_dtype="fp8"), prefill(tiny, p, kv_dtype="fp8")
    a, b = prefill(tiny, p), prefill(tiny, p)
    got = tiny.forward_batch([([3], b8), ([3], b)])
    assert torch.equal(got[0], tiny.forward([3], a8, last_only=True))
    assert torch.equal(got[1], tiny.forward([3], a, last_only=True))
    assert not torch.equal(got[0], got[1])  # the FP8 state really reads its own rows


def test_a_batch_is_one_pass_over_the_weights(tiny):
    """Every layer's projections run once per call, whatever the number of sequences."""
    tiny.set_batch_invariant(False)  # (an Engine built earlier on this model may have turned it on)
    calls = []
    hooks = [layer.self_attn.q_a_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
             for layer in tiny.model.layers]
    hooks.append(tiny.lm_head.register_forward_hook(lambda m, i, o: calls.append(-i[0].shape[0])))
    try:
        states = [prefill(tiny, random_ids(9 + i, tiny.config.vocab_size, seed=i)) for i in range(6)]
        calls.clear()
        tiny.forward_batch([([1], st) for st in states])
    finally:
        for h in hooks:
            h.remove()
    n_layers = tiny.config.num_hidden_layers
    assert calls == [6] * n_layers + [-6]  # 6 decode rows: one call per layer, one lm_head call


def test_invariant_mode_pads_rows_and_default_mode_matches_within_rounding(tiny, invariant):
    v = tiny.config.vocab_size
    prompts = [random_ids(n, v, seed=n) for n in (3, 50, 129)]
    alone = [prefill(tiny, p) for p in prompts]
    want = [tiny.forward([5], st, last_only=True) for st in alone]  # invariant mode (fixture)
    tiny.set_batch_invariant(False)
    states = [prefill(tiny, p) for p in prompts]
    got = tiny.forward_batch([([5], st) for st in states])
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(want, got))
    seen = []
    hook = tiny.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    try:
        tiny.forward_batch([([6], st) for st in states])
        tiny.set_batch_invariant(True)
        tiny.forward_batch([([7], st) for st in states])
    finally:
        hook.remove()
    assert seen == [3, ROW_MULTIPLE]


def test_a_refused_batch_changes_no_state(tiny):
    v = tiny.config.vocab_size
    ok = prefill(tiny, random_ids(10, v, seed=1))
    full = tiny.new_state(capacity=4)
    tiny.forward(random_ids(4, v, seed=2), full)
    before = ok.snapshot(), full.snapshot()
    with pytest.raises(CapacityError):
        tiny.forward_batch([([1], ok), ([2], full)])
    assert (ok.snapshot(), full.snapshot()) == before and ok.pos == 10

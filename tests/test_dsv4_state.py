"""State invariants: fresh ids, refusals that change nothing, idempotent free, capacity never grown."""
import pytest
import torch

import kvfold
from kvfold.errors import InvalidInputError
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from helpers import fp32_paths_bound, random_ids


def snapshot_buffers(state):
    bufs = []
    for ls in state.layers:
        bufs += ls.window.store.clone_storage()
        for c in (ls.compressor, ls.indexer):
            if c is not None:
                bufs += c.kv.store.clone_storage() + c.score.store.clone_storage() + c.pool.clone_storage()
    return bufs


def assert_unchanged(state, before, pos):
    assert state.pos == pos
    for a, b in zip(before, snapshot_buffers(state)):
        assert torch.equal(a, b)


def test_kv_id_is_fresh_for_every_state(tiny):
    ids = {tiny.new_state(capacity=8).kv_id for _ in range(50)}
    assert len(ids) == 50


def test_new_state_reserves_capacity_once(tiny):
    st = tiny.new_state(capacity=100)
    nbytes = st.nbytes
    tiny.forward(random_ids(99, tiny.config.vocab_size), st)
    tiny.forward([5], st)
    assert st.nbytes == nbytes and st.pos == 100
    # pools sized ceil(capacity / ratio)
    for ls, r in zip(st.layers, tiny.config.compress_ratios):
        if r:
            assert ls.compressor.pool.shape[0] == -(-100 // r)


def test_capacity_overflow_raises_and_changes_nothing(tiny):
    st = tiny.new_state(capacity=40)
    tiny.forward(random_ids(35, tiny.config.vocab_size), st)
    before = snapshot_buffers(st)
    with pytest.raises(kvfold.CapacityError, match="capacity"):
        tiny.forward(random_ids(6, tiny.config.vocab_size), st)
    assert_unchanged(st, before, 35)
    tiny.forward(random_ids(5, tiny.config.vocab_size), st)  # exactly to capacity is fine
    assert st.pos == 40


def test_state_of_another_model_is_refused_and_unchanged(tiny):
    other = Dsv4Model(tiny_config(sliding_window=16))
    init_random_(other, 1)
    st = other.new_state(capacity=64)
    other.forward(random_ids(10, 258), st)
    before = snapshot_buffers(st)
    with pytest.raises(kvfold.StateMismatchError, match="another|fingerprint"):
        tiny.forward([1, 2, 3], st)
    assert_unchanged(st, before, 10)


def test_state_of_another_dtype_is_refused(tiny):
    half = kvfold.load_model("tiny-random", dtype=torch.bfloat16)
    st = half.new_state(capacity=16)
    with pytest.raises(kvfold.StateMismatchError, match="bfloat16"):
        tiny.forward([1], st)


def test_freed_state_errors_and_free_is_idempotent(tiny):
    st = tiny.new_state(capacity=16)
    tiny.forward([1, 2], st)
    st.free()
    assert st.nbytes == 0
    st.free()  # second call does nothing
    with pytest.raises(kvfold.FreedStateError, match="new_state"):
        tiny.forward([3], st)


def test_bad_token_ids_are_refused_before_any_write(tiny):
    st = tiny.new_state(capacity=16)
    tiny.forward([1, 2, 3], st)
    before = snapshot_buffers(st)
    for bad in ([], [tiny.config.vocab_size], [-1], [[1, 2]]):
        with pytest.raises(InvalidInputError):
            tiny.forward(bad, st)
    assert_unchanged(st, before, 3)


def test_errors_form_one_hierarchy():
    for e in (kvfold.CapacityError, kvfold.StateMismatchError, kvfold.FreedStateError):
        assert issubclass(e, kvfold.StateError) and issubclass(e, kvfold.KvfoldError)
    assert issubclass(InvalidInputError, kvfold.KvfoldError)


def test_forward_returns_logits_per_token_and_advances_pos(tiny):
    st = tiny.new_state(capacity=16)
    out = tiny.forward(torch.tensor([1, 2, 3, 4]), st)
    assert out.shape == (4, tiny.config.vocab_size) and st.pos == 4
    out = tiny.forward([7], st)
    assert out.shape == (1, tiny.config.vocab_size) and st.pos == 5


def test_generate_stays_callable_after_submodules_load():
    import kvfold.cli  # noqa: F401  (importing the submodule must not shadow the function)
    assert callable(kvfold.generate)


def test_last_only_returns_the_last_row_of_the_full_logits(tiny, monkeypatch):
    ids = random_ids(50, tiny.config.vocab_size, seed=8)
    full = tiny.forward(ids, tiny.new_state(capacity=50))
    monkeypatch.setattr(type(tiny), "max_chunk", 16)  # across internal chunks too
    last = tiny.forward(ids, tiny.new_state(capacity=50), last_only=True)
    assert last.shape == (1, tiny.config.vocab_size)
    # other chunk shapes, the same logits: two fp32 paths (another row is off by O(max|logit|))
    assert (last[0] - full[-1]).abs().max().item() < fp32_paths_bound(full[-1], tiny.config.num_hidden_layers)


def test_returned_logits_are_ordinary_tensors_callers_may_edit(tiny):
    st = tiny.new_state(capacity=8)
    logits, hidden = tiny.forward([1, 2, 3], st, return_hidden=True)
    assert not logits.is_inference() and not hidden.is_inference()
    logits[:, 0] = float("-inf")  # e.g. a caller banning a token
    hidden.mul_(2)


def test_a_state_refuses_a_model_on_another_device_and_stays_as_it_was():
    # a state lives on one device (kvfold's form of the Dsv4State seed's dev_owned / dev_set: no
    # layer's caches can sit on the other side); "meta" stands in for a second device on a CPU host
    from kvfold.errors import StateMismatchError
    cfg = tiny_config(num_nextn_predict_layers=0)
    cpu = Dsv4Model(cfg, dtype=torch.float32)
    init_random_(cpu, 0)
    elsewhere = Dsv4Model(cfg, dtype=torch.float32, device="meta")
    with pytest.raises(StateMismatchError, match="lives on meta"):
        cpu.forward([1, 2, 3], elsewhere.new_state(capacity=32))
    st = cpu.new_state(capacity=32)
    cpu.forward([1, 2], st)
    before = st.snapshot()
    with pytest.raises(StateMismatchError, match="lives on cpu.*runs on meta"):
        elsewhere.forward([3], st)
    assert st.pos == 2 and st.snapshot() == before

"""GLM-5.3's MLA latent rows in the engine's shared `PagePool` (the growing per-token pool; the DSA
indexer rows stay in their flat `Glm5NextDsaState`, the seed contract). Paged states compute what
private ones do, a prefix is shared by reference and restored with the KDA state and indexer rows
of the snapshot at the block boundary, bit-identical to a cold run; shared pages are immutable;
refusals change nothing; page refcounts stay exact under a random engine workload."""
import random

import pytest
import torch

from kvfold import Engine, SamplingParams, errors
from kvfold.models.glm5 import state as g5s
from helpers import chunked_reference, random_ids
from test_engine_pages import assert_no_pages_but_the_caches, random_workload, run_all
from test_pages import fragmented_pool, run
from test_glm5_next import TEXT, pair, seq  # noqa: F401  (the tiny GLM-5.3 and its sequence)

V = TEXT["vocab_size"]


def buffers(st):
    """Every byte a state holds: latent rows (through its pages), indexer rows, KDA state and rings."""
    out = []
    for ls in st.layers:
        if isinstance(ls, g5s.KdaLayerState):
            out += [t.clone() for t in (ls.conv, ls.rec, ls.k, ls.g, ls.v, ls.beta, ls.mixed)]
        else:
            out.append(ls.latent[0:ls.latent.shape[0]].clone())
            if ls.dsa is not None:
                out.append(torch.frombuffer(bytearray(ls.dsa.snapshot_blob()), dtype=torch.uint8))
    return out


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model(pair):  # noqa: F811
    return pair[1]


@pytest.fixture(scope="module")
def ids(seq):  # noqa: F811
    return random_ids(300, V, seed=11).tolist()


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_paged_state_equals_private_state(model, ids, kv_dtype):
    chunks = (128, 100, 1, 1, 3, 30)
    cold = model.new_state(capacity=300, max_rewind=2, kv_dtype=kv_dtype)
    pool = fragmented_pool(model, 8, kv_dtype)
    st = model.new_state(capacity=300, max_rewind=2, kv_dtype=kv_dtype, pages=pool)
    table = st.page_table
    assert len(table) == 3 and any(b != a + 1 for a, b in zip(table, table[1:]))  # really scattered
    assert st.nbytes == cold.nbytes and pool.used_pages == 3
    assert torch.equal(run(model, st, ids, 0, chunks), run(model, cold, ids, 0, chunks))
    assert st.snapshot() == cold.snapshot()
    st.rewind_to(st.pos - 2)
    cold.rewind_to(cold.pos - 2)
    assert torch.equal(run(model, st, ids, 261, (4,)), run(model, cold, ids, 261, (4,)))
    st.free()
    st.free()  # idempotent: decrefs once
    assert pool.used_pages == 0 and pool.free_pages == 8
    with pytest.raises(errors.FreedStateError):
        model.forward(ids[:1], st)


def test_prefix_hit_reuses_pages_by_reference_and_is_bit_identical(model, ids):
    pool = model.new_page_pool(12)
    cold = model.new_state(capacity=300)
    ref = run(model, cold, ids, 0, (128, 128, 40, 1, 1))
    donor = model.new_state(capacity=300, pages=pool)
    run(model, donor, ids, 0, (128, 128))
    cached = donor.share_prefix(256)
    blob = donor.snapshot(pools=False)
    assert cached == donor.page_table[:2] and [pool.refcount(p) for p in cached] == [2, 2]
    assert len(blob) < len(donor.snapshot()) and g5s.FLAG_NO_POOLS & int.from_bytes(blob[12:16], "little")
    assert torch.equal(run(model, donor, ids, 256, (40, 1, 1)), ref[256:])  # the donor goes on, unchanged

    warm = model.new_state(capacity=300, pages=pool, prefix_pages=cached)
    assert warm.page_table[:2] == cached and set(warm.page_table[2:]).isdisjoint(donor.page_table)
    assert [pool.refcount(p) for p in cached] == [3, 3] and pool.shared_pages == 2
    warm.restore(blob)  # the KDA state and indexer rows at 256 from the blob, the latent rows by reference
    assert torch.equal(run(model, warm, ids, 256, (40, 1, 1)), ref[256:])
    assert warm.snapshot() == cold.snapshot()  # full snapshots read through the shared pages
    donor.free()
    warm.free()
    pool.decref(cached)
    assert pool.used_pages == 0 and all(pool.refcount(p) == 0 for p in range(pool.num_pages))


def test_shared_pages_are_immutable_and_refusals_change_nothing(model, ids):
    pool = model.new_page_pool(10)
    donor = model.new_state(capacity=300, max_rewind=4, pages=pool)
    run(model, donor, ids, 0, (128, 2))
    cached = donor.share_prefix(128)
    with pytest.raises(errors.RewindError):
        donor.rewind_to(127)  # below the shared boundary: would rewrite a shared page
    donor.rewind_to(128)
    blob, full = donor.snapshot(pools=False), donor.snapshot()
    latent = next(ls.latent for ls in donor.layers if isinstance(ls, g5s.MlaLayerState))
    with pytest.raises(errors.SharedPageWriteError):
        latent[0:1] = torch.zeros(1, latent.width)

    short = model.new_state(capacity=300, pages=pool)
    run(model, short, ids, 0, (100,))
    warm = model.new_state(capacity=300, pages=pool, prefix_pages=cached)
    before, refs = buffers(warm), pool.stats()
    with pytest.raises(errors.SharedPageWriteError):  # not restored yet: would write page 0
        model.forward(ids[:5], warm)
    with pytest.raises(errors.SharedPageWriteError):
        model.forward_batch([(ids[:5], warm)])
    with pytest.raises(errors.SnapshotPagesError):  # a full blob would rewrite the shared page
        warm.restore(full)
    with pytest.raises(errors.SnapshotPagesError):  # pos 100 != the 128 tokens its pages hold
        warm.restore(short.snapshot(pools=False))
    assert warm.pos == 0 and same(buffers(warm), before) and pool.stats() == refs

    private = model.new_state(capacity=300, max_rewind=4)  # the donor's KDA chunking (kda.py)
    before = buffers(private)
    with pytest.raises(errors.SnapshotPagesError):  # its latent rows would be missing
        private.restore(blob)
    assert private.pos == 0 and same(buffers(private), before)
    private.restore(full)  # a full blob of a paged state is an ordinary snapshot
    assert torch.equal(model.forward(ids[128:140], private), model.forward(ids[128:140], donor))
    with pytest.raises(errors.StateMismatchError):
        model.new_state(capacity=10, kv_dtype="fp8", pages=pool)  # a pool of plain latent rows
    short.free(), warm.free(), donor.free(), pool.decref(cached)
    assert pool.used_pages == 0


def test_engine_shares_pages_for_prefix_hits_and_choices(model, ids):
    engine = Engine(model, max_seq_len=400, max_running=4)
    assert engine.pages is not None and engine.pages.page_tokens == 128
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = run_all(engine)
    rid = engine.add_request(ids[:270], params)
    first = run_all(engine, first)
    rids = engine.add_choices(ids[:260] + [5, 6], [params] * 2)
    out = run_all(engine)
    assert engine.metrics()["prefix_cache_hits"] == 1 and engine.metrics()["prefix_cache_hit_tokens"] == 256
    want = chunked_reference(model, ids[:260] + [5, 6], 6, stop_ids=[])
    assert first[rid] == chunked_reference(model, ids[:270], 6, stop_ids=[])
    assert out[rids[0]] == out[rids[1]] == want
    assert_no_pages_but_the_caches(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_keeps_refcounts_exact(model, ids, seed):
    """Random arrivals and cancellations over a small pool (tests/test_engine_pages.py's workload,
    run there for DeepSeek-V4): refcounts exact at every step, finished requests equal cold runs."""
    page_bytes = model.new_page_pool(0).page_bytes
    engine = Engine(model, max_seq_len=400, max_running=3, max_batch_tokens=260, kv_page_bytes=8 * page_bytes,
                    prefix_cache_bytes=2_000_000)
    random_workload(engine, model, ids[:270], random.Random(seed), V, 30, 18, [2, 5, 20])

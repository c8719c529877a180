"""Compressed-KV pools in shared pages: paged states compute exactly what private states do, a
prefix is shared by reference (same physical pages, refcounts), shared pages are immutable, and
every refusal leaves pool, pages and state unchanged."""
import pytest
import torch

from kvfold import errors
from kvfold.models.deepseek_v4 import snapshot as snap
from kvfold.state.kv_rows import KvRows
from kvfold.state.pages import PagePool, PoolSpec
from helpers import random_ids
from test_dsv4_state import assert_unchanged, snapshot_buffers


@pytest.fixture(scope="module")
def ids(tiny):
    return random_ids(400, tiny.config.vocab_size, seed=5).tolist()


def run(model, state, ids, start, chunks):
    """Feed ids[start:] in the given chunk lengths; the logits of every token."""
    outs, p = [], start
    for c in chunks:
        outs.append(model.forward(ids[p:p + c], state))
        p += c
    return torch.cat(outs)


def fragmented_pool(model, n, kv_dtype=None):
    """A pool whose free list hands out non-consecutive pages (so gathers cross page runs)."""
    pool = model.new_page_pool(n, kv_dtype=kv_dtype)
    held = pool.allocate(n)
    pool.decref(held[1::2])
    pool.decref(held[0::2])
    return pool


def stats_of(pool):
    return pool.stats(), [pool.refcount(p) for p in range(pool.num_pages)]


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_paged_state_equals_private_state(tiny, ids, kv_dtype):
    chunks = (128, 100, 1, 1, 3, 30)
    cold = tiny.new_state(capacity=300, kv_dtype=kv_dtype)
    pool = fragmented_pool(tiny, 8, kv_dtype)
    st = tiny.new_state(capacity=300, kv_dtype=kv_dtype, pages=pool)
    table = st.page_table
    assert len(table) == 3 and any(b != a + 1 for a, b in zip(table, table[1:]))  # really scattered
    assert pool.pages_for(300) == 3 and pool.used_pages == 3
    assert st.nbytes == cold.nbytes  # the rows a state addresses, whatever holds them
    assert torch.equal(run(tiny, st, ids, 0, chunks), run(tiny, cold, ids, 0, chunks))
    assert st.snapshot() == cold.snapshot()
    st.free()
    st.free()  # idempotent: decrefs once
    assert pool.used_pages == 0 and pool.free_pages == 8
    with pytest.raises(errors.FreedStateError):
        tiny.forward(ids[:1], st)


def test_paged_rows_read_and_write_like_kv_rows():
    spec = PoolSpec(0, "compressor", 4, 6)
    pool = PagePool([spec], 5, 8, torch.float32, torch.device("cpu"))  # 2 rows per page
    a = pool.allocate(5)
    table = [a[3], a[0], a[1], a[4], a[2]]  # one consecutive run (a[0], a[1]), the rest scattered
    view = pool.view(0, "compressor", table, 9)  # 9 rows over 5 pages, last page half used
    ref = KvRows(9, 6, torch.float32, "cpu")
    rows = torch.randn(9, 6)
    view[0:3] = rows[0:3]
    view[3:9] = rows[3:9]  # crosses non-consecutive pages
    ref[0:9] = rows
    assert view.shape == (9, 6) and view.nbytes == ref.nbytes
    assert torch.equal(view[:], ref[:]) and torch.equal(view[2:7], ref[2:7]) and view[5:5].shape == (0, 6)
    assert torch.equal(view[4], ref[4]) and torch.equal(view[-1], ref[-1])
    sel = torch.tensor([[8, 0, 3], [2, 2, 7]])
    assert torch.equal(view[sel], ref[sel]) and view[sel].shape == (2, 3, 6)
    assert torch.equal(view[torch.zeros(2, 0, dtype=torch.long)], ref[torch.zeros(2, 0, dtype=torch.long)])
    # physical placement: logical row i sits in page table[i // 2], slot i % 2
    phys = pool.storages[(0, "compressor")].data
    for i in range(9):
        assert torch.equal(phys[table[i // 2] * 2 + i % 2], rows[i])
    with pytest.raises(TypeError):
        view[torch.tensor([1, 2])] = rows[:2]


def test_allocation_and_refcount_refusals_change_nothing(tiny):
    pool = tiny.new_page_pool(3)
    held = pool.allocate(1)
    before = stats_of(pool)
    with pytest.raises(errors.PagesExhaustedError):
        tiny.new_state(capacity=3 * 128, pages=pool)  # needs 3 pages, 2 are free
    with pytest.raises(errors.PagesExhaustedError):  # the prefix page's incref is rolled back too
        tiny.new_state(capacity=4 * 128, pages=pool, prefix_pages=held)
    with pytest.raises(errors.PagePoolError):
        tiny.new_state(capacity=128, pages=pool, prefix_pages=[2])  # a free page is nobody's prefix
    with pytest.raises(errors.PagePoolError):
        pool.decref([held[0], held[0]])  # refcount is 1
    with pytest.raises(errors.PagePoolError):
        pool.incref([held[0], 7])
    with pytest.raises(errors.StateMismatchError):
        tiny.new_state(capacity=10, kv_dtype="fp8", pages=pool)
    assert stats_of(pool) == before
    pool.decref(held)
    assert pool.free_pages == 3 and pool.shared_pages == 0


def test_prefix_hit_reuses_pages_by_reference_and_is_bit_identical(tiny, ids):
    pool = tiny.new_page_pool(12)
    cold = tiny.new_state(capacity=400)
    ref = run(tiny, cold, ids, 0, (128, 128, 44, 1, 1))

    donor = tiny.new_state(capacity=400, pages=pool)
    run(tiny, donor, ids, 0, (128, 128))
    cached = donor.share_prefix(256)  # what the prefix cache holds: 2 pages + a partial snapshot
    blob = donor.snapshot(pools=False)
    assert cached == donor.page_table[:2] and [pool.refcount(p) for p in cached] == [2, 2]
    assert len(blob) < len(donor.snapshot()) and snap.FLAG_NO_POOLS & int.from_bytes(blob[12:16], "little")
    assert torch.equal(run(tiny, donor, ids, 256, (44, 1, 1)), ref[256:])  # the donor goes on, unchanged

    warm = tiny.new_state(capacity=400, pages=pool, prefix_pages=cached)
    assert warm.page_table[:2] == cached  # the same physical pages, not copies
    assert set(warm.page_table[2:]).isdisjoint(donor.page_table)
    assert [pool.refcount(p) for p in cached] == [3, 3] and pool.shared_pages == 2
    assert pool.used_pages == 4 + 2  # donor's 4 pages + warm's 2 own pages
    warm.restore(blob)
    assert torch.equal(run(tiny, warm, ids, 256, (44, 1, 1)), ref[256:])
    assert warm.snapshot() == cold.snapshot()  # full snapshots read through the shared pages

    donor.free()
    assert [pool.refcount(p) for p in cached] == [2, 2]
    warm.free()
    pool.decref(cached)  # the cache lets go: nothing is left allocated
    assert pool.used_pages == 0 and pool.shared_pages == 0
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))


def test_shared_pages_are_immutable_and_refusals_change_nothing(tiny, ids):
    pool = tiny.new_page_pool(10)
    donor = tiny.new_state(capacity=300, max_rewind=8, pages=pool)
    run(tiny, donor, ids, 0, (128, 2))
    cached = donor.share_prefix(128)
    with pytest.raises(errors.RewindError):
        donor.rewind_to(127)  # below the shared boundary: would rewrite a shared page
    donor.rewind_to(128)
    blob = donor.snapshot(pools=False)
    full = donor.snapshot()
    pool_rows = donor.layers[1].compressor.pool
    with pytest.raises(errors.SharedPageWriteError):
        pool_rows[0:1] = torch.zeros(1, pool_rows.width)

    short = tiny.new_state(capacity=300, pages=pool)
    run(tiny, short, ids, 0, (100,))
    warm = tiny.new_state(capacity=300, pages=pool, prefix_pages=cached)
    before, refs = snapshot_buffers(warm), stats_of(pool)
    with pytest.raises(errors.SharedPageWriteError):  # not restored yet: would write page 0
        tiny.forward(ids[:5], warm)
    with pytest.raises(errors.SharedPageWriteError):
        tiny.forward_batch([(ids[:5], warm)])
    with pytest.raises(errors.SnapshotPagesError):  # a full blob would rewrite the shared page
        warm.restore(full)
    with pytest.raises(errors.SnapshotPagesError):  # pos 100 != the 128 tokens its pages hold
        warm.restore(short.snapshot(pools=False))
    assert_unchanged(warm, before, 0)
    assert stats_of(pool) == refs

    private = tiny.new_state(capacity=300)
    before = snapshot_buffers(private)
    with pytest.raises(errors.SnapshotPagesError):  # its pool rows would be missing
        private.restore(blob)
    assert_unchanged(private, before, 0)
    private.restore(full)  # a full blob of a paged state is an ordinary snapshot
    assert torch.equal(tiny.forward(ids[128:140], private), tiny.forward(ids[128:140], donor))
    short.free(), warm.free(), donor.free(), pool.decref(cached)
    assert pool.used_pages == 0


def test_old_full_blobs_restore_into_paged_states(tiny, ids):
    cold = tiny.new_state(capacity=300)
    run(tiny, cold, ids, 0, (128, 17))
    blob = cold.snapshot()
    assert int.from_bytes(blob[12:16], "little") == 0  # full snapshots keep the version-1 header
    pool = tiny.new_page_pool(3)
    st = tiny.new_state(capacity=300, pages=pool)
    st.restore(blob)
    assert st.snapshot() == blob
    assert torch.equal(run(tiny, st, ids, 145, (3, 1)), run(tiny, cold, ids, 145, (3, 1)))
    st.free()
    assert pool.free_pages == 3

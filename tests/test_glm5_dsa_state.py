"""GLM-5.3 DSA indexer state and selection.

State: capacity rounding, cursor edges, blob round trips and ordered refusals that change nothing,
rewind/re-advance, idempotent free, geometry. The selection is tested in test_glm5_dsa_select.py.
"""
from __future__ import annotations

import dataclasses
import gc
import struct
import weakref

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from kvfold.errors import (CapacityError, ConfigError, FreedStateError, RewindError, SnapshotCapacityError,
                           SnapshotError, SnapshotModelError, SnapshotSizeError, SnapshotTruncatedError,
                           StateError, StateMismatchError)
from kvfold.models.glm5.indexer_state import (Glm5NextDsaConfig, Glm5NextDsaState, dsa_blob_bytes, dsa_capacity,
                                              indexer_state_bytes)


# ---- helpers -------------------------------------------------------------------------------------
def filled(max_context: int, d: int, kp: int, n: int, seed: int = 0, dtype=torch.bfloat16) -> Glm5NextDsaState:
    """A state with n random rows written and advanced over (valid = 1)."""
    s = Glm5NextDsaState(max_context, d, kp, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    s.write_rows(0, torch.randn(n, d, generator=g), torch.randn(n, d, generator=g))
    s.advance(n)
    return s


def buffers(s: Glm5NextDsaState) -> list[torch.Tensor]:
    return [s.k_normed.clone(), s.gate.clone(), s.valid.clone()]


def assert_unchanged(s: Glm5NextDsaState, before: list[torch.Tensor], length: int) -> None:
    assert s.len == length
    for a, b in zip(before, buffers(s)):
        assert torch.equal(a, b)


def make_blob(rows: int, d: int) -> bytes:
    """A well-formed bf16 blob of `rows` rows of width d (body bytes all 1)."""
    return struct.pack("<QQ", rows, d) + b"\x01" * (rows * (4 * d + 1))


# ---- capacity and cursor -----------------------------------------------------------------------
def test_capacity_rounds_down_to_whole_pools():
    assert dsa_capacity(16386, 4) == 16384
    assert dsa_capacity(1001, 8) == 1000
    assert dsa_capacity(7, 0) == 7  # kp 0 is treated as 1
    assert dsa_capacity(3, 4) == 0
    s = Glm5NextDsaState(16386, 128, 4)
    assert s.capacity == 16384 and s.len == 0 and s.is_empty() and s.index_head_dim == 128
    assert s.k_normed.shape == s.gate.shape == (16384, 128) and s.valid.shape == (16384,)
    assert s.k_normed.dtype == s.gate.dtype == torch.bfloat16 and s.valid.dtype == torch.uint8
    assert not s.k_normed.any() and not s.gate.any() and not s.valid.any()  # allocated zeroed
    # rows: 16384 x 513 B; the pooled-key cache: one bf16 key row and a validity byte per pool of 4
    assert indexer_state_bytes(16384, 128) == 8_404_992 == 16384 * 513
    assert s.nbytes == indexer_state_bytes(16384, 128, index_kpool=4) == 16384 * 513 + 4096 * (2 * 128 + 1)
    assert 11 * s.nbytes < 100 * 2**20
    assert Glm5NextDsaState.alloc(Glm5NextDsaConfig(index_kpool=8, max_context=1001)).capacity == 1000


def test_dtype_and_row_offset():
    s = Glm5NextDsaState(1024, 128, 4)
    assert s.row_offset(1000) == 256_000 and s.row_offset(0) == 0
    for p in (1, 7, 1000):  # the byte offset really is where row p starts in both row buffers
        assert s.k_normed[p].data_ptr() - s.k_normed.data_ptr() == s.row_offset(p)
        assert s.gate[p].data_ptr() - s.gate.data_ptr() == s.row_offset(p)
    f = Glm5NextDsaState(8, 16, 4, dtype=torch.float32)
    assert f.k_normed.dtype == torch.float32 and f.row_offset(3) == 3 * 16 * 4
    assert f.nbytes == indexer_state_bytes(8, 16, torch.float32, index_kpool=4) == 8 * (2 * 16 * 4 + 1) + 2 * (16 * 4 + 1)


def test_advance_cap_edges_and_refusals_keep_len():
    s = Glm5NextDsaState(10, 4, 4)  # capacity 8
    assert s.capacity == 8
    s.advance(5)
    with pytest.raises(CapacityError, match="max-seq-len"):
        s.advance(4)
    assert s.len == 5
    s.advance(3)  # landing exactly on the cap is allowed
    assert s.len == 8
    s.ensure_room(0)
    s.ensure_room_through(8)
    for call in (lambda: s.advance(1), lambda: s.ensure_room(1), lambda: s.ensure_room_through(9)):
        with pytest.raises(CapacityError) as e:
            call()
        assert type(e.value) is CapacityError and isinstance(e.value, StateError)
        assert s.len == 8
    with pytest.raises(StateError) as e:
        s.advance(-1)
    assert type(e.value) is StateError
    assert s.len == 8


def test_rewind_only_shrinks():
    s = filled(64, 4, 4, 10)
    before = buffers(s)
    for n in (11, 100, -1):
        with pytest.raises(RewindError) as e:
            s.rewind_to(n)
        assert type(e.value) is RewindError
        assert_unchanged(s, before, 10)
    s.rewind_to(10)
    assert s.len == 10
    s.rewind_to(3)
    assert s.len == 3
    assert_unchanged(s, before, 3)  # rows past len stay in memory, unreachable
    assert s.reachable()[0].shape == (3, 4)


def test_sync_to_rewinds_when_ahead_refuses_when_behind():
    s = filled(16, 4, 4, 10)  # capacity 16
    s.sync_to(10, 2)  # on time: plain advance
    assert s.len == 12
    s.sync_to(9, 3)  # ahead (rejected draft): rewind to 9, then advance 3
    assert s.len == 12
    with pytest.raises(RewindError, match="missing"):
        s.sync_to(13, 1)  # behind
    assert s.len == 12
    with pytest.raises(CapacityError):
        s.sync_to(9, 8)  # 17 > 16: refused before the rewind, so len stays where it was
    assert s.len == 12
    s.sync_to(8, 8)  # exactly the cap
    assert s.len == 16


def test_write_rows():
    s = Glm5NextDsaState(16, 4, 4)
    rows = torch.arange(8.0).view(2, 4)
    s.write_rows(0, rows, -rows)
    assert s.len == 0  # writing does not advance
    assert torch.equal(s.k_normed[:2], rows.bfloat16()) and torch.equal(s.gate[:2], -rows.bfloat16())
    assert s.valid[:2].tolist() == [1, 1]
    s.advance(2)
    s.write_rows(2, rows, rows, valid=torch.tensor([False, True]))  # padding row
    assert s.valid[2:4].tolist() == [0, 1]
    s.write_rows(1, rows, rows)  # below len: a replay over a rejected draft
    before = buffers(s)
    for call, error in ((lambda: s.write_rows(3, rows, rows), StateError),  # gap: rows [2, 3) never written
                        (lambda: s.write_rows(15, rows, rows), StateError),  # a gap, checked before the capacity
                        (lambda: s.write_rows(2, torch.zeros(15, 4), torch.zeros(15, 4)), CapacityError),  # past it
                        (lambda: s.write_rows(0, rows, rows[:1]), StateError),
                        (lambda: s.write_rows(0, torch.zeros(2, 5), torch.zeros(2, 5)), StateError),
                        (lambda: s.write_rows(0, rows, rows, valid=torch.ones(3)), StateError)):
        with pytest.raises(StateError) as e:
            call()
        assert type(e.value) is error
        assert_unchanged(s, before, 2)


def test_free_is_idempotent_and_later_use_raises():
    s = filled(16, 4, 4, 5)
    refs = [weakref.ref(t) for t in (s.k_normed, s.gate, s.valid)]
    s.free()
    gc.collect()
    assert all(r() is None for r in refs)  # the buffers are really released
    assert s.released and s.len == 0 and s.nbytes == 0
    s.free()  # second call: nothing
    assert s.released and s.len == 0
    calls = [lambda: s.advance(1), lambda: s.ensure_room(0), lambda: s.ensure_room_through(0),
             lambda: s.rewind_to(0), lambda: s.sync_to(0, 0), lambda: s.snapshot_blob(),
             lambda: s.restore_blob(make_blob(0, 4)), lambda: s.geometry(Glm5NextDsaConfig(index_head_dim=4), 1),
             lambda: s.write_rows(0, torch.zeros(1, 4), torch.zeros(1, 4)), lambda: s.reachable(),
             lambda: s.k_normed]
    for call in calls:
        with pytest.raises(FreedStateError) as e:
            call()
        assert type(e.value) is FreedStateError


def test_alloc_free_cycles_leak_nothing():
    refs = []
    for i in range(100):
        s = Glm5NextDsaState(64, 8, 4)
        refs += [weakref.ref(t) for t in (s.k_normed, s.gate, s.valid)]
        s.free()
        s.free()
    gc.collect()
    assert all(r() is None for r in refs)


# ---- blob round trip ----------------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 1, 4, 255, 256, 1023, 4096])
def test_blob_round_trip(length):
    s = filled(4096, 128, 4, length, seed=length)
    s.valid[:length:3] = 0  # padding rows travel too
    blob = s.snapshot_blob()
    assert len(blob) == 16 + 513 * length == dsa_blob_bytes(length, 128)
    assert struct.unpack_from("<QQ", blob) == (length, 128)
    expect = [t[:length].clone() for t in buffers(s)]
    # overwrite everything, move len, then restore
    g = torch.Generator().manual_seed(99)
    s.rewind_to(0)
    s.write_rows(0, torch.randn(4096, 128, generator=g), torch.randn(4096, 128, generator=g))
    s.advance(17)
    s.restore_blob(blob)
    assert s.len == length
    for a, b in zip(expect, s.reachable()):  # byte-exact, not just numerically equal
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
    assert s.snapshot_blob() == blob
    # the size does not depend on capacity: a bigger state gives the same bytes, and takes them
    big = Glm5NextDsaState(8192, 128, 4)
    big.restore_blob(blob)
    assert big.len == length and big.snapshot_blob() == blob


def test_blob_in_other_dtype_is_raw_rows_of_that_dtype():
    s = filled(16, 4, 4, 3, dtype=torch.float32)
    blob = s.snapshot_blob()
    assert len(blob) == 16 + 3 * (2 * 4 * 4 + 1) == dsa_blob_bytes(3, 4, torch.float32)
    bf = Glm5NextDsaState(16, 4, 4)
    with pytest.raises(SnapshotSizeError):  # same width, other dtype: the byte count gives it away
        bf.restore_blob(blob)
    t = Glm5NextDsaState(16, 4, 4, dtype=torch.float32)
    t.restore_blob(blob)
    assert torch.equal(t.reachable()[0], s.reachable()[0])


# ---- refusals -----------------------------------------------------------------------------------
@pytest.fixture()
def target():
    """A state holding 7 rows, to restore refused blobs into."""
    s = filled(4096, 128, 4, 7, seed=3)
    return s, buffers(s)


def blob_of(length: int, d: int = 128, seed: int = 1) -> bytes:
    return filled(8192, d, 4, length, seed=seed).snapshot_blob()


def refuse(target, blob, error):
    s, before = target
    with pytest.raises(error) as e:
        s.restore_blob(blob)
    assert type(e.value) is error and isinstance(e.value, SnapshotError)
    assert isinstance(e.value, StateError)
    assert_unchanged(s, before, 7)
    return e.value


def test_truncated_blobs_are_refused(target):
    blob = blob_of(100)
    for cut in (0, 8, 15):
        refuse(target, blob[:cut], SnapshotTruncatedError)
    for cut in (16, len(blob) - 1):
        refuse(target, blob[:cut], SnapshotSizeError)


def test_other_width_is_refused(target):
    e = refuse(target, blob_of(100, d=64), SnapshotModelError)
    assert isinstance(e, StateMismatchError)
    # width is checked before size: a d=64 header over a body that fits d=128 is still "width"
    body = blob_of(100)[16:]
    refuse(target, struct.pack("<QQ", 100, 64) + body, SnapshotModelError)


@pytest.mark.parametrize("header_len", [99, 101, 0])
def test_header_len_off_in_either_direction_is_a_size_mismatch(target, header_len):
    body = blob_of(100)[16:]
    refuse(target, struct.pack("<QQ", header_len, 128) + body, SnapshotSizeError)


def test_over_capacity_is_refused_not_clamped():
    s = Glm5NextDsaState(4096, 128, 4)
    blob = blob_of(8192)
    with pytest.raises(SnapshotCapacityError, match="max-seq-len") as e:
        s.restore_blob(blob)
    assert isinstance(e.value, CapacityError)
    assert s.len == 0 and not s.k_normed.any() and not s.valid.any()


def test_refusal_order(target):
    # truncated beats width; width beats size; size beats capacity
    refuse(target, struct.pack("<QQ", 5, 64)[:15], SnapshotTruncatedError)
    refuse(target, struct.pack("<QQ", 5, 64) + b"\0" * 3, SnapshotModelError)
    refuse(target, struct.pack("<QQ", 10_000, 128) + b"\0" * 3, SnapshotSizeError)
    refuse(target, struct.pack("<QQ", 4097, 128) + b"\0" * (4097 * 513), SnapshotCapacityError)


# hypothesis: structural mutations of a valid blob are always refused with the typed error
D, CAP, ROWS = 8, 16, 5
ROW_BYTES = 4 * D + 1


def expected_refusal(blob: bytes) -> type[SnapshotError] | None:
    """Which refusal the documented order gives (None: a well-formed blob that fits)."""
    if len(blob) < 16:
        return SnapshotTruncatedError
    rows, d = struct.unpack_from("<QQ", blob)
    if d != D:
        return SnapshotModelError
    if len(blob) != 16 + rows * ROW_BYTES:
        return SnapshotSizeError
    if rows > CAP:
        return SnapshotCapacityError
    return None


BASE = filled(CAP, D, 4, ROWS, seed=11).snapshot_blob()
u64 = st.integers(0, 2**64 - 1)
mutations = st.one_of(
    st.integers(0, len(BASE) - 1).map(lambda n: BASE[:n]),  # truncate
    st.binary(min_size=1, max_size=64).map(lambda extra: BASE + extra),  # extend
    u64.filter(lambda n: n != ROWS).map(lambda n: struct.pack("<Q", n) + BASE[8:]),  # header len
    u64.filter(lambda d: d != D).map(lambda d: BASE[:8] + struct.pack("<Q", d) + BASE[16:]),  # header d
    st.tuples(u64, st.integers(0, 400)).map(  # header len and body length both changed
        lambda t: struct.pack("<QQ", t[0], D) + b"\x07" * t[1]),
    st.integers(CAP + 1, 3 * CAP).map(  # well formed, but more rows than the cap
        lambda n: struct.pack("<QQ", n, D) + b"\x01" * (n * ROW_BYTES)),
    st.binary(max_size=300),  # noise
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=mutations)
def test_mutated_blobs_are_refused_and_change_nothing(blob):
    error = expected_refusal(blob)
    assume(error is not None)  # e.g. a header len change with a body that happens to fit
    s = filled(CAP, D, 4, 3, seed=12)
    before = buffers(s)
    with pytest.raises(SnapshotError) as e:
        s.restore_blob(blob)
    assert type(e.value) is error
    assert_unchanged(s, before, 3)


# ---- rewind and re-advance ----------------------------------------------------------------------
def test_rewind_then_readvance_reproduces_rows():
    s = filled(512, 128, 4, 500, seed=5)
    blob500 = s.snapshot_blob()
    s.rewind_to(300)
    blob300 = s.snapshot_blob()
    assert len(blob300) == 16 + 300 * 513
    key_bytes = 300 * 128 * 2
    assert blob300[16:16 + key_bytes] == blob500[16:16 + key_bytes]  # 300-row keys prefix 500-row keys
    with pytest.raises(RewindError):
        s.rewind_to(301)
    s.advance(200)  # the rows are still there
    assert s.snapshot_blob() == blob500
    # re-writing the same rows after a rewind reproduces them too
    k, g, v = (t.clone() for t in s.reachable())
    s.rewind_to(300)
    s.write_rows(300, torch.randn(200, 128), torch.randn(200, 128))
    s.write_rows(300, k[300:], g[300:])
    s.advance(200)
    assert s.snapshot_blob() == blob500


# ---- geometry -----------------------------------------------------------------------------------
def ref_geometry(seq: int, kp: int, topk: int, tail: bool) -> dict:
    """Counted, not computed: pools enumerated one by one."""
    pools_complete = sum(1 for p in range(seq + 1) if (p + 1) * kp <= seq)
    pools_any = sum(1 for p in range(seq + 1) if p * kp < seq)
    np2 = 1
    while np2 < pools_complete:
        np2 *= 2
    np2 = min(max(np2, 2), 2048)
    return dict(n_pools=pools_complete, n_pools_full=pools_any, select_k=min(topk // kp, pools_complete),
                out_width=topk + (kp - 1 if tail else 0), topk_np2=np2, topk_smem=16 * np2)


@pytest.mark.parametrize("kp", [1, 2, 3, 4, 8])
def test_geometry_matches_counted_pools(kp):
    topk = 24  # divisible by every kp above
    cfg = Glm5NextDsaConfig(index_head_dim=1, index_heads=2, index_topk=topk, index_kpool=kp, max_context=264)
    s = Glm5NextDsaState.alloc(cfg)
    with pytest.raises(StateError) as e:
        s.geometry(cfg, 1)  # seq 0
    assert type(e.value) is StateError
    for seq in range(1, 258):
        s.rewind_to(0)
        s.advance(seq)
        for q_rows in {1, seq}:
            g = s.geometry(cfg, q_rows)
            got = {f: getattr(g, f) for f in ref_geometry(seq, kp, topk, True)}
            assert got == ref_geometry(seq, kp, topk, True), (seq, q_rows)
            assert (g.seq, g.q_rows, g.index_head_dim, g.index_heads, g.index_kpool) == (seq, q_rows, 1, 2, kp)
    assert s.geometry(dataclasses.replace(cfg, always_select_tail=False), 1).out_width == topk


def test_geometry_documented_values_and_refusals():
    cfg = Glm5NextDsaConfig(index_head_dim=1)  # topk 2048, kp 4
    s = Glm5NextDsaState.alloc(cfg)
    expect = {8192: (512, 2048), 400: (100, 128), 1200: (300, 512), 16384: (512, 2048), 3: (0, 2), 4: (1, 2)}
    for seq, (select_k, np2) in expect.items():
        s.rewind_to(0)
        s.advance(seq)
        g = s.geometry(cfg, 1)
        assert (g.select_k, g.topk_np2, g.topk_smem, g.out_width) == (select_k, np2, 16 * np2, 2051)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.seq = 1
    s.advance(16384 - s.len)
    for bad_cfg, q_rows, error in [
            (cfg, 0, StateError), (cfg, 16385, StateError),
            (dataclasses.replace(cfg, index_kpool=0), 1, ConfigError),
            (dataclasses.replace(cfg, index_topk=2046), 1, ConfigError),  # not a multiple of kp
            (dataclasses.replace(cfg, index_head_dim=2), 1, StateMismatchError),  # not this state's width
            (dataclasses.replace(cfg, index_topk=16384), 1, ConfigError)]:  # select_k 4096 > one tile
        with pytest.raises(error) as e:
            s.geometry(bad_cfg, q_rows)
        assert type(e.value) is error
    assert s.len == 16384


def test_pooled_keys_kept_between_calls_equal_pooling_every_row():
    """The state keeps the complete pools' keys (`pooled`); after appends one row or many at a
    time, left padding, a rewind and a rewrite, and a restore, the selectable pools' keys, their
    rows and validity equal `dsa_pool_keys` over every row, bit for bit."""
    from kvfold.models.glm5.dsa_select import dsa_pool_keys
    g = torch.Generator().manual_seed(0)
    d, kp = 16, 4
    s = Glm5NextDsaState(256, d, kp, dtype=torch.float32)
    ape = torch.randn(kp, d, generator=g)

    def append(n, valid=None):
        s.write_rows(s.len, torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), valid)
        s.advance(n)

    def check():
        k, gate, valid = s.readable()
        keys, rows, ok = dsa_pool_keys(k, gate, valid, ape, kp)
        got_keys, got_rows, got_ok = s.pooled(ape, kp)
        assert torch.equal(got_ok, ok) and torch.equal(got_rows, rows)
        assert torch.equal(got_keys[ok], keys[ok])

    append(3, torch.zeros(3))  # left padding: pools start at row 3
    for n in (1, 1, 5, 7, 1, 1, 1, 13, 2):
        append(n)
        check()
    assert s._pooled == (s.len - 3) // kp  # the complete pools are kept
    s.rewind_to(s.len - 6)  # a rejected draft, then other rows in its place
    append(9)
    check()
    other = Glm5NextDsaState(256, d, kp, dtype=torch.float32)
    other.write_rows(0, torch.randn(40, d, generator=g), torch.randn(40, d, generator=g))
    other.advance(40)
    s.restore_blob(other.snapshot_blob())
    check()
    append(4)
    check()

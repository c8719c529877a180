"""Snapshot/restore and rewind are exact: continuing gives bit-identical logits."""
import pytest
import torch

import kvfold
from kvfold import errors
from kvfold.models.deepseek_v4 import snapshot as snap
from helpers import fp32_paths_bound, random_ids
from test_dsv4_state import assert_unchanged, snapshot_buffers

# tiny: window 32, CSA ratio 4, HCA ratio 32
POSITIONS = [0, 1, 3, 4, 5, 7, 8, 31, 32, 33, 63, 64, 65, 95, 96, 97]


@pytest.fixture(scope="module")
def seq(tiny):
    return random_ids(140, tiny.config.vocab_size, seed=21)


def continue_after(model, state, ids, start, chunks=(3, 1, 1, 9, 1, 20)):
    outs, p = [], start
    for c in chunks:
        outs.append(model.forward(ids[p:p + c], state))
        p += c
    return torch.cat(outs)


@pytest.mark.parametrize("pos", POSITIONS)
def test_restore_continues_bit_identically(tiny, seq, pos):
    a = tiny.new_state(capacity=200)
    if pos:
        tiny.forward(seq[:pos], a)
    blob = a.snapshot()
    straight = continue_after(tiny, a, seq, pos)
    b = tiny.new_state(capacity=150, max_rewind=5)
    b.restore(blob)
    assert b.pos == pos
    assert torch.equal(continue_after(tiny, b, seq, pos), straight)


def test_snapshot_holds_only_rows_in_use(tiny, seq):
    st = tiny.new_state(capacity=4096)
    tiny.forward(seq[:100], st)
    blob = st.snapshot()
    assert len(blob) < st.nbytes / 5  # capacity-sized pools are not copied
    secs = snap.expected_sections(st, 100)
    window = [s for s in secs if s.kind == snap.WINDOW]
    assert all(s.rows == tiny.config.sliding_window - 1 for s in window)


def make_blob(tiny, seq, n=45):
    st = tiny.new_state(capacity=100)
    tiny.forward(seq[:n], st)
    return st.snapshot()


def corruptions(blob):
    hdr = snap._HEADER.size
    yield "truncated", blob[:20], errors.SnapshotTruncatedError
    yield "truncated table", blob[:hdr + 10], errors.SnapshotTruncatedError
    yield "magic", b"XXXXXXXX" + blob[8:], errors.SnapshotMagicError
    yield "version", blob[:8] + (2).to_bytes(4, "little") + blob[12:], errors.SnapshotVersionError
    yield "model", blob[:16] + b"0" * 16 + blob[32:], errors.SnapshotModelError
    yield "dtype", blob[:32] + (2).to_bytes(4, "little") + blob[36:], errors.SnapshotDtypeError
    pos_field = 40
    yield "counts", blob[:pos_field] + (46).to_bytes(8, "little") + blob[pos_field + 8:], errors.SnapshotCountsError
    yield "missing bytes", blob[:-40] + blob[-32:], errors.SnapshotSizeError
    yield "trailing bytes", blob + b"\0", errors.SnapshotSizeError
    flipped = bytearray(blob)
    flipped[len(blob) - 100] ^= 1
    yield "checksum", bytes(flipped), errors.SnapshotChecksumError


def test_bad_blobs_are_refused_in_order_and_change_nothing(tiny, seq):
    blob = make_blob(tiny, seq)
    target = tiny.new_state(capacity=100)
    tiny.forward(seq[:10], target)
    before = snapshot_buffers(target)
    for name, bad, err in corruptions(blob):
        with pytest.raises(err):
            target.restore(bad)
        assert_unchanged(target, before, 10)
        assert issubclass(err, kvfold.StateError), name
    small = tiny.new_state(capacity=40)
    with pytest.raises(errors.SnapshotCapacityError, match="capacity"):
        small.restore(blob)
    assert small.pos == 0


def test_refusal_order_reports_the_first_problem(tiny, seq):
    blob = make_blob(tiny, seq)
    # bad magic and a bad checksum together: magic is reported
    bad = b"XXXXXXXX" + blob[8:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(errors.SnapshotMagicError):
        tiny.new_state(capacity=100).restore(bad)
    # wrong dtype and over capacity: dtype first
    bf = kvfold.load_model("tiny-random", dtype=torch.bfloat16).new_state(capacity=10)
    with pytest.raises(errors.SnapshotDtypeError):
        bf.restore(blob)


def test_restore_into_state_of_other_model_is_refused(tiny, seq):
    from kvfold.models.deepseek_v4.model import Dsv4Model
    from kvfold.models.deepseek_v4.tiny import tiny_config
    other = Dsv4Model(tiny_config(index_topk=8))
    with pytest.raises(kvfold.StateMismatchError):
        other.new_state(capacity=100).restore(make_blob(tiny, seq))


def test_restoring_one_sequence_leaves_another_untouched(tiny, seq):
    a, b = tiny.new_state(capacity=100), tiny.new_state(capacity=100)
    tiny.forward(seq[:30], b)
    before = snapshot_buffers(b)
    a.restore(make_blob(tiny, seq))
    assert_unchanged(b, before, 30)


# ---- rewind ----------------------------------------------------------------------------------

@pytest.mark.parametrize("pos", [3, 4, 5, 8, 31, 32, 33, 63, 64, 65, 96])
@pytest.mark.parametrize("rejected", [0, 1, 3, 5])
def test_rejected_draft_rewinds_exactly(tiny, seq, pos, rejected):
    ref = tiny.new_state(capacity=200)
    tiny.forward(seq[:pos], ref)
    want = continue_after(tiny, ref, seq, pos, chunks=(4, 1, 1))

    st = tiny.new_state(capacity=200, max_rewind=5)
    tiny.forward(seq[:pos], st)
    drafted = random_ids(rejected, tiny.config.vocab_size, seed=pos)
    for tok in drafted:  # draft token by token past pos, crossing fold and window edges
        tiny.forward(tok[None], st)
    st.rewind_to(pos)
    assert torch.equal(continue_after(tiny, st, seq, pos, chunks=(4, 1, 1)), want)


def test_rejected_verify_chunk_rewinds_exactly(tiny, seq):
    ref = tiny.new_state(capacity=200)
    tiny.forward(seq[:62], ref)
    want = continue_after(tiny, ref, seq, 62, chunks=(5, 1))
    st = tiny.new_state(capacity=200, max_rewind=6)
    tiny.forward(seq[:62], st)
    tiny.forward(random_ids(6, 258, seed=3), st)  # one verify pass of 6 rows across the 64 edge
    st.rewind_to(62)
    assert torch.equal(continue_after(tiny, st, seq, 62, chunks=(5, 1)), want)


def test_rewind_refusals(tiny, seq):
    st = tiny.new_state(capacity=100, max_rewind=4)
    tiny.forward(seq[:20], st)
    with pytest.raises(kvfold.RewindError, match="only shrinks"):
        st.rewind_to(21)
    with pytest.raises(kvfold.RewindError, match="max_rewind=4"):
        st.rewind_to(15)
    assert st.pos == 20
    st.rewind_to(16)
    assert st.pos == 16


def test_sync_to_reconciles_a_verify_pass(tiny, seq):
    ref = tiny.new_state(capacity=100)
    tiny.forward(seq[:23], ref)
    want = tiny.forward(seq[23:26], ref)

    st = tiny.new_state(capacity=100, max_rewind=6)
    tiny.forward(seq[:18], st)
    tiny.forward(torch.cat([seq[18:21], random_ids(3, 258, seed=1)]), st)  # verify wrote 6 rows, 3 accepted
    with pytest.raises(kvfold.RewindError, match="behind"):
        st.sync_to(30, 0)
    st.sync_to(18, 3)
    assert st.pos == 21
    tiny.forward(seq[21:23], st)
    # rows 18..20 came from a 6-row chunk, the reference's from one chunk: same math, other shapes,
    # so two fp32 paths to the same logits; a kept rejected row moves them far beyond the bound
    bound = fp32_paths_bound(want, tiny.config.num_hidden_layers)
    assert (tiny.forward(seq[23:26], st) - want).abs().max().item() < bound

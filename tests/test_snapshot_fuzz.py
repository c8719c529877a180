"""Fuzz `state.restore`: every mutation of a valid snapshot is refused with a StateError, and the
target state is left exactly as it was."""
import collections
import hashlib
import struct

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import kvfold
from kvfold.models.deepseek_v4 import snapshot as snap
from helpers import random_ids
from test_dsv4_state import assert_unchanged, snapshot_buffers

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HDR = snap._HEADER.size  # 64
# (offset, width) of the header's fields
FIELDS = [(0, 8), (8, 4), (12, 4), (16, 16), (32, 4), (36, 4), (40, 8), (48, 8), (56, 8)]
TARGET_POS = 10

TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module", autouse=True)
def report():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is overhead-bound; extra threads only contend
    yield
    torch.set_num_threads(threads)
    for kind, c in sorted(TALLY.items()):
        print(f"\n[fuzz] {kind}: {sum(c.values())} refused: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))


@pytest.fixture(scope="module")
def blob(tiny):
    s = tiny.new_state(capacity=100)
    tiny.forward(random_ids(45, tiny.config.vocab_size, seed=4), s)  # past CSA/HCA folds and the window
    return s.snapshot()


@pytest.fixture(scope="module")
def target(tiny):
    s = tiny.new_state(capacity=100, max_rewind=3)
    tiny.forward(random_ids(TARGET_POS, tiny.config.vocab_size, seed=5), s)
    return s, snapshot_buffers(s)


def check_refused(kind, target, original, mutated):
    assume(mutated != original)
    state, before = target
    with pytest.raises(kvfold.StateError) as exc:  # anything else propagates and fails the test
        state.restore(mutated)
    TALLY[kind][type(exc.value).__name__] += 1
    assert_unchanged(state, before, TARGET_POS)
    assert state.written_until == TARGET_POS and state.rewind_floor == 0


def test_valid_blob_round_trips(tiny, blob):
    s = tiny.new_state(capacity=100)
    s.restore(blob)
    assert s.pos == 45 and s.snapshot() == blob


@SETTINGS
@given(data=st.data())
def test_bit_flips(blob, target, data):
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 7)), min_size=1, max_size=4))
    b = bytearray(blob)
    for off, bit in flips:
        b[off] ^= 1 << bit
    check_refused("bit flips", target, blob, bytes(b))


@SETTINGS
@given(data=st.data())
def test_truncation(blob, target, data):
    n = data.draw(st.one_of(st.integers(0, len(blob) - 1), st.integers(max(len(blob) - 80, 0), len(blob) - 1),
                            st.integers(0, HDR + 200)))
    check_refused("truncation", target, blob, blob[:n])


@SETTINGS
@given(data=st.data())
def test_extension_and_insertion(blob, target, data):
    extra = data.draw(st.binary(min_size=1, max_size=64))
    at = data.draw(st.one_of(st.just(len(blob)), st.integers(0, len(blob))))
    check_refused("extension", target, blob, blob[:at] + extra + blob[at:])


@SETTINGS
@given(data=st.data())
def test_header_field_edits(blob, target, data):
    off, width = data.draw(st.one_of(st.sampled_from(FIELDS),
                                     st.tuples(st.integers(0, 64), st.sampled_from([1, 2, 4, 8]))))
    value = data.draw(st.one_of(st.integers(0, 2 ** (8 * min(width, 8)) - 1), st.integers(0, 300)))
    raw = value.to_bytes(8, "little")[:width].ljust(width, b"\0")
    check_refused("header edits", target, blob, blob[:off] + raw + blob[off + width:])


def reseal(b: bytes) -> bytes:
    """Recompute the SHA-256 trailer, so only the semantic checks can catch the edit."""
    return b[:-32] + hashlib.sha256(b[:-32]).digest()


CHECKED_FIELDS = list(FIELDS)


@SETTINGS
@given(data=st.data())
def test_resealed_header_and_table_edits(blob, target, data):
    """Edits with a valid checksum: magic, version, fingerprint, dtype, counts, pos, body length
    and the section table are each checked on their own, not just by the checksum."""
    n_sec = struct.unpack_from("<I", blob, 36)[0]
    table_fields = [(HDR + 32 * i + o, w) for i in range(n_sec) for o, w in ((0, 4), (4, 4), (8, 8), (16, 8),
                                                                            (24, 4), (28, 4))]
    off, width = data.draw(st.one_of(st.sampled_from(CHECKED_FIELDS), st.sampled_from(table_fields)))
    value = data.draw(st.one_of(st.integers(0, 2 ** (8 * width) - 1), st.integers(0, 300)))
    raw = value.to_bytes(width, "little")
    check_refused("resealed edits", target, blob, reseal(blob[:off] + raw + blob[off + width:]))


@pytest.mark.parametrize("off", [12, 56])
def test_unknown_flags_or_reserved_bits_are_refused(tiny, blob, off):
    s = tiny.new_state(capacity=100)
    with pytest.raises(kvfold.StateError, match="flags"):
        s.restore(reseal(blob[:off] + b"\x02" + blob[off + 1:]))  # bit 0 of flags means FP8 KV
    assert s.pos == 0

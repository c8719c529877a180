"""FP8 KV storage: non-rope dims in float8_e4m3fn at unit scale, rope dims exact; every exactness
property of the plain state still holds, and the drift against fp32 KV stays small."""
import pytest
import torch

import kvfold
from kvfold import errors
from kvfold.state import kv_rows
from kvfold.state.kv_rows import KvRows, fp8_roundtrip
from helpers import fp32_paths_bound, random_ids


def run(model, ids, splits, **kw):
    st = model.new_state(capacity=300, **kw)
    outs, prev = [], 0
    for s in list(splits) + [len(ids)]:
        outs.append(model.forward(ids[prev:s], st))
        prev = s
    return torch.cat(outs), st


def test_rows_store_fp8_nope_and_exact_rope():
    rows = KvRows(4, 10, torch.float32, "cpu", fp8_nope=6)
    x = torch.randn(2, 10) * 100
    x[0, 0] = 1000.0  # saturates at 448
    rows[1:3] = x
    got = rows[1:3]
    assert torch.equal(got[:, 6:], x[:, 6:])  # rope dims exact
    assert got[0, 0].item() == 448.0
    assert torch.equal(got[:, :6], x[:, :6].clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(got, fp8_roundtrip(x, 6))
    rows[1:3] = got  # re-encoding decoded values is exact
    assert torch.equal(rows[1:3], got)
    assert rows.row_bytes == 6 + 4 * 4


def test_fp8_state_is_smaller_per_token(tiny):
    plain = tiny.state_bytes_per_token()
    fp8 = tiny.state_bytes_per_token(kv_dtype="fp8")
    assert fp8 < plain
    big = tiny.new_state(capacity=4096, kv_dtype="fp8").nbytes
    assert big < tiny.new_state(capacity=4096).nbytes


def test_fp8_chunked_and_token_by_token_match_full_prefill(tiny):
    # A row differs by ~1e-7 between chunkings before it is stored; where that straddles an FP8
    # rounding midpoint one element moves by a grid step, and later positions see it. So: the
    # chunkings agree to fp32 noise until such a flip, and stay far closer than FP8 itself moves
    # the logits away from plain KV. (fp32 noise: helpers.fp32_paths_bound, two fp32 paths.)
    ids = random_ids(140, tiny.config.vocab_size, seed=31)
    full, _ = run(tiny, ids, [], kv_dtype="fp8")
    plain, _ = run(tiny, ids, [])
    fp8_drift = (full - plain).abs().max().item()
    for splits in (range(1, 140), [3, 33, 64, 65, 100]):
        other, _ = run(tiny, ids, splits, kv_dtype="fp8")
        per_pos = (other - full).abs().amax(dim=-1)
        assert per_pos[:40].max().item() < fp32_paths_bound(full[:40], tiny.config.num_hidden_layers)
        assert per_pos.max().item() < 0.05 * fp8_drift


def test_fp8_drift_against_plain_kv_is_small(tiny, monkeypatch):
    """FP8 storage moves the logits (relative RMS, argmax agreement with plain KV) less than
    losing what the stored values hold: the yardstick is the same model and prompt with every
    FP8-stored value written as zero (the rope dims kept). The quantity is statistical, not a
    rounding bound: the tiny random model's indexer top-k and MoE routing make near-tied discrete
    choices, which any perturbation of the rows flips, each flip moving its position's logits by
    O(their scale). What bounds it is the size of the perturbation at each stored value: e4m3
    rounds to nearest with 3 mantissa bits, so it moves a value by at most 2^-4 of it in the
    normal range (RMS at most 2^-4 / sqrt(3) relative: the error is uniform over half a step),
    and never by more than the value itself
    (0 is on the grid, so the nearest point is no farther; saturation at 448 only moves a value
    toward 0), while the zero rows move every value by all of it: FP8's perturbation of the same
    sites is smaller element by element, 16 times or more over the normal range, and cannot be
    expected to move the logits as far. And FP8 must move them (it really rounds). A model that
    reads other rows' values or misreads the bytes moves each value by about as much as the zero
    rows or more, and fails; the encoding itself (e4m3 at unit scale, rope dims exact) is pinned bit
    for bit by test_rows_store_fp8_nope_and_exact_rope."""
    ids = random_ids(140, tiny.config.vocab_size, seed=32)
    plain, _ = run(tiny, ids, [])
    fp8, _ = run(tiny, ids, [], kv_dtype="fp8")
    encode = kv_rows.e4m3_saturate  # what KvRows and fp8_roundtrip store
    monkeypatch.setattr(kv_rows, "e4m3_saturate", lambda x: encode(torch.zeros_like(x)))
    lost, _ = run(tiny, ids, [], kv_dtype="fp8")

    def rel_rms(x):
        return ((x - plain).pow(2).mean() / plain.pow(2).mean()).sqrt().item()

    def agree(x):
        return (x.argmax(-1) == plain.argmax(-1)).float().mean().item()
    assert 0 < rel_rms(fp8) < rel_rms(lost) and agree(fp8) > agree(lost)


@pytest.mark.parametrize("pos", [5, 33, 64, 97])
def test_fp8_snapshot_restore_and_rewind_are_exact(tiny, pos):
    ids = random_ids(140, tiny.config.vocab_size, seed=33)
    a = tiny.new_state(capacity=200, max_rewind=4, kv_dtype="fp8")
    tiny.forward(ids[:pos], a)
    blob = a.snapshot()
    want = torch.cat([tiny.forward(ids[pos:pos + 3], a), tiny.forward(ids[pos + 3:pos + 4], a)])
    b = tiny.new_state(capacity=200, kv_dtype="fp8")
    b.restore(blob)
    assert torch.equal(torch.cat([tiny.forward(ids[pos:pos + 3], b), tiny.forward(ids[pos + 3:pos + 4], b)]), want)
    c = tiny.new_state(capacity=200, max_rewind=4, kv_dtype="fp8")
    tiny.forward(ids[:pos], c)
    tiny.forward(random_ids(4, 258, seed=pos), c)
    c.rewind_to(pos)
    assert torch.equal(torch.cat([tiny.forward(ids[pos:pos + 3], c), tiny.forward(ids[pos + 3:pos + 4], c)]), want)


def test_fp8_blob_into_plain_state_is_refused(tiny):
    a = tiny.new_state(capacity=50, kv_dtype="fp8")
    tiny.forward(random_ids(20, 258), a)
    plain = tiny.new_state(capacity=50)
    with pytest.raises(errors.SnapshotDtypeError, match="fp8"):
        plain.restore(a.snapshot())
    assert plain.pos == 0
    with pytest.raises(kvfold.ConfigError):
        tiny.new_state(capacity=10, kv_dtype="int4")

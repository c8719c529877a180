"""GLM-5.3 rewinds with one KDA state per layer plus the per-token inputs of the recurrence,
replayed on demand (kvfold/models/glm5/state.py). Every comparison is bit for bit (batch-invariant
mode, so a row's projections do not depend on the call length), against:
* kda_chunked over the accepted tokens' recorded inputs from the verify call's start state, i.e.
  what a forward of only those tokens computes from those inputs (every KDA layer);
* a state that only ever ran the accepted tokens, for the first KDA layer, whose inputs depend on
  nothing the call length changes. Deeper layers' inputs come from earlier layers' outputs at the
  accepted rows, and those (computed by the verify call itself, before any rewind) may differ in
  their last bits from a shorter call's: the chunked KDA form solves one triangular system per
  chunk, the DSA indexer's gate is a plain matmul. That is the forward's doing, before and after
  this change, so the end-to-end reference for the whole state is
* a state that ran the same calls with other rejected drafts, then rewound the same way."""
import pytest
import torch

import kvfold
from kvfold.models.glm5 import state as g5s
from kvfold.models.glm5.config import KDA, glm5_config_from_dict
from kvfold.models.glm5.kda import kda_chunked
from kvfold.models.glm5.model import Glm5Model
from kvfold.models.glm5.state import kda_ring_sizes
from helpers import random_ids
from test_glm5_next import TEXT, VISION, _randomize, seq  # noqa: F401  (the tiny config and its sequence)

V = TEXT["vocab_size"]
# the KDA layers first: what feeds them (embeddings, mHC, MLPs) is row-for-row the same in a verify
# call and in a shorter one, so a state that ran only the accepted tokens is a bit-exact reference
# for the KDA state. (A DSA layer's outputs at the accepted rows may move in their last bits with
# the call length, before and after this change: see `assert_same_state`.) The full DSA layer last.
KDA_FIRST = dict(TEXT, num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "indexed_attention"],
                 indexer_types=["full"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(KDA_FIRST), vision_config=VISION))
    _randomize(hf)
    d = tmp_path_factory.mktemp("glm5_kda_first")
    hf.save_pretrained(d)
    m = kvfold.load_model(d)
    m.set_batch_invariant(True)  # raises (no skip) where it cannot hold
    return m


def kda_tensors(st):
    """Each KDA layer's (conv, recurrent) state at st.pos, as the next forward would start from."""
    return [t for ls in st.layers if isinstance(ls, g5s.KdaLayerState) for t in st._kda_at(ls, st.pos)[:2]]


def assert_same_state(st, other):
    """The KDA tensors at pos, and the whole state (snapshot) byte for byte."""
    assert st.pos == other.pos
    a, b = kda_tensors(st), kda_tensors(other)
    assert len(a) == len(b) == 4 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert st.snapshot() == other.snapshot()


def verify_round(model, st, ref, y, truth, k, j, seed):
    """Feed y and k drafts (the first j of them the true continuation) in one call, accept j,
    rewind; the reference feeds y and the j accepted drafts only. Returns (next token, truth left)."""
    drafts = truth[:j].tolist() + random_ids(k - j, V, seed=seed).tolist()
    p0 = st.pos
    model.forward([y] + drafts, st)
    if j < k:
        st.rewind_to(p0 + 1 + j)
    model.forward([y] + drafts[:j], ref)
    return int(truth[j]), truth[j + 1:]


class Recorder:
    """Each KDA layer's (start state, KdaStep) of the last forward."""

    def __init__(self, model):
        self.calls, self.hooks = [], []
        for b in model.model.layers:
            if b.kind == KDA:
                self.hooks.append(b.self_attn.register_forward_hook(
                    lambda mod, inp, out: self.calls.append((inp[2].clone(), out[1]))))

    def close(self):
        for h in self.hooks:
            h.remove()


def replayed_by_hand(calls, m, km1):
    """What a forward of only the first m tokens of the recorded call computes from the same
    per-token inputs: kda_chunked over them from the call's start state, chunked as the call was."""
    out = []
    for rec0, step in calls:
        starts = [a for a in step.starts if a < m]
        _, rec, _ = kda_chunked(None, step.k[:m], step.v[:m], step.g[:m], step.beta[:m], rec0, starts=starts)
        out += [step.full[m:m + km1], rec]
    return out


@pytest.mark.parametrize("max_rewind", [1, 4, 8])
@pytest.mark.parametrize("prompt", [9, 62, 70])
def test_every_draft_length_and_acceptance(model, seq, max_rewind, prompt):  # noqa: F811
    """Draft lengths 0..max_rewind, every acceptance j of k: after the rewind, (a) every KDA layer's
    state is, bit for bit, kda_chunked over the accepted tokens' recorded inputs from the verify
    call's start state (a forward of those tokens); (b) the first KDA layer's state equals a state
    of the same max_rewind that only ran the accepted tokens (its inputs do not depend on the call
    length); (c) the whole
    state (snapshot) and the next logits equal those of a state whose rejected drafts were other
    tokens: nothing of the rejected tokens is left. Then a second round from there, the same."""
    km1 = model.config.linear_conv_kernel_dim - 1
    for k in range(max_rewind + 1):
        for j in range(k + 1):
            st, other = (model.new_state(capacity=160, max_rewind=max_rewind) for _ in range(2))
            ref = model.new_state(capacity=160, max_rewind=max_rewind)
            for s in (st, other, ref):
                model.forward(seq[:prompt], s)
            y, truth = int(seq[prompt]), seq[prompt + 1:]
            for rnd, (kk, jj) in enumerate(((k, j), (max_rewind - k, (max_rewind - k) // 2))):
                rec = Recorder(model)
                try:
                    y2, truth2 = verify_round(model, st, ref, y, truth, kk, jj, seed=100 * k + j + rnd)
                    calls = rec.calls[:2]
                finally:
                    rec.close()
                verify_round(model, other, model.new_state(capacity=160), y, truth, kk, jj, seed=999 + j + rnd)
                y, truth = y2, truth2
                assert st.pos == other.pos == ref.pos
                got = kda_tensors(st)
                assert all(torch.equal(a, b) for a, b in zip(got, replayed_by_hand(calls, jj + 1, km1)))  # (a)
                assert all(torch.equal(a, b) for a, b in zip(got[:2], kda_tensors(ref)[:2]))  # (b)
                if jj < kk:
                    assert st.snapshot() == other.snapshot()  # (c)
            assert torch.equal(model.forward([y], st), model.forward([y], other))


def test_random_speculative_rounds_match_the_accepted_calls(model, seq):  # noqa: F811
    """A long mix of rounds (some with no drafts, some rejecting everything) crossing KDA chunk
    ends: the state and logits equal those of a state whose rejected drafts were other tokens."""
    gen = torch.Generator().manual_seed(3)
    st, other = model.new_state(capacity=160, max_rewind=4), model.new_state(capacity=160, max_rewind=4)
    model.forward(seq[:5], st)
    model.forward(seq[:5], other)
    y, truth = int(seq[5]), seq[6:]
    r = 0
    while len(truth) > 6:
        k = int(torch.randint(0, 5, (1,), generator=gen))
        j = int(torch.randint(0, k + 1, (1,), generator=gen))
        verify_round(model, other, model.new_state(capacity=160), y, truth, k, j, seed=500 + r)
        y, truth = verify_round(model, st, model.new_state(capacity=160), y, truth, k, j, seed=r)
        assert_same_state(st, other)
        # the inputs of at most max_rewind tokens are held, and every position from there is a chunk start
        assert st.written_until - st.kda_base <= 4
        assert set(range(st.kda_base, st.written_until)) <= set(st.kda_cuts)
        r += 1
    assert torch.equal(model.forward([y], st), model.forward([y], other))


@pytest.mark.parametrize("length", [20, 63, 64, 66, 129])
def test_rewind_into_a_long_call_equals_the_call_cut_there(model, seq, length):  # noqa: F811
    """After one call of `length` tokens, rewinding to any n >= length - max_rewind gives the KDA
    state of that call cut at n from the same inputs, the first KDA layer's state of a state that
    ran only those n tokens (the call's 64-token chunks up to length - max_rewind, then one token
    at a time, as the call ran them), and the whole state of a call whose tokens past n were
    others."""
    r, km1 = 4, model.config.linear_conv_kernel_dim - 1
    for n in range(length - r, length + 1):
        st, other = model.new_state(capacity=140, max_rewind=r), model.new_state(capacity=140, max_rewind=r)
        rec = Recorder(model)
        try:
            model.forward(seq[:length], st)
            calls = rec.calls[:]
        finally:
            rec.close()
        model.forward(torch.cat([seq[:n], random_ids(length - n, V, seed=n)]), other)
        st.rewind_to(n)
        other.rewind_to(n)
        ref = model.new_state(capacity=140)
        model.forward(seq[:length - r], ref)
        for p in range(length - r, n):
            model.forward(seq[p:p + 1], ref)
        got = kda_tensors(st)
        assert all(torch.equal(a, b) for a, b in zip(got, replayed_by_hand(calls, n, km1)))
        assert all(torch.equal(a, b) for a, b in zip(got[:2], kda_tensors(ref)[:2]))
        assert st.snapshot() == other.snapshot()
        assert torch.equal(model.forward(seq[n:n + 3], st), model.forward(seq[n:n + 3], other))


def test_advance_and_sync_to_return_the_forward_bits(model, seq):  # noqa: F811
    st = model.new_state(capacity=100, max_rewind=4)
    model.forward(seq[:30], st)
    model.forward(seq[30:35], st)  # a verify call
    want = st.snapshot()
    st.rewind_to(31)
    st.advance(4)
    assert st.snapshot() == want
    st.sync_to(32, 3)  # rewind to 32, then re-expose 3
    assert st.snapshot() == want
    st.sync_to(33, 0)
    other = model.new_state(capacity=100, max_rewind=4)
    model.forward(seq[:30], other)
    model.forward(torch.cat([seq[30:33], random_ids(2, V, seed=1)]), other)
    other.rewind_to(33)
    assert st.snapshot() == other.snapshot()
    assert torch.equal(model.forward(seq[33:35], st), model.forward(seq[33:35], other))


@pytest.mark.parametrize("j", [0, 2, 4])
def test_snapshot_mid_draft_restores_then_drafts_and_rewinds(model, seq, j):  # noqa: F811
    """A snapshot taken after a verify call (before its rewind) and one taken after the rewind
    (the replayed state) restore into fresh states that then draft, rewind and continue exactly
    as the state they were taken from."""
    st = model.new_state(capacity=120, max_rewind=4)
    model.forward(seq[:40], st)
    drafts = seq[41:41 + j].tolist() + random_ids(4 - j, V, seed=j).tolist()
    model.forward([int(seq[40])] + drafts, st)
    before_rewind = st.snapshot()  # mid-draft: all 4 drafts still in
    st.rewind_to(41 + j)
    after_rewind = st.snapshot()  # the accepted prefix, replayed
    other = model.new_state(capacity=120, max_rewind=4)  # other rejected drafts, same rewind
    model.forward(seq[:40], other)
    model.forward([int(seq[40])] + drafts[:j] + random_ids(4 - j, V, seed=50 + j).tolist(), other)
    other.rewind_to(41 + j)
    assert after_rewind == other.snapshot()

    full = model.new_state(capacity=120, max_rewind=4)
    full.restore(before_rewind)
    assert full.pos == 45 and full.snapshot() == before_rewind
    again = model.new_state(capacity=120, max_rewind=4)
    model.forward(seq[:40], again)
    model.forward([int(seq[40])] + drafts, again)
    assert torch.equal(model.forward(seq[60:62], full), model.forward(seq[60:62], again))

    got = model.new_state(capacity=130, max_rewind=4)
    got.restore(after_rewind)
    assert got.snapshot() == after_rewind
    y, truth = int(seq[41 + j]), seq[42 + j:]
    for k, acc in ((4, 1), (3, 3), (2, 0), (0, 0)):  # draft, rewind, repeat: restored vs original
        y2, truth2 = verify_round(model, got, model.new_state(capacity=130), y, truth, k, acc, seed=k + 10 * j)
        verify_round(model, st, model.new_state(capacity=130), y, truth, k, acc, seed=k + 10 * j)
        y, truth = y2, truth2
        assert got.snapshot() == st.snapshot()
        assert all(torch.equal(a, b) for a, b in zip(kda_tensors(got), kda_tensors(st)))
    assert torch.equal(model.forward([y], got), model.forward([y], st))


def test_replay_never_reruns_projections(model, seq):  # noqa: F811
    """Rewinding, snapshotting and the next forward's replay run no projection: only the new tokens'."""
    rows = []
    kda = [b.self_attn for b in model.model.layers if b.kind == KDA]
    hooks = [m.q_proj.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0])) for m in kda]
    try:
        st = model.new_state(capacity=100, max_rewind=4)
        model.forward(seq[:30], st)
        model.forward(seq[30:35], st)
        assert rows == [30, 30, 5, 5]
        st.rewind_to(32)
        st.snapshot()
        st.advance(1)
        st.rewind_to(31)
        assert rows == [30, 30, 5, 5]
        model.forward(seq[31:33], st)  # replays token 30 from the stored inputs, projects 2
        assert rows == [30, 30, 5, 5, 2, 2]
    finally:
        for h in hooks:
            h.remove()


def test_a_rewind_whose_inputs_were_overwritten_is_refused(model, seq):  # noqa: F811
    """rewind, forward, rewind again further than the rows kept since: refused, state unchanged."""
    st = model.new_state(capacity=100, max_rewind=2)
    model.forward(seq[:10], st)
    st.rewind_to(8)
    model.forward(seq[8:9], st)  # positions 9.. of the first call are gone; the conv ring reused slot 4
    want = st.snapshot()
    with pytest.raises(kvfold.RewindError, match="no longer held"):
        st.rewind_to(7)
    with pytest.raises(kvfold.RewindError):
        st.sync_to(7, 0)
    assert st.pos == 9 and st.snapshot() == want
    st.rewind_to(8)  # within what is held: the state at 8 from the same inputs
    ref = model.new_state(capacity=100, max_rewind=2)
    model.forward(seq[:10], ref)
    ref.rewind_to(8)
    assert st.snapshot() == ref.snapshot()


def test_memory_is_one_kda_state_plus_per_token_inputs(model):
    cfg = model.config
    nh, dk, km1 = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim - 1
    c = nh * dk
    for r in (0, 1, 4, 8):
        st = model.new_state(capacity=64, max_rewind=r)
        n_in, n_mix = kda_ring_sizes(r, km1 + 1)
        assert (n_in, n_mix) == ((0, 0) if r == 0 else (r, r + km1))
        for ls in st.layers:
            if isinstance(ls, g5s.KdaLayerState):  # ONE state, not one per rewindable position
                assert ls.conv.shape == (km1, 3 * c) and ls.rec.shape == (nh, dk, dk)
                assert ls.k.shape == ls.g.shape == (n_in, nh, dk) and ls.v.shape == (n_in, nh, dk)
                assert ls.beta.shape == (n_in, nh) and ls.mixed.shape == (n_mix, 3 * c)
                assert ls.nbytes == (c * dk + n_in * 2 * c) * 4 + ((km1 + n_mix) * 3 * c + n_in * (c + nh)) * 4
        assert st.nbytes == pytest.approx(64 * model.state_bytes_per_token() + model.fixed_state_bytes(r), abs=64)

    # GLM-5.3-Flash (34 KDA layers, 64 heads x 128, conv kernel 4), bf16
    flash = glm5_config_from_dict({"model_type": "glm5_next_text", "index_kpool": 4})
    meta = Glm5Model.__new__(Glm5Model)
    meta.config, meta.dtype = flash, torch.bfloat16
    state = 64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2  # 4,341,760 B per layer
    per_token = 2 * 8192 * 4 + 8192 * 2 + 64 * 4  # k, g, beta fp32; v bf16: 82,176 B
    row = 3 * 8192 * 2  # one pre-conv row: 49,152 B
    assert len(flash.kda_layers) == 34 and state == 4_341_760 and per_token == 82_176
    mib = 2 ** 20
    got = {r: meta.fixed_state_bytes(r) for r in (0, 4, 8)}
    assert got[0] == 34 * state  # 140.8 MiB, as before
    for r in (4, 8):
        assert got[r] == 34 * (state + r * per_token + (r + 3) * row)
    assert [round(got[r] / mib, 1) for r in (0, 4, 8)] == [140.8, 162.6, 179.6]
    assert [round(34 * (r + 1) * state / mib, 1) for r in (0, 4, 8)] == [140.8, 703.9, 1267.0]  # before


def test_one_cursor_model_every_indexer_state_len_is_pos(model, seq):  # noqa: F811
    """The state is built on the Glm5NextDsaState contract: each full DSA layer's indexer state is
    one (the seed class), and its len equals pos after every cursor operation, refused ones
    included (which change neither), through random forwards, rewinds, advances, sync_tos,
    snapshots and restores."""
    from kvfold.models.glm5.indexer_state import Glm5NextDsaState
    gen = torch.Generator().manual_seed(7)
    st = model.new_state(capacity=120, max_rewind=4)
    dsas = st._dsa_states()
    assert dsas and all(type(d) is Glm5NextDsaState for d in dsas)

    def check():
        assert all(d.len == st.pos for d in dsas), ([d.len for d in dsas], st.pos)

    p = 0
    for _ in range(60):
        op = int(torch.randint(0, 5, (1,), generator=gen))
        n = int(torch.randint(0, 6, (1,), generator=gen))
        before = (st.pos, [d.len for d in dsas])
        try:
            if op == 0 and st.pos + n + 1 <= 110:
                model.forward(seq[st.pos:st.pos + n + 1], st)
            elif op == 1:
                st.rewind_to(st.pos - n)
            elif op == 2:
                st.advance(n)
            elif op == 3:
                st.sync_to(st.pos - n, int(torch.randint(0, 6, (1,), generator=gen)))
            else:
                blob = st.snapshot()
                other = model.new_state(capacity=120, max_rewind=4)
                other.restore(blob)
                assert all(d.len == other.pos for d in other._dsa_states())
                other.free()
        except kvfold.RewindError:
            assert (st.pos, [d.len for d in dsas]) == before  # a refusal changes nothing
        check()
        p = max(p, st.pos)
    assert p > 20
    late = model.new_state(capacity=50)
    late.start_at(30)  # a drafter's state joining late: the indexer rows below stay zero, never valid
    assert all(d.len == 30 for d in late._dsa_states()) and late.pos == 30
    with pytest.raises(kvfold.StateError):
        late.start_at(31)
    model.forward(seq[30:33], late)
    assert all(d.len == 33 for d in late._dsa_states())

"""Sessions on disk: save, load, continue bit-identically; foreign or damaged files are refused."""
import json
import os
import struct

import pytest
import torch

import kvfold
import kvfold.cli as cli
from kvfold import errors
from kvfold import session as sess
from kvfold.decoding.generate import generation_capacity
from kvfold.decoding.speculative import Drafter

BOS = 256
PROMPT = [BOS] + list(b"Once upon a time")
MORE = list(b" and then")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_and_save(model, path, prompt=PROMPT, n=6, **kw):
    """generate n tokens into a state we own, save the session; return (tokens, session)."""
    cap, rewind = generation_capacity(len(prompt), n, kw.get("speculative"), kw.get("num_draft", 4))
    st = model.new_state(capacity=cap, max_rewind=rewind)
    res = kvfold.generate(model, prompt, n, stop_ids=[], state=st, history=[], **kw)
    consumed, pending = sess.split_history(prompt, res.tokens)
    sess.save_session(path, st, consumed, pending)
    st.free()
    return res.tokens, sess.read_session(path)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("sess") / "a.kvfs"
    tokens, session = run_and_save(tiny, path)
    return path, tokens, session


def test_session_records_consumed_and_pending(tiny, saved):
    path, tokens, session = saved
    assert session.tokens == PROMPT + tokens[:-1]
    assert session.pending == tokens[-1]
    assert session.fingerprint == tiny.fingerprint and session.kvfold_version == kvfold.__version__
    assert session.pos == len(PROMPT) + len(tokens) - 1


def test_load_continues_bit_identically_to_one_run(tiny, saved):
    path, first, _ = saved
    n, m = len(first), 7
    straight = kvfold.generate(tiny, PROMPT, n + m, stop_ids=[]).tokens
    # resume: feed only the pending token, then 1-token steps: the chunking of the straight run
    st, session = sess.load_session(path, tiny, extra_capacity=m + 1)
    res = kvfold.generate(tiny, session.continuation([]), m, stop_ids=[], state=st, history=session.tokens)
    assert first + res.tokens == straight
    st.free()


def test_load_with_new_text_matches_an_uninterrupted_run_with_the_same_chunks(tiny, saved):
    path, first, _ = saved
    # uninterrupted: the same state goes on with [pending] + MORE as one chunk
    st = tiny.new_state(capacity=100)
    kvfold.generate(tiny, PROMPT, len(first), stop_ids=[], state=st, history=[])
    hist = PROMPT + first[:-1]
    want = kvfold.generate(tiny, [first[-1]] + MORE, 8, stop_ids=[], state=st, history=hist).tokens
    want_blob = st.snapshot()
    st.free()

    st, session = sess.load_session(path, tiny, extra_capacity=len(MORE) + 9)
    got = kvfold.generate(tiny, session.continuation(MORE), 8, stop_ids=[], state=st, history=session.tokens).tokens
    assert got == want
    assert st.snapshot() == want_blob  # the states are byte-identical too
    st.free()


def test_speculative_after_restore_equals_plain(tiny, saved):
    path, first, _ = saved
    outs = []
    for spec in (None, "ngram"):
        st, session = sess.load_session(path, tiny, extra_capacity=40, max_rewind=5)
        res = kvfold.generate(tiny, session.continuation(MORE), 20, stop_ids=[], state=st, history=session.tokens,
                              speculative=spec, num_draft=4)
        outs.append(res.tokens)
        assert st.pos == session.pos + 1 + len(MORE) + len(res.tokens) - 1
        st.free()
    assert outs[0] == outs[1]


def test_foreign_model_session_is_refused_before_anything(tiny, saved, monkeypatch):
    from kvfold.models.deepseek_v4.model import Dsv4Model
    from kvfold.models.deepseek_v4.tiny import tiny_config
    path = saved[0]
    other = Dsv4Model(tiny_config(index_topk=8))
    assert other.fingerprint != tiny.fingerprint

    def no_alloc(*a, **k):
        raise AssertionError("no state may be allocated for a foreign session")

    monkeypatch.setattr(other, "new_state", no_alloc)
    with pytest.raises(errors.SessionModelError, match=f"fingerprint {tiny.fingerprint}.*{other.fingerprint}"):
        sess.load_session(path, other, extra_capacity=10)
    assert issubclass(errors.SessionModelError, kvfold.StateError)
    assert issubclass(errors.SessionModelError, kvfold.StateMismatchError)


def test_other_dtype_session_is_refused(saved):
    bf = kvfold.load_model("tiny-random", dtype=torch.bfloat16)
    with pytest.raises(errors.SessionModelError, match="bfloat16"):
        sess.load_session(saved[0], bf, extra_capacity=10)


def rewrite(data: bytes, meta_edit) -> bytes:
    """A session with edited metadata and a recomputed (valid) checksum."""
    import hashlib
    _, version, mlen, _ = struct.unpack_from("<8sII32s", data)
    meta = json.loads(data[48:48 + mlen])
    replaced = meta_edit(meta)
    m = json.dumps(meta if replaced is None else replaced).encode()
    body = m + data[48 + mlen:]
    return struct.pack("<8sII32s", sess.MAGIC, version, len(m), hashlib.sha256(body).digest()) + body


def corruptions(data: bytes):
    def flip(i):
        b = bytearray(data)
        b[i] ^= 0x10
        return bytes(b)

    yield "empty", b"", errors.SessionCorruptedError
    yield "short", data[:20], errors.SessionCorruptedError
    yield "magic", b"KVFOLDST" + data[8:], errors.SessionCorruptedError
    yield "snapshot not session", data[48 + struct.unpack_from("<I", data, 12)[0]:], errors.SessionCorruptedError
    yield "version", data[:8] + struct.pack("<I", 2) + data[12:], errors.SessionVersionError
    yield "meta length", data[:12] + struct.pack("<I", 10 ** 9) + data[16:], errors.SessionCorruptedError
    yield "checksum byte", flip(20), errors.SessionCorruptedError
    yield "metadata byte", flip(60), errors.SessionCorruptedError
    yield "state byte", flip(len(data) - 500), errors.SessionCorruptedError
    yield "truncated", data[:-1], errors.SessionCorruptedError
    yield "extended", data + b"\0", errors.SessionCorruptedError
    yield "tokens not ints", rewrite(data, lambda m: m.update(tokens=["a"])), errors.SessionCorruptedError
    yield "pending bad", rewrite(data, lambda m: m.update(pending=-1)), errors.SessionCorruptedError
    yield "state_bytes", rewrite(data, lambda m: m.update(state_bytes=1)), errors.SessionCorruptedError
    yield "not an object", rewrite(data, lambda m: []), errors.SessionCorruptedError


def test_corrupted_sessions_are_refused(tiny, saved, tmp_path):
    data = saved[0].read_bytes()
    for name, bad, err in corruptions(data):
        p = tmp_path / "bad.kvfs"
        p.write_bytes(bad)
        with pytest.raises(err) as exc:
            sess.load_session(p, tiny, extra_capacity=10)
        assert isinstance(exc.value, kvfold.StateError), name
    with pytest.raises(errors.SessionCorruptedError, match="cannot read"):
        sess.load_session(tmp_path / "missing.kvfs", tiny, extra_capacity=10)


def test_metadata_that_disagrees_with_the_state_is_refused(tiny, saved, tmp_path):
    data = saved[0].read_bytes()
    p = tmp_path / "lie.kvfs"
    p.write_bytes(rewrite(data, lambda m: m.update(tokens=m["tokens"][:-1])))  # one token fewer than the state
    with pytest.raises(errors.SessionCorruptedError, match="pos"):
        sess.load_session(p, tiny, extra_capacity=10)
    p.write_bytes(rewrite(data, lambda m: m.update(pending=tiny.config.vocab_size)))
    with pytest.raises(errors.SessionCorruptedError, match="vocabulary"):
        sess.load_session(p, tiny, extra_capacity=10)


def test_atomic_write_leaves_no_temp_files(tiny, tmp_path, monkeypatch):
    path = tmp_path / "s.kvfs"
    st = tiny.new_state(capacity=10)
    tiny.forward([BOS, 1, 2], st)
    sess.save_session(path, st, [BOS, 1, 2], 3)
    assert os.listdir(tmp_path) == ["s.kvfs"]
    good = path.read_bytes()
    sess.save_session(path, st, [BOS, 1, 2], 4)  # overwrite in place
    assert os.listdir(tmp_path) == ["s.kvfs"] and path.read_bytes() != good

    # a failure between write and rename keeps the old file and removes the temp file
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        sess.save_session(path, st, [BOS, 1, 2], 5)
    assert os.listdir(tmp_path) == ["s.kvfs"] and path.read_bytes() == before
    with pytest.raises(ValueError, match="consumed"):
        sess.save_session(path, st, [BOS, 1], 5)
    st.free()


def test_cli_save_then_load_continues_like_one_run(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_model", lambda path, device, dtype: tiny)
    f1, f2 = tmp_path / "one.kvfs", tmp_path / "two.kvfs"
    assert cli.main(["generate", "--prompt", "ab", "--max-new-tokens", "5", "--save-session", str(f1)]) == 0
    assert cli.main(["generate", "--prompt", "cd", "--max-new-tokens", "5", "--load-session", str(f1),
                     "--save-session", str(f2)]) == 0
    err = capsys.readouterr().err
    assert "session saved to" in err
    # the same chunks without leaving the process
    st = tiny.new_state(capacity=100)
    p1 = [BOS] + list(b"ab")
    t1 = kvfold.generate(tiny, p1, 5, state=st, history=[]).tokens
    hist = p1 + t1[:-1]
    p2 = [t1[-1]] + list(b"cd")
    t2 = kvfold.generate(tiny, p2, 5, state=st, history=hist).tokens
    two = sess.read_session(f2)
    assert (two.tokens, two.pending) == sess.split_history(hist + p2, t2)
    assert two.state_blob == st.snapshot()
    st.free()
    assert [x for x in os.listdir(tmp_path) if x.endswith(".tmp")] == []


def test_cli_refuses_foreign_or_damaged_session(tiny, tmp_path, monkeypatch, capsys):
    f = tmp_path / "x.kvfs"
    f.write_bytes(b"KVFSESS1 but then garbage......................................")
    loads = []
    monkeypatch.setattr(cli, "_load_model", lambda *a: loads.append(a) or tiny)
    assert cli.main(["generate", "--prompt", "a", "--max-new-tokens", "2", "--load-session", str(f)]) == 2
    assert "error: session" in capsys.readouterr().err
    assert loads == []  # a damaged file is refused before the model is even loaded


def test_session_saved_after_speculative_rewinds_continues_exactly(tiny, tmp_path):
    # after verify passes, rows of rejected drafts lie past pos; the snapshot must not need them
    prompt = [BOS] + list(b"abab abab abab abab")
    class Zeros(Drafter):  # (almost) always wrong: every verify pass rewinds
        def propose(self, context, k):
            return [0] * k, None

    st = tiny.new_state(capacity=80, max_rewind=5)
    res = kvfold.generate(tiny, prompt, 12, stop_ids=[], speculative=Zeros(), num_draft=4, state=st, history=[])
    assert res.drafted > res.accepted  # something was rejected and rewound
    consumed, pending = sess.split_history(prompt, res.tokens)
    sess.save_session(tmp_path / "s.kvfs", st, consumed, pending)
    restored, session = sess.load_session(tmp_path / "s.kvfs", tiny, extra_capacity=20)
    outs = [kvfold.generate(tiny, [pending], 10, stop_ids=[], state=s, history=consumed).tokens
            for s in (st, restored)]
    assert outs[0] == outs[1]
    assert st.snapshot() == restored.snapshot()
    st.free()
    restored.free()

"""The prefix cache's disk tier (engine/disk_cache.py): entries outlive the engine; a hit from
disk is bit-identical to a cold prefill (tokens and float32 logprobs), for both families, paged
and private pools; a file that fails any check is deleted, logged once and never served; the disk
budget evicts least recently used files; a full disk leaves no file; two servers share a
directory."""
import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.engine.disk_cache import HEAD, DiskTier
from kvfold.errors import CacheFileError

from helpers import random_ids
from test_glm5_graph_decode import glm  # noqa: F401  (the tiny random GLM-5.3 fixture)

SP = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)


def run(engine, prompt):
    """Step one request to the end: (tokens, [(logprob, top ids and logprobs)], cached tokens)."""
    rid = engine.add_request(prompt, SP)
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                logprobs += [(lp.logprob, lp.top) for lp in o.logprobs or []]
                cached = o.cached_tokens
    return tokens, logprobs, cached


def engine(model, cache_dir=None, **kw):
    kw.setdefault("cache_disk_bytes", 1 << 30)
    return Engine(model, max_seq_len=512, cache_dir=cache_dir, **kw)


@pytest.fixture(params=["dsv4-paged", "dsv4-private", "glm5-paged"])
def case(request, tiny, glm):
    family, pools = request.param.split("-")
    model = tiny if family == "dsv4" else glm
    return model, {"kv_page_bytes": 0} if pools == "private" else {}


def test_a_hit_from_disk_after_a_restart_is_bit_identical_to_a_cold_prefill(case, tmp_path):
    model, kw = case
    prompt = random_ids(300, model.config.vocab_size, seed=3).tolist()
    cold = run(engine(model, prefix_cache_bytes=0, cache_disk_bytes=0, **kw), prompt)
    first = engine(model, tmp_path, **kw)
    assert run(first, prompt)[:2] == cold[:2]
    assert first.flush_prefix_cache() == 1  # the prompt's longest entry (256 tokens): the one worth a file
    restarted = engine(model, tmp_path, **kw)  # a new engine: an empty memory tier
    got = run(restarted, prompt)
    assert got == (cold[0], cold[1], 256)
    m = restarted.metrics()
    assert (m["prefix_cache_disk_hits"], m["prefix_cache_disk_hit_tokens"], m["prefix_cache_hit_tokens"]) == (1, 256, 256)
    assert m["prefix_cache_entries"] == 1  # the hit went back into memory
    assert m["prefix_cache_disk_entries"] == 1 and m["prefix_cache_disk_refused"] == 0


def test_a_prompts_longest_entry_and_every_entry_a_request_hit_go_to_disk(tiny, tmp_path):
    """Not every block's full snapshot: the longest entry of each prompt, and the entries hit
    (here the 128-token block two prompts share, as a system prompt would be)."""
    a = random_ids(300, tiny.config.vocab_size, seed=7).tolist()
    b = a[:200] + random_ids(100, tiny.config.vocab_size, seed=8).tolist()
    eng = engine(tiny, tmp_path)
    run(eng, a)
    assert run(eng, b)[2] == 128
    assert eng.flush_prefix_cache() == 3  # a's 256, the shared 128 (hit), b's 256
    keys = eng.prefix_cache.keys_for(a)[:2] + eng.prefix_cache.keys_for(b)[1:2]
    assert all(k in eng.prefix_cache.disk for k in keys) and eng.metrics()["prefix_cache_disk_entries"] == 3


def entry_files(tmp_path) -> list[Path]:
    return sorted(tmp_path.glob("*/*.kvc"), key=lambda p: p.stat().st_size)


def corrupt_blob(data: bytes) -> bytes:
    return data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]  # a body byte: the snapshot's checksum


def corrupt_ids(data: bytes) -> bytes:
    return data[:HEAD.size] + bytes([data[HEAD.size] ^ 1]) + data[HEAD.size + 1:]


def other_version(data: bytes) -> bytes:
    return data[:8] + (99).to_bytes(4, "little") + data[12:]


MUTATIONS = {"truncated": lambda d: d[:HEAD.size + 20], "blob byte": corrupt_blob, "ids byte": corrupt_ids,
             "other format version": other_version, "not a cache file": lambda d: b"x" * len(d)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_damaged_file_is_refused_deleted_logged_once_and_the_request_runs_cold(tiny, tmp_path, caplog, mutation):
    prompt = random_ids(300, tiny.config.vocab_size, seed=4).tolist()
    cold = run(engine(tiny, prefix_cache_bytes=0, cache_disk_bytes=0), prompt)
    first = engine(tiny, tmp_path)
    run(first, prompt)
    first.flush_prefix_cache()
    for path in entry_files(tmp_path):
        path.write_bytes(MUTATIONS[mutation](path.read_bytes()))
    restarted = engine(tiny, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvfold.cache"):
        assert run(restarted, prompt) == (cold[0], cold[1], 0)  # refused: cold
    assert entry_files(tmp_path) == []  # deleted
    m = restarted.metrics()
    assert m["prefix_cache_disk_refused"] == 1 and m["prefix_cache_disk_hits"] == 0
    assert len([r for r in caplog.records if "dropped a disk entry" in r.message]) == 1
    # what the cold run cached goes to disk at its flush, and serves the next engine
    assert restarted.flush_prefix_cache() == 1
    assert run(engine(tiny, tmp_path), prompt) == (cold[0], cold[1], 256)


def test_another_models_snapshot_under_a_right_name_is_refused_by_the_snapshot_checks(tiny, tmp_path):
    other = kvfold.load_model("tiny-random")
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    other.fingerprint = "other-model-0001"
    prompt = random_ids(200, tiny.config.vocab_size, seed=5).tolist()
    eng = engine(tiny, tmp_path)
    tier, block = eng.prefix_cache.disk, eng.prefill_chunk
    st = other.new_state(capacity=512)
    other.forward(prompt[:block], st)
    key = eng.prefix_cache.keys_for(prompt)[0]
    assert tier.write(key, prompt[:block], st.snapshot())  # this model's key and ids, another's state
    cold = run(engine(tiny, prefix_cache_bytes=0, cache_disk_bytes=0), prompt)
    assert run(eng, prompt) == (cold[0], cold[1], 0)
    assert eng.metrics()["prefix_cache_disk_refused"] == 1 and not any(p.name == key.hex() + ".kvc"
                                                                         for p in tmp_path.glob("*/*"))


def test_the_disk_budget_evicts_least_recently_used_files(tiny, tmp_path):
    tier = DiskTier(tmp_path, 3000, 4, b"root")
    ids = [[i, i + 1, i + 2, i + 3] for i in range(5)]
    keys = [tier_key(tier, x) for x in ids]
    for k, x in zip(keys[:2], ids[:2]):
        assert tier.write(k, x, b"b" * 1000)
    assert tier.read(keys[0], 4) == b"b" * 1000  # a hit: now the most recent
    assert tier.write(keys[2], ids[2], b"c" * 1000)
    assert keys[0] in tier and keys[1] not in tier and keys[2] in tier and tier.nbytes <= 3000
    assert not tier.write(keys[3], ids[3], b"d" * 4000)  # larger than the whole budget: not stored
    assert tier.evictions == 1 and keys[3] not in tier


def tier_key(tier, ids):
    from kvfold.engine.prefix_cache import block_hashes
    return block_hashes(ids, tier.block, tier.root)[-1]


def test_a_full_disk_leaves_no_file_and_the_engine_serves_on(tiny, tmp_path, monkeypatch):
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    prompt = random_ids(300, tiny.config.vocab_size, seed=6).tolist()
    cold = run(engine(tiny, prefix_cache_bytes=0, cache_disk_bytes=0), prompt)
    eng = engine(tiny, tmp_path)
    assert run(eng, prompt)[:2] == cold[:2]
    monkeypatch.setattr(os, "fsync", full)
    assert eng.flush_prefix_cache() == 0
    assert list(tmp_path.glob("*/*.kvc")) == [] and list(tmp_path.glob("*/*.tmp")) == []
    assert eng.metrics()["prefix_cache_disk_write_errors"] == 1
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert run(eng, prompt)[:2] == cold[:2]  # the memory tier serves on


def test_two_servers_share_one_directory_without_corrupting_it(tmp_path):
    tiers = [DiskTier(tmp_path, 40_000, 4, b"root") for _ in range(2)]
    ids = [[i, 7, 7, i] for i in range(40)]
    errors = []

    def writer(tier, order):
        try:
            for i in order:
                tier.write(tier_key(tier, ids[i]), ids[i], bytes([i]) * 2000)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t, order))
               for t, order in zip(tiers, (range(40), reversed(range(40))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and tiers[0].nbytes <= 40_000
    kept = 0
    for i, x in enumerate(ids):
        key = tier_key(tiers[0], x)
        if key in tiers[1]:
            assert tiers[1].read(key, 4) == bytes([i]) * 2000  # whole, and its ids match its name
            kept += 1
    assert kept >= 15


def test_a_disk_cache_needs_a_memory_tier_and_a_budget(tiny, tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(tiny, max_seq_len=256, prefix_cache_bytes=0, cache_dir=tmp_path, cache_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="budget"):
        Engine(tiny, max_seq_len=256, cache_dir=tmp_path, cache_disk_bytes=0)
    with pytest.raises(CacheFileError):
        DiskTier(tmp_path, 1000, 4, b"r").read(b"\0" * 32, 4)  # no such entry

"""kvfold.Engine: continuous batching, prefix cache, admission control, cancellation, sampling.

References: `kvfold.generate` for prompts up to 128 tokens (one prefill chunk, the same
computation), and `helpers.chunked_reference` (the plain model API fed in the engine's
128-aligned chunks) for longer prompts, where generate's single prefill forward may differ
from chunked prefill in the last bits of the logits.
"""
import pytest
import torch

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.engine import PrefixCache, block_hashes
from kvfold.errors import InvalidRequestError, QueueFullError, RequestTooLongError

from helpers import chunked_reference


def text_ids(model, text: str) -> list[int]:
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def long_ids(model, n: int, salt: str) -> list[int]:
    text = "".join(f"{salt} line {i}: the cache keeps every row it still needs. " for i in range(n // 40 + 2))
    return text_ids(model, text)[:n]


def test_state_bytes_are_known_before_allocating(tiny):
    engine = Engine(tiny, max_seq_len=1024)
    for cap in (1, 3, 4, 31, 32, 33, 129, 1000):
        st = tiny.new_state(capacity=cap)
        assert engine.state_bytes(cap) == st.nbytes
        st.free()


def test_greedy_batched_equals_generate(tiny):
    prompts = [text_ids(tiny, t) for t in ("", "Hi", "The cache far away", "x" * 126)]  # 1 to 127 tokens
    engine = Engine(tiny, max_seq_len=256)
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    for p, c in zip(prompts, got):
        ref = kvfold.generate(tiny, p, 12).tokens
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] in tiny.config.eos_ids else "length")
        assert c.text == tiny.tokenizer.decode(ref)
    assert engine.metrics()["live_states"] == 0


def test_seeded_sampling_equals_generate_alone_and_batched(tiny):
    p = text_ids(tiny, "Once upon a time")
    sp = dict(temperature=0.9, top_p=0.8, seed=7)
    ref = kvfold.generate(tiny, p, 10, **sp).tokens
    engine = Engine(tiny, max_seq_len=256)
    others = [text_ids(tiny, "noise"), text_ids(tiny, "more noise here")]
    got = engine.generate([others[0], p, others[1]],
                          [SamplingParams(max_tokens=5, temperature=1.0, seed=1), SamplingParams(max_tokens=10, **sp),
                           SamplingParams(max_tokens=7, temperature=0.5)])
    assert got[1].token_ids == ref


def test_one_forward_batch_per_step_and_aligned_chunks(tiny, monkeypatch):
    calls = []
    real = tiny.forward_batch

    def spy(batch, last_only=True, **mode):
        calls.append([(st.pos, len(ids)) for ids, st in batch])
        return real(batch, last_only=last_only, **mode)

    monkeypatch.setattr(tiny, "forward_batch", spy)
    engine = Engine(tiny, max_seq_len=1024, max_batch_tokens=200, prefix_cache_bytes=0)
    short = [text_ids(tiny, "ab"), text_ids(tiny, "hello")]
    longp = [long_ids(tiny, 300, "A"), long_ids(tiny, 290, "B")]
    rids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in short + longp]
    steps = 0
    while engine.has_unfinished():
        n_before = len(calls)
        engine.step()
        assert len(calls) - n_before <= 1  # one batched model call per step
        steps += 1
    assert steps == len(calls)
    for batch in calls:
        # chunks end at multiples of 128 (or the prompt end); the budget holds after the first chunk
        for pos, n in batch:
            assert n == 1 or (pos % 128 == 0 and n <= 128)
        tokens = sum(n for _, n in batch)
        prefills = [n for _, n in batch if n > 1]
        assert tokens <= 200 or len(prefills) == 1
    assert max(len(b) for b in calls) == 4  # decodes and prefills really share steps
    assert len(rids) == 4 and engine.metrics()["live_states"] == 0


def test_long_prompt_and_prefix_hit_equal_cold_run(tiny):
    a = long_ids(tiny, 300, "P")
    b = a[:270] + tiny.tokenizer.encode(" but then something else happened")
    ref_a = chunked_reference(tiny, a, 10)
    ref_b = chunked_reference(tiny, b, 10)
    cold = Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0)
    assert [c.token_ids for c in cold.generate([a, b], SamplingParams(max_tokens=10))] == [ref_a, ref_b]

    engine = Engine(tiny, max_seq_len=1024)
    (ca,) = engine.generate([a], SamplingParams(max_tokens=10))
    assert ca.token_ids == ref_a and ca.cached_tokens == 0
    assert engine.metrics()["prefix_cache_entries"] == 2  # blocks ending at 128 and 256
    (cb,) = engine.generate([b], SamplingParams(max_tokens=10))
    assert cb.token_ids == ref_b and cb.cached_tokens == 256
    (ca2,) = engine.generate([a], SamplingParams(max_tokens=10))  # the same prompt again: hit 256, rest cold
    assert ca2.token_ids == ref_a and ca2.cached_tokens == 256
    m = engine.metrics()
    assert (m["prefix_cache_lookups"], m["prefix_cache_hits"], m["prefix_cache_hit_tokens"]) == (3, 2, 512)
    assert m["prefix_cache_hit_rate"] == pytest.approx(512 / (2 * len(a) + len(b)))
    assert m["prefill_tokens"] == len(a) + (len(b) - 256) + (len(a) - 256)
    # a prompt of exactly 256 tokens can use only the 128 block: one token must still run
    (cc,) = engine.generate([a[:256]], SamplingParams(max_tokens=3))
    assert cc.cached_tokens == 128 and cc.token_ids == chunked_reference(tiny, a[:256], 3)


def test_restored_state_is_bit_identical_to_cold_state(tiny):
    """The invariant prefix hits rest on: cold chunks [0,128),[128,256),[256,300) and a restore at
    128 followed by the same later chunks leave byte-identical states and logits."""
    ids = long_ids(tiny, 300, "S")
    cold = tiny.new_state(capacity=300)
    tiny.forward(ids[:128], cold, last_only=True)
    blob = cold.snapshot()
    tiny.forward(ids[128:256], cold, last_only=True)
    lc = tiny.forward(ids[256:], cold, last_only=True)
    warm = tiny.new_state(capacity=400)
    warm.restore(blob)
    tiny.forward(ids[128:256], warm, last_only=True)
    lw = tiny.forward(ids[256:], warm, last_only=True)
    assert torch.equal(lc, lw) and cold.snapshot() == warm.snapshot()
    cold.free(), warm.free()


def test_stop_strings_and_stop_ids(tiny):
    p = text_ids(tiny, "Hello world")
    ref = kvfold.generate(tiny, p, 24, stop_ids=[]).tokens
    full = tiny.tokenizer.decode(ref)
    engine = Engine(tiny, max_seq_len=256)
    # stop at a token id seen mid-output: the output ends with its first occurrence
    k = 5
    (c,) = engine.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]]))
    assert c.token_ids == ref[:ref.index(ref[k]) + 1] and c.finish_reason == "stop"
    # stop at a string from the middle of the text: the text ends just before it
    stop = full[10:12]
    rid = engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=["\x00never", stop]))
    text, finished = "", None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            text += out.new_text
            finished = out
    assert text == full[:full.index(stop)] and finished.finish_reason == "stop"
    assert engine.metrics()["live_states"] == 0


def test_admission_waits_for_room_and_refuses_what_never_fits(tiny):
    prompts = [text_ids(tiny, f"request number {i}") for i in range(5)]
    refs = [kvfold.generate(tiny, p, 6, stop_ids=[]).tokens for p in prompts]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(tiny, max_seq_len=64, max_running=2)
    rids = [engine.add_request(p, sp) for p in prompts]
    out = {r: [] for r in rids}
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        most = max(most, engine.metrics()["running"])
    assert most == 2 and [out[r] for r in rids] == refs

    one = engine.state_bytes(64)  # room for exactly one state of capacity 64
    tight = Engine(tiny, max_seq_len=64, max_state_bytes=one, max_queue=2)
    tight.add_request(prompts[0], SamplingParams(max_tokens=64 - len(prompts[0])))
    tight.add_request(prompts[1], SamplingParams(max_tokens=64 - len(prompts[1])))
    with pytest.raises(QueueFullError):
        tight.add_request(prompts[2], sp)
    tight.step()
    m = tight.metrics()
    assert (m["running"], m["queue_depth"], m["live_state_bytes"]) == (1, 1, one)
    with pytest.raises(RequestTooLongError):  # over max_seq_len
        tight.add_request(prompts[0], SamplingParams(max_tokens=64))
    with pytest.raises(InvalidRequestError):
        tight.add_request([1, 2, tiny.config.vocab_size], sp)
    with pytest.raises(InvalidRequestError):
        tight.add_request([], sp)
    with pytest.raises(InvalidRequestError):
        tight.add_request([1, 2], SamplingParams(top_p=0.0))
    small = Engine(tiny, max_seq_len=512, max_state_bytes=one)
    with pytest.raises(RequestTooLongError):  # its state alone passes max_state_bytes: would wait forever
        small.add_request(prompts[0], SamplingParams(max_tokens=400))
    assert tight.metrics()["requests_rejected"] == 5
    tight.cancel_all()
    assert tight.metrics()["live_states"] == 0


def test_cancel_frees_state_and_leaves_others_intact(tiny):
    prompts = [text_ids(tiny, "first one"), long_ids(tiny, 400, "C"), text_ids(tiny, "third")]
    refs = [kvfold.generate(tiny, p, 8, stop_ids=[]).tokens if len(p) <= 128 else None for p in prompts]
    engine = Engine(tiny, max_seq_len=512, max_running=2)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    r0, r1, r2 = (engine.add_request(p, sp) for p in prompts)
    victim = engine.add_request(prompts[0], SamplingParams(max_tokens=100))
    out = {r0: [], r1: [], r2: []}
    for _ in range(3):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert engine.metrics()["live_states"] == 2 and engine._seqs[r1].state.pos == 384
    assert engine.cancel(r1)  # mid-prefill, after its third chunk
    assert not engine.cancel(r1)
    assert engine.metrics()["live_states"] == 1
    out[victim] = []
    cancelled = False
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if len(out[victim]) >= 3 and not cancelled:  # mid-decode
            assert engine.cancel(victim)
            cancelled = True
    assert out[r0] == refs[0] and out[r2] == refs[2]
    m = engine.metrics()
    assert (m["live_states"], m["live_state_bytes"], m["reserved_state_bytes"]) == (0, 0, 0)
    assert m["requests_cancelled"] == 2


def test_prefix_cache_lru_and_chained_keys():
    ids = list(range(300))
    keys = block_hashes(ids, 128)
    assert len(keys) == 2 and keys[0] == block_hashes(ids[:128], 128)[0]
    assert block_hashes([7] + ids[1:], 128)[1] != keys[1]  # a change in block 0 changes every later key
    cache = PrefixCache(128, max_bytes=250)
    cache.insert(keys[0], b"x" * 100)
    cache.insert(keys[1], b"y" * 100)
    assert cache.lookup(keys, 300) == (256, b"y" * 100)
    assert cache.lookup(keys, 256) == (128, b"x" * 100)  # strictly shorter than the prompt
    other = block_hashes([5] * 128, 128)[0]
    cache.insert(other, b"z" * 100)  # evicts the least recently used: keys[1]
    assert cache.entries == 2 and cache.evictions == 1 and cache.lookup(keys, 300) == (128, b"x" * 100)
    cache.insert(b"big", b"w" * 300)  # larger than the budget: not stored
    assert cache.entries == 2 and cache.nbytes == 200


def test_a_failed_forward_ends_its_batch_and_frees_states(tiny, monkeypatch):
    engine = Engine(tiny, max_seq_len=64)
    rids = [engine.add_request(text_ids(tiny, t), SamplingParams(max_tokens=4)) for t in ("a", "b")]
    monkeypatch.setattr(tiny, "forward_batch", lambda batch, last_only=True, **mode: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(r, "error") for r in rids]
    assert "boom" in outs[0].error and not engine.has_unfinished()
    m = engine.metrics()
    assert (m["live_states"], m["finished_error"]) == (0, 2)


def test_async_engine_streams_cancels_and_shuts_down(tiny):
    import asyncio
    from kvfold import AsyncEngine

    p = text_ids(tiny, "async")
    ref = kvfold.generate(tiny, p, 6, stop_ids=[]).tokens
    aeng = AsyncEngine(Engine(tiny, max_seq_len=128))
    aeng.start()

    async def main():
        got = [t async for out in aeng.generate(p, SamplingParams(max_tokens=6, ignore_eos=True))
               for t in out.new_token_ids]
        async for out in aeng.generate(p, SamplingParams(max_tokens=100)):
            break  # leaving early cancels the request
        with pytest.raises(RequestTooLongError):
            await aeng.add_request(p, SamplingParams(max_tokens=500))
        held = await aeng.add_request(p, SamplingParams(max_tokens=100))
        await held.__anext__()
        return got, held

    got, held = asyncio.run(main())
    assert got == ref
    aeng.shutdown()  # ends the request still running, frees its state
    m = aeng.metrics()
    assert (m["live_states"], m["requests_cancelled"]) == (0, 2)


def record_logits(monkeypatch, model, engine):
    """Every row of logits the engine's model calls return, per request: {request id: [(pos, logits)]}."""
    seen: dict[str, list] = {}
    real = model.forward_batch

    def spy(batch, last_only=True, **mode):
        owners = {id(s.state): s.request_id for s in engine.scheduler.running if s.state is not None}
        before = [(owners[id(st)], st.pos + len(ids)) for ids, st in batch]
        out = real(batch, last_only=last_only, **mode)
        for (rid, pos), lg in zip(before, out):
            seen.setdefault(rid, []).append((pos, lg.clone()))
        return out

    monkeypatch.setattr(model, "forward_batch", spy)
    return seen


@pytest.mark.batch_invariance
def test_a_requests_logits_do_not_depend_on_the_servers_load(tiny, monkeypatch):
    """Bit for bit: the logits of every step of a request, alone and beside seven others (long
    prefills, decodes, a prefix-cache hit of its own prompt), sampled with temperature."""
    target = long_ids(tiny, 300, "T")
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    solo = Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0)
    assert solo.batch_invariant  # the engine's default on an fp32 CPU model
    alone = record_logits(monkeypatch, tiny, solo)
    (want,) = solo.generate([target], sp)
    monkeypatch.undo()

    loaded = Engine(tiny, max_seq_len=1024, max_batch_tokens=300)
    seen = record_logits(monkeypatch, tiny, loaded)
    others = [long_ids(tiny, n, f"O{n}") for n in (1, 7, 129, 260, 2)] + [target[:200], target]
    rids = [loaded.add_request(p, SamplingParams(max_tokens=6 + i, temperature=1.0, seed=i))
            for i, p in enumerate(others[:6])]
    rid_t = loaded.add_request(target, sp)  # its prompt's first blocks may be cached by then
    rid_t2 = None
    outs: dict[str, list[int]] = {}
    while loaded.has_unfinished():
        for o in loaded.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_id == rids[2] and o.finished and rid_t2 is None:
                rid_t2 = loaded.add_request(target, sp)  # the same request again, under load, from the cache
    assert outs[rid_t] == want.token_ids == outs[rid_t2]
    assert loaded.metrics()["prefix_cache_hit_tokens"] >= 256  # the second run started from the cache
    ref = dict(alone[next(iter(alone))])
    for rid in (rid_t, rid_t2):
        got = seen[rid]
        assert len(got) >= 12 and all(pos in ref for pos, _ in got)
        for pos, lg in got:
            assert torch.equal(lg, ref[pos]), f"request {rid}: logits at position {pos} differ under load"

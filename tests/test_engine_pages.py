"""The engine's shared page pool: a prefix hit reuses the cached pages by reference and equals a
cold run bit for bit; admission waits for pages; cancellation and finish free pages at once;
evicting the prefix cache never changes a running sequence; nothing leaks."""
import pytest
import torch

from kvfold import Engine, SamplingParams
from kvfold.errors import RequestTooLongError
from kvfold.server.metrics import parse, render

from helpers import chunked_reference
from test_engine import long_ids, text_ids

SP = dict(ignore_eos=True)


def refcounts(pool):
    return [pool.refcount(p) for p in range(pool.num_pages)]


def cached_pages(engine, prompt):
    """Pages of the longest cached prefix of `prompt` (without counting a lookup)."""
    pc = engine.prefix_cache
    n, _, entry = pc.find(pc.keys_for(prompt), len(prompt), count=False)
    return n, list(entry.pages) if entry is not None else []


def record_logits(monkeypatch, model):
    """Spy on forward_batch: (pos before, logits) of every sequence fed, in call order."""
    seen = []
    real = model.forward_batch

    def spy(batch, last_only=True, **mode):
        starts = [st.pos for _, st in batch]
        out = real(batch, last_only=last_only, **mode)
        seen.extend(zip(starts, (lg.clone() for lg in out)))
        return out

    monkeypatch.setattr(model, "forward_batch", spy)
    return seen


def step(engine, out):
    for o in engine.step():
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def run_all(engine, out=None):
    out = {} if out is None else out
    while engine.has_unfinished():
        step(engine, out)
    return out


def assert_no_pages_but_the_caches(engine):
    pool, m = engine.pages, engine.metrics()
    assert (m["live_states"], m["running"], m["queue_depth"]) == (0, 0, 0)
    assert m["pages_used"] == m["prefix_cache_pages"] == engine.prefix_cache.pages_held
    engine.clear_prefix_cache()
    m = engine.metrics()
    assert (m["pages_used"], m["pages_shared"], m["prefix_cache_pages"], m["page_bytes_used"]) == (0, 0, 0, 0)
    assert m["pages_free"] == m["pages_total"] == pool.num_pages
    assert refcounts(pool) == [0] * pool.num_pages


def test_prefix_hit_reuses_cached_pages_by_reference(tiny, monkeypatch):
    a = long_ids(tiny, 300, "R")
    b = a[:270] + tiny.tokenizer.encode(" and a different ending here")
    cold = Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0)
    cold_logits = record_logits(monkeypatch, tiny)
    (cb,) = cold.generate([b], SamplingParams(max_tokens=6, **SP))
    cold_tail = [(p, lg) for p, lg in cold_logits if p >= 256]
    monkeypatch.undo()

    engine = Engine(tiny, max_seq_len=1024)
    pool = engine.pages
    (ca,) = engine.generate([a], SamplingParams(max_tokens=6, **SP))
    assert ca.token_ids == chunked_reference(tiny, a, 6, stop_ids=[])
    n, pages = cached_pages(engine, b)
    assert n == 256 and len(pages) == 2
    # the entries at 128 and 256 hold a's first two pages; a itself has finished and let go
    assert [pool.refcount(p) for p in pages] == [2, 1] and pool.used_pages == 2

    warm_logits = record_logits(monkeypatch, tiny)
    rid = engine.add_request(b, SamplingParams(max_tokens=6, **SP))
    out = step(engine, {})
    st = engine._seqs[rid].state
    assert st.page_table[:2] == pages  # the very same physical pages: reused by reference, not copied
    assert [pool.refcount(p) for p in pages] == [3, 2] and engine.metrics()["pages_shared"] == 2
    assert pool.used_pages == 2 + len(st.page_table) - 2
    run_all(engine, out)
    assert out[rid] == cb.token_ids == chunked_reference(tiny, b, 6, stop_ids=[])
    # logits of every forward after the restored prefix equal the cold run's, bit for bit
    assert [p for p, _ in warm_logits] == [p for p, _ in cold_tail]
    assert all(torch.equal(w, c) for (_, w), (_, c) in zip(warm_logits, cold_tail))
    m = engine.metrics()
    assert m["prefix_cache_hit_tokens"] == 256 and m["prefill_tokens"] == len(a) + len(b) - 256
    assert_no_pages_but_the_caches(engine)


def test_admission_waits_for_pages_and_refuses_what_never_fits(tiny):
    prompts = [text_ids(tiny, f"waiting for pages {i}") for i in range(3)]
    engine = Engine(tiny, max_seq_len=512, prefix_cache_bytes=0, kv_page_bytes=3 * tiny.new_page_pool(0).page_bytes)
    assert engine.metrics()["pages_total"] == 3
    with pytest.raises(RequestTooLongError, match="pages"):  # 4 pages: could never fit, refused up front
        engine.add_request(prompts[0], SamplingParams(max_tokens=400))
    sp = SamplingParams(max_tokens=200, **SP)  # 2 pages each: only one runs at a time
    rids = [engine.add_request(p, sp) for p in prompts]
    out = step(engine, {r: [] for r in rids})
    m = engine.metrics()
    assert (m["running"], m["queue_depth"], m["pages_used"], m["pages_free"]) == (1, 2, 2, 1)
    most = 0
    while engine.has_unfinished():
        step(engine, out)
        most = max(most, engine.metrics()["running"])
    assert most == 1 and engine.metrics()["finished_error"] == 0
    assert [out[r] for r in rids] == [chunked_reference(tiny, p, 200, stop_ids=[]) for p in prompts]
    assert engine.metrics()["pages_used"] == 0


def test_cancellation_frees_pages_at_once_and_nothing_leaks(tiny):
    shared = long_ids(tiny, 260, "W")
    prompts = [shared + tiny.tokenizer.encode(f" tail {i}") for i in range(4)] + \
              [text_ids(tiny, "short one"), long_ids(tiny, 200, "X")]
    engine = Engine(tiny, max_seq_len=512, max_running=3, max_batch_tokens=300)
    pool = engine.pages
    sp = SamplingParams(max_tokens=8, **SP)
    rids = [engine.add_request(p, sp) for p in prompts]
    victims = [engine.add_request(shared + [5, 6, 7], SamplingParams(max_tokens=40, **SP)),
               engine.add_request(long_ids(tiny, 300, "Y"), SamplingParams(max_tokens=40, **SP))]
    out = {r: [] for r in rids + victims}
    cancelled = set()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        for v in victims:
            seq = engine._seqs.get(v)
            if v in cancelled or seq is None or seq.state is None:
                continue
            # one mid-prefill (after its first chunk), one mid-decode
            if (v == victims[1] and seq.state.pos >= 128) or (v == victims[0] and len(out[v]) >= 3):
                own = [p for p in seq.state.page_table if pool.refcount(p) == 1]
                used = pool.used_pages
                assert engine.cancel(v)
                cancelled.add(v)
                assert pool.used_pages == used - len(own)  # its own pages are free right away
                assert all(pool.refcount(p) == 0 for p in own)
    assert cancelled == set(victims)
    for r, p in zip(rids, prompts):
        assert out[r] == chunked_reference(tiny, p, 8, stop_ids=[]), r
    m = engine.metrics()
    assert m["prefix_cache_hits"] >= 2 and m["requests_cancelled"] == 2
    assert_no_pages_but_the_caches(engine)


def test_evicting_the_prefix_cache_never_changes_a_running_sequence(tiny):
    a = long_ids(tiny, 300, "E")
    b = a[:180] + tiny.tokenizer.encode(" runs on")  # 212 positions with its output: 2 pages
    ref_b = chunked_reference(tiny, b, 24, stop_ids=[])
    page_bytes = tiny.new_page_pool(0).page_bytes
    engine = Engine(tiny, max_seq_len=512, kv_page_bytes=6 * page_bytes)
    pool = engine.pages
    engine.generate([a], SamplingParams(max_tokens=2, **SP))
    _, (p0, p1) = cached_pages(engine, a)  # entries at 128 (page p0) and 256 (pages p0, p1)
    rb = engine.add_request(b, SamplingParams(max_tokens=24, **SP))
    out = {}
    for _ in range(4):
        step(engine, out)
    st = engine._seqs[rb].state
    assert engine._seqs[rb].cached_tokens == 128 and st.page_table[0] == p0 and len(st.page_table) == 2
    assert len(out[rb]) >= 2
    assert (pool.refcount(p0), pool.refcount(p1), pool.free_pages) == (3, 1, 3)
    # c needs 4 pages, 3 are free: admitting it evicts the least recently used entry (256), whose
    # page p1 only the cache held; b's shared page p0 stays
    c = long_ids(tiny, 400, "F")
    rc = engine.add_request(c, SamplingParams(max_tokens=4, **SP))
    step(engine, out)
    m = engine.metrics()
    assert (m["running"], m["prefix_cache_evictions"]) == (2, 1)
    assert cached_pages(engine, a) == (128, [p0])  # the 256 entry went, the one b hit stayed
    assert pool.refcount(p0) == 2 and p1 in engine._seqs[rc].state.page_table
    engine.clear_prefix_cache()  # dropping the entry b was restored from changes nothing either
    assert pool.refcount(p0) == 1 and st.page_table[0] == p0
    run_all(engine, out)
    assert out[rb] == ref_b
    assert out[rc] == chunked_reference(tiny, c, 4, stop_ids=[])
    assert_no_pages_but_the_caches(engine)


def test_cache_budget_counts_pages_only_the_cache_holds(tiny):
    a = long_ids(tiny, 300, "B")
    probe = Engine(tiny, max_seq_len=512)
    probe.generate([a], SamplingParams(max_tokens=2, **SP))
    blobs, page_bytes = probe.prefix_cache.blob_bytes, probe.pages.page_bytes
    assert probe.metrics()["prefix_cache_bytes"] == blobs + 2 * page_bytes
    # a budget for both blobs but only one page: once a finishes, its pages count and the LRU entry goes
    engine = Engine(tiny, max_seq_len=512, prefix_cache_bytes=blobs + page_bytes)
    rid = engine.add_request(a, SamplingParams(max_tokens=3, **SP))
    while engine.prefix_cache.entries < 2:
        engine.step()
    assert rid in engine._seqs  # a still runs: its pages cost the cache nothing yet
    assert engine.metrics()["prefix_cache_bytes"] == blobs
    run_all(engine)
    m = engine.metrics()
    assert m["prefix_cache_entries"] == 1 and m["prefix_cache_evictions"] == 1
    assert m["prefix_cache_bytes"] <= blobs + page_bytes and m["pages_used"] == 2
    n, pages = cached_pages(engine, a)
    assert n == 256 and len(pages) == 2  # the newer entry (256) stayed


def test_page_metrics_in_prometheus_text(tiny):
    engine = Engine(tiny, max_seq_len=512)
    rid = engine.add_request(long_ids(tiny, 200, "M"), SamplingParams(max_tokens=4, **SP))
    engine.step()
    m = engine.metrics()
    text = parse(render(m))
    assert text["kvfold_kv_pages"] == m["pages_total"] == engine.pages.num_pages
    assert text["kvfold_kv_pages_used"] == len(engine._seqs[rid].state.page_table) == 2
    assert text["kvfold_kv_pages_free"] == m["pages_total"] - 2
    assert text["kvfold_kv_page_bytes_used"] == 2 * engine.pages.page_bytes
    assert text["kvfold_kv_page_bytes"] == engine.pages.nbytes
    assert "kvfold_kv_pages_shared" in text and "kvfold_prefix_cache_pages" in text
    engine.cancel_all()
    assert parse(render(engine.metrics()))["kvfold_kv_pages_used"] == 1  # the cache's page for block 128


def test_private_pools_when_pages_are_off(tiny):
    a = long_ids(tiny, 300, "Q")
    engine = Engine(tiny, max_seq_len=512, kv_page_bytes=0)
    assert engine.pages is None
    first, again = (engine.generate([a], SamplingParams(max_tokens=4, **SP))[0] for _ in range(2))
    assert first.token_ids == again.token_ids == chunked_reference(tiny, a, 4, stop_ids=[])
    assert again.cached_tokens == 256  # full snapshots, as before pages existed
    m = engine.metrics()
    assert (m["pages_total"], m["pages_used"], m["prefix_cache_pages"]) == (0, 0, 0)
    assert m["prefix_cache_bytes"] == m["prefix_cache_blob_bytes"] > 0


def expected_refcounts(engine):
    """Refcount each page must have: one per live state holding it plus the cache's references."""
    want = [0] * engine.pages.num_pages
    for seq in engine._seqs.values():
        if seq.state is not None:
            for p in seq.state.page_table:
                want[p] += 1
    for p, k in engine.prefix_cache._page_refs.items():
        want[p] += k
    return want


def random_workload(engine, model, base: list[int], rng, vocab: int, steps: int, adds_until: int, lengths) -> None:
    """Random arrivals (prefixes of `base` plus a few random ids, `lengths` new tokens) and
    cancellations: at every step each page's refcount is exactly its holders (states and cache
    entries); what finishes equals a cold run of the plain model API."""
    prompts, finished, cancelled = {}, {}, set()
    for i in range(steps):
        if i < adds_until and rng.random() < 0.5:
            p = base[:rng.choice([130, 200, 260, 270])] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
            n = rng.choice(lengths)
            rid = engine.add_request(p, SamplingParams(max_tokens=n, **SP))
            prompts[rid] = (p, n)
        for o in engine.step():
            finished.setdefault(o.request_id, []).extend(o.new_token_ids)
        if engine._seqs and rng.random() < 0.15:
            rid = rng.choice(sorted(engine._seqs))
            assert engine.cancel(rid)
            cancelled.add(rid)
        assert [engine.pages.refcount(p) for p in range(engine.pages.num_pages)] == expected_refcounts(engine)
    cancelled |= set(engine._seqs)  # still unfinished: cancelled now
    engine.cancel_all()
    assert engine.pages.used_pages == engine.prefix_cache.pages_held
    done = [r for r in prompts if r not in cancelled]
    assert done and engine.metrics()["prefix_cache_hits"] > 0
    for r in done:
        p, n = prompts[r]
        assert finished[r] == chunked_reference(model, p, n, stop_ids=[]), r
    assert_no_pages_but_the_caches(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_keeps_refcounts_exact(tiny, seed):
    """Random arrivals and cancellations over a small pool (`random_workload`)."""
    import random
    page_bytes = tiny.new_page_pool(0).page_bytes
    engine = Engine(tiny, max_seq_len=512, max_running=3, max_batch_tokens=260, kv_page_bytes=8 * page_bytes,
                    prefix_cache_bytes=200_000)
    random_workload(engine, tiny, long_ids(tiny, 270, f"Z{seed}"), random.Random(seed), 256, 40, 24, [2, 5, 60])

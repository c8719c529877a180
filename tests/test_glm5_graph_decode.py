"""GLM-5.3's graph-decode step (models/glm5/graph_step.py): it agrees with the forward at every
cursor kind (KDA states, k-pool and page boundaries, a prefix hit), issues the same ops on the same
buffers at every cursor without a host sync, and serves the engine's requests as the forward does;
what it cannot run is refused."""
import pytest
import torch

from kvfold import SamplingParams
from kvfold.engine.graphs import DecodeGraphs
from kvfold.errors import ConfigError
from kvfold.models.glm5.config import glm5_config_from_dict
from kvfold.models.glm5.model import Glm5Model

from helpers import KdaReadoutGains, ops_for, random_ids, rows_within_paths_bound
from test_gpu_check import _script
from test_graph_decode import _Trace, forward_and_graph_runs

CAP = 300


@pytest.fixture(scope="module")
def glm():
    """The tiny GLM-5.3 of bench/gpu_check.py (KDA, full and shared DSA layers, dense and routed
    MLPs, k-pools of 4), random weights at O(1) activations, the byte tokenizer of tiny-random."""
    import kvfold
    gc = _script()
    model = Glm5Model(glm5_config_from_dict(gc.GLM_TINY))
    gc.glm_random_(model, 0)
    model.set_batch_invariant(False)
    model.tokenizer = kvfold.load_model("tiny-random").tokenizer
    return model


def later_errors(glm, g64, gains, runs, n):
    """The forward continued by n tokens from each (graph-stepped, forward-stepped, float64) triple
    of states: the worst row of each fp32 path as a fraction of its bound against float64
    (helpers.rows_within_paths_bound, with the KDA readouts' gains of those rows)."""
    later_graph = later_forward = 0.0
    for a, b, c in runs:
        ids = random_ids(n, glm.config.vocab_size, seed=a.pos)
        exact = g64.forward(ids, c)
        blocks = gains.rows()
        later_graph = max(later_graph, rows_within_paths_bound(glm.forward(ids, a), exact, blocks))
        later_forward = max(later_forward, rows_within_paths_bound(glm.forward(ids, b), exact, blocks))
    return later_graph, later_forward


def test_a_glm_graph_step_is_as_accurate_as_the_forward_at_every_cursor(glm):
    """Sequences at position 1 (one row), inside the first k-pool, past a few pools (restored to
    a snapshot after 30 more tokens, whose rows stay in its slot), across the first page (128),
    and a prefix hit (its first page by reference): over 40 steps, the graph
    step's logits, and the forward's, are within the rounding bound of two fp32 evaluations of the
    same formulas of a float64 evaluation of the same model, row by row (helpers.fp32_paths_bound
    with each row's KDA readout gains, helpers.KdaReadoutGains: where a KDA head's output cancels,
    the gated norm after it amplifies one rounding of the readout hundreds of times, whichever
    kernel computes it); a wrong row, mask or selection would be off by orders of magnitude more.
    So is what the forward computes next from the states the graph steps left."""
    g64 = Glm5Model(glm.config, dtype=torch.float64)
    g64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in glm.state_dict().items()})
    g64.set_batch_invariant(False)
    pool = glm.new_page_pool(48)
    arena = glm.new_decode_arena(6, CAP, pool)
    vocab = glm.config.vocab_size
    runs = []  # (arena state, fp32 forward state, float64 state)
    for n in (1, 3, 9, 126, 200):
        ids = random_ids(n, vocab, seed=n)
        run = (glm.new_state(capacity=CAP, pages=pool, arena=arena), glm.new_state(capacity=CAP, pages=pool),
               g64.new_state(capacity=CAP))
        for model, st in zip((glm, glm, g64), run):
            model.forward(ids, st)
        runs.append(run)
    donor = runs[-1]
    hit = glm.new_state(capacity=CAP, pages=pool, arena=arena, prefix_pages=donor[1].share_prefix(128))
    hit.restore(donor[1].snapshot(pools=False))
    twin, twin64 = glm.new_state(capacity=CAP, pages=pool), g64.new_state(capacity=CAP)
    twin.restore(donor[1].snapshot())
    g64.forward(random_ids(200, vocab, seed=200), twin64)
    runs.append((hit, twin, twin64))
    back = runs[2][0]  # restored to an earlier snapshot: its slot holds indexer rows past its length
    blob = back.snapshot()
    glm.forward(random_ids(30, vocab, seed=30), back)
    back.restore(blob)
    graphs = DecodeGraphs(glm, arena, 6)
    g = torch.Generator().manual_seed(5)
    gains = KdaReadoutGains(g64)
    worst_graph = worst_forward = 0.0
    for _ in range(40):
        toks = torch.randint(0, vocab, (len(runs),), generator=g)
        got = graphs.step([(int(t), a) for t, (a, _, _) in zip(toks, runs)])
        want = torch.cat(glm.forward_batch([(t[None], b) for t, (_, b, _) in zip(toks, runs)]))
        exact = torch.cat(g64.forward_batch([(t[None], c) for t, (_, _, c) in zip(toks, runs)]))
        blocks = gains.rows()
        worst_graph = max(worst_graph, rows_within_paths_bound(got, exact, blocks))
        worst_forward = max(worst_forward, rows_within_paths_bound(want, exact, blocks))
    assert 0 < worst_graph <= 1 and 0 < worst_forward <= 1
    for a, b, c in runs:
        assert a.pos == b.pos == c.pos and a.kda_base == a.pos and all(d.len == a.pos for d in a._dsa_states())
    later_graph, later_forward = later_errors(glm, g64, gains, runs, 6)
    assert 0 < later_graph <= 1 and 0 < later_forward <= 1


def test_a_glm_graph_step_issues_the_same_ops_on_the_same_buffers_and_never_syncs(glm):
    """As DeepSeek-V4's (tests/test_graph_decode.py): the same ops, shapes, strides and persistent
    buffers at other cursors and slots (with a padding row, and with rewound states that replay
    from their base), no value read back to the host."""
    pool = glm.new_page_pool(20)
    arena = glm.new_decode_arena(3, CAP, pool, max_rewind=2)
    vocab = glm.config.vocab_size
    states = []
    for n in (2, 7, 140):
        st = glm.new_state(capacity=CAP, max_rewind=2, pages=pool, arena=arena)
        glm.forward(random_ids(n, vocab, seed=n), st)
        states.append(st)
    tokens, positions, slots = (torch.zeros(3, dtype=torch.long) for _ in range(3))
    extras = torch.zeros(3, 4, dtype=torch.long)
    persistent = arena.tensors() + list(glm.parameters()) + list(glm.buffers()) + [tokens, positions, slots, extras]
    traces = []
    ops = ops_for(native=False)  # the torch path a GPU model takes
    with torch.inference_mode():
        for rows in ([0, 1, 2], [2, 0, 1], [1, None, 0], [0, 1, 2]):
            if len(traces) == 3:  # rewound: the next step replays from the base
                for st in states:
                    st.rewind_to(st.pos - 2)
            extras.zero_()
            for i, r in enumerate(rows):
                tokens[i], positions[i] = 5 * i + 2, 0 if r is None else states[r].pos
                slots[i] = arena.scratch if r is None else states[r].slot
                if r is not None:
                    extras[i] = torch.tensor(states[r].graph_inputs(1))
            trace = _Trace(persistent)
            with trace:
                glm.decode_graph_step(ops, arena, tokens, positions, slots, 256, extras)
            traces.append(trace)
            for r in rows:
                if r is not None:
                    states[r].after_graph_step(1)
    assert len(traces[0].ops) > 100
    assert all(t.syncs == [] for t in traces)
    assert all(t.ops == traces[0].ops for t in traces[1:])


def test_glm_graph_decode_in_the_engine_gives_the_forward_engines_tokens(glm):
    """More requests than slots, one cancelled mid-decode, two sharing a cached 128-token prefix:
    the same greedy tokens as the engine without graphs, no stale capture, every slot free."""
    vocab = glm.config.vocab_size
    shared = random_ids(128, vocab, seed=1).tolist()
    prompts = [random_ids(5, vocab, seed=2).tolist(), shared + [3, 4, 5], random_ids(60, vocab, seed=3).tolist(),
               shared + [7, 8], random_ids(140, vocab, seed=4).tolist()]
    (want, m_want, _), (got, m, engine) = forward_and_graph_runs(
        glm, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), cancel=(6, 2),
        max_seq_len=CAP, max_running=3)
    assert got == want and len(got[2]) < 20
    assert m["prefix_cache_hits"] == m_want["prefix_cache_hits"] >= 1
    assert m["graph_steps"] >= 20 and m["graph_recaptures"] == 0 and engine.arena.free_slots == 3


def test_glm_graph_steps_of_several_rows_replay_from_the_base_as_the_forward_does(glm):
    """max_rewind 3: steps of four rows a sequence (its token and three drafts), each followed by a
    rewind of two or three of them, so every step starts above its KDA base and replays the
    inputs held. Over the steps the graph's logits, and the forward's, are within the rounding bound
    of a float64 evaluation row by row (as in the test above), and so is what the forward
    computes after them."""
    g64 = Glm5Model(glm.config, dtype=torch.float64)
    g64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in glm.state_dict().items()})
    g64.set_batch_invariant(False)
    pool = glm.new_page_pool(30)
    arena = glm.new_decode_arena(3, CAP, pool, max_rewind=3)
    vocab = glm.config.vocab_size
    runs = []
    for n in (2, 61, 126):
        ids = random_ids(n, vocab, seed=n)
        run = (glm.new_state(capacity=CAP, max_rewind=3, pages=pool, arena=arena),
               glm.new_state(capacity=CAP, max_rewind=3, pages=pool), g64.new_state(capacity=CAP, max_rewind=3))
        for model, st in zip((glm, glm, g64), run):
            model.forward(ids, st)
        runs.append(run)
    graphs = DecodeGraphs(glm, arena, 12)
    g = torch.Generator().manual_seed(9)
    gains = KdaReadoutGains(g64)
    worst_graph = worst_forward = 0.0
    for step in range(8):
        toks = torch.randint(0, vocab, (len(runs), 4), generator=g)
        got = graphs.step([(t.tolist(), a) for t, (a, _, _) in zip(toks, runs)])
        want = torch.cat(glm.forward_batch([(t, b) for t, (_, b, _) in zip(toks, runs)], last_only=False))
        exact = torch.cat(g64.forward_batch([(t, c) for t, (_, _, c) in zip(toks, runs)], last_only=False))
        blocks = gains.rows()
        worst_graph = max(worst_graph, rows_within_paths_bound(got, exact, blocks))
        worst_forward = max(worst_forward, rows_within_paths_bound(want, exact, blocks))
        for a, b, c in runs:  # keep one or two of the four, as a verify does
            back = a.pos - 3 + step % 2
            for st in (a, b, c):
                st.rewind_to(back)
    assert graphs.draft_rows == 8 * 3 * 3 and 0 < worst_graph <= 1 and 0 < worst_forward <= 1
    for a, b, c in runs:
        assert a.pos == b.pos == c.pos and (a.kda_base, a.kda_cuts) == (b.kda_base, b.kda_cuts)
    later_graph, later_forward = later_errors(glm, g64, gains, runs, 5)
    assert 0 < later_graph <= 1 and 0 < later_forward <= 1


def test_glm_graph_decode_verifies_ngram_drafts_as_the_forward_engine_does(glm):
    """speculative="ngram": verify steps run as graph steps and rewind what they reject; greedy
    tokens are the forward engine's. The prompts repeat a phrase among random tokens, so the
    drafter proposes its continuation. (A periodic prompt would not do: its identical k-pools tie
    in the indexer's scores, and two fp32 evaluations may then rank them differently.)"""
    vocab = glm.config.vocab_size
    phrase = random_ids(6, vocab, seed=70).tolist()
    prompts = [random_ids(n, vocab, seed=n).tolist() + phrase + random_ids(17, vocab, seed=n + 1).tolist() + phrase[:3]
               for n in (40, 80)]
    (want, _, _), (got, m, _) = forward_and_graph_runs(
        glm, prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), max_seq_len=CAP,
        max_running=2, speculative="ngram", num_draft=3)
    assert got == want
    assert m["graph_draft_rows"] > 0 and m["spec_accepted_tokens"] < m["spec_draft_tokens"]  # some rejected


def test_glm_graph_decode_refuses_what_it_cannot_run(glm):
    """FP8 KV in the arena."""
    pool = glm.new_page_pool(4, kv_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_dtype"):
        glm.new_state(capacity=CAP, pages=pool, kv_dtype="fp8", arena=glm.new_decode_arena(1, CAP, pool))

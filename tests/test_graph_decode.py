"""Graph decode (engine/graphs.py, models/deepseek_v4/graph_step.py): the capturable decode step
agrees with the forward on every layer kind and cursor; it issues the same ops on the same
buffers at every position and reads nothing back to the host (what a CUDA graph needs); states
in a SlotArena behave as private ones; a step of several rows a sequence is the forward's verify
chunk; the engine's graph decode gives the forward engine's tokens through admission,
cancellation, prefix hits, n-gram and MTP drafts and forked choices; a replaced weight
recaptures, a failed capture falls back; every refusal changes nothing."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.engine.graphs import DecodeGraphs, buckets_for
from kvfold.errors import CapacityError, ConfigError, SharedPageWriteError, StateMismatchError
from kvfold.numerics import topk_lower_index
from kvfold.state.arena import ArenaFullError

from helpers import fp32_paths_bound, ops_for, random_ids
from test_engine import long_ids

CAP, REWIND = 512, 2


@pytest.fixture(scope="module")
def model():
    m = kvfold.load_model("tiny-random")  # sliding, CSA (ratio 4), HCA (ratio 32), CSA; window 32
    m.set_batch_invariant(False)
    return m


def twin_states(model, pool, arena, prompts):
    """For each prompt, a state in the arena and a private twin, both prefilled by the forward."""
    pairs = []
    for ids in prompts:
        a = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool, arena=arena)
        b = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool)
        model.forward(ids, a)
        model.forward(ids, b)
        pairs.append((a, b))
    return pairs


def test_a_graph_step_agrees_with_the_forward_on_every_layer_kind_and_cursor(model):
    """Sequences at cursors that exercise each mask: a window not yet full (pos < W), the first
    compressor windows (pos < r), windows closing at CSA's r = 4 and HCA's r = 32 during the
    steps, a window ring that has wrapped, a page boundary (128), a rewound state and a prefix
    hit (pages by reference plus a snapshot). Logits agree within the bound of two fp32
    evaluations (helpers.fp32_paths_bound), and so do the logits the forward gets afterwards
    from the states each path left."""
    pool = model.new_page_pool(64)
    arena = model.new_decode_arena(7, CAP, pool, max_rewind=REWIND)
    vocab = model.config.vocab_size
    prompts = [random_ids(n, vocab, seed=n) for n in (1, 3, 30, 120, 127, 250)]
    pairs = twin_states(model, pool, arena, prompts)
    rewound = pairs[3]
    model.forward(random_ids(2, vocab, seed=9), rewound[0])
    model.forward(random_ids(2, vocab, seed=9), rewound[1])
    rewound[0].rewind_to(rewound[0].pos - 2)
    rewound[1].rewind_to(rewound[1].pos - 2)
    donor = pairs[5][1]  # a prefix hit: the first page by reference, the rest from the snapshot
    hit = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool, arena=arena,
                          prefix_pages=donor.share_prefix(128))
    hit.restore(donor.snapshot(pools=False))
    twin = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool)
    twin.restore(donor.snapshot())
    pairs.append((hit, twin))
    graphs = DecodeGraphs(model, arena, 7)
    g = torch.Generator().manual_seed(3)
    closed = set()
    for _ in range(40):
        toks = torch.randint(0, vocab, (len(pairs),), generator=g)
        closed |= {(a.pos + 1) % 32 == 0 for a, _ in pairs} | {(a.pos + 1) % 4 == 0 for a, _ in pairs}
        got = graphs.step([(int(t), a) for t, (a, _) in zip(toks, pairs)])
        want = torch.cat(model.forward_batch([(t[None], b) for t, (_, b) in zip(toks, pairs)]))
        assert (got - want).abs().max().item() <= fp32_paths_bound(want, model.config.num_hidden_layers)
    assert closed == {True, False}
    for a, b in pairs:
        assert a.pos == b.pos and a.written_until == b.pos
        ids = random_ids(5, vocab, seed=a.pos)
        later_a, later_b = model.forward(ids, a), model.forward(ids, b)
        assert (later_a - later_b).abs().max().item() <= fp32_paths_bound(later_b, model.config.num_hidden_layers)


def forward_and_graph_runs(model, prompts, params, cancel=None, **engine_kw):
    """The same requests through the forward engine and the graph engine: for each, (tokens per
    request, metrics, engine). `cancel` (step, i): request i is cancelled after that step."""
    runs = []
    for graphs in (False, True):
        engine = Engine(model, decode_graphs=graphs, batch_invariant=False, **engine_kw)
        ids = [engine.add_request(p, params) for p in prompts]
        out, steps = {}, 0
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if cancel is not None and steps == cancel[0]:
                engine.cancel(ids[cancel[1]])
        runs.append(([out.get(i, []) for i in ids], engine.metrics(), engine))
    return runs


class _Trace(TorchDispatchMode):
    """Every op's name, its tensors' shapes, dtypes and strides, and for tensors of persistent
    storage (weights, arena, the step's inputs) which one: a graph replays exactly this."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.item",
             "aten.equal", "aten.is_nonzero")

    def __init__(self, persistent: list[torch.Tensor]):
        super().__init__()
        self.ids = {t.untyped_storage().data_ptr(): i for i, t in enumerate(persistent)}
        self.ops, self.syncs = [], []

    def _describe(self, x):
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), x.dtype, tuple(x.stride()), self.ids.get(x.untyped_storage().data_ptr()))
        if isinstance(x, (list, tuple)):
            return tuple(self._describe(y) for y in x)
        return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(x).__name__

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if any(name.startswith(s) for s in self.SYNCS):
            self.syncs.append(name)
        self.ops.append((str(func), self._describe(args), self._describe(sorted((kwargs or {}).items()))))
        return func(*args, **(kwargs or {}))


def test_a_graph_step_issues_the_same_ops_on_the_same_buffers_at_every_cursor_and_never_syncs(model):
    """What a CUDA graph needs, checked on the CPU with torch alone (native kernels off, as on a
    GPU): steps whose rows sit at different cursors (closing a window or not, before position 0's
    window fills, after the ring wrapped, in other slots, one row of padding) issue the same ops,
    shapes and strides on the same persistent buffers, and no op reads a value back to the host.
    The tracer itself is shown to catch a sync: the top-k's host-checked shortcut."""
    pool = model.new_page_pool(40)
    arena = model.new_decode_arena(4, CAP, pool, max_rewind=REWIND)
    vocab = model.config.vocab_size
    pairs = twin_states(model, pool, arena, [random_ids(n, vocab, seed=n) for n in (2, 31, 64, 200)])
    states = [a for a, _ in pairs]
    persistent = arena.tensors() + list(model.parameters()) + list(model.buffers())
    tokens, positions, slots = (torch.zeros(4, dtype=torch.long) for _ in range(3))
    persistent += [tokens, positions, slots]
    traces = []
    ops = ops_for(native=False)  # the torch path a GPU model takes
    with torch.inference_mode():
        for rows in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [0, 2, 3, None]):
            for i, r in enumerate(rows):
                tokens[i] = 7 * i + 1
                positions[i] = 0 if r is None else states[r].pos
                slots[i] = arena.scratch if r is None else states[r].slot
            trace = _Trace(persistent)
            with trace:
                model.decode_graph_step(ops, arena, tokens, positions, slots)
            traces.append(trace)
            for r in rows:
                if r is not None:
                    states[r].pos = states[r].written_until = states[r].pos + 1
    assert len(traces[0].ops) > 100
    assert all(t.syncs == [] for t in traces)
    assert all(t.ops == traces[0].ops for t in traces[1:])
    check = _Trace([])
    with check:
        topk_lower_index(torch.randn(3, 40), 5)
    assert check.syncs


def test_a_state_in_an_arena_runs_snapshots_and_restores_as_a_private_one(model):
    """Arena rings are views: the forward on an arena state gives a private state's bits, their
    snapshots are the same bytes, and a snapshot moves either way and continues bit for bit."""
    pool = model.new_page_pool(24)
    arena = model.new_decode_arena(2, CAP, pool, max_rewind=REWIND)
    ids = random_ids(150, model.config.vocab_size, seed=4)
    a = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool, arena=arena)
    b = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool)
    assert torch.equal(model.forward(ids, a), model.forward(ids, b))
    assert a.snapshot() == b.snapshot()
    c = model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool, arena=arena)
    c.restore(b.snapshot())
    d = model.new_state(capacity=CAP, max_rewind=REWIND)
    d.restore(a.snapshot())
    more = random_ids(40, model.config.vocab_size, seed=5)
    assert torch.equal(model.forward(more, c), model.forward(more, d))
    ring = arena.rings[(0, "window")]
    assert c.layers[0].window.store.data.data_ptr() == ring[c.slot].data_ptr()


def test_graph_refusals_change_nothing(model):
    """Each refusal raises its typed error and leaves the states, the arena and the pool as they were."""
    pool = model.new_page_pool(20)
    arena = model.new_decode_arena(2, 256, pool, max_rewind=REWIND)
    vocab = model.config.vocab_size
    graphs = DecodeGraphs(model, arena, 2)
    a = model.new_state(capacity=256, max_rewind=REWIND, pages=pool, arena=arena)
    model.forward(random_ids(130, vocab, seed=1), a)
    private = model.new_state(capacity=256, max_rewind=REWIND, pages=pool)
    free_pages = pool.free_pages

    def unchanged():
        return [t.clone() for t in arena.tensors()], a.pos, pool.free_pages, arena.free_slots

    before = unchanged()
    for call, err in (
            (lambda: graphs.step([(1, private)]), StateMismatchError),
            (lambda: graphs.step([(1, a), (2, a)]), StateMismatchError),
            (lambda: model.new_state(capacity=512, max_rewind=REWIND, pages=pool, arena=arena), CapacityError),
            (lambda: model.new_state(capacity=256, max_rewind=0, pages=pool, arena=arena), CapacityError),
            (lambda: model.new_state(capacity=256, max_rewind=REWIND, pages=pool, arena=arena, kv_dtype="fp8"),
             ConfigError),
            (lambda: model.new_state(capacity=256, max_rewind=REWIND, arena=arena), StateMismatchError)):
        with pytest.raises(err):
            call()
        after = unchanged()
        assert all(torch.equal(x, y) for x, y in zip(before[0], after[0])) and before[1:] == after[1:]
    assert pool.free_pages == free_pages
    # the page the next token writes is shared (a prefix-cache entry holds it): refused, not written
    held = a.share_prefix(128)
    shared = model.new_state(capacity=256, max_rewind=REWIND, pages=pool, arena=arena, prefix_pages=held)
    before = unchanged()
    with pytest.raises(SharedPageWriteError):
        graphs.step([(1, shared)])
    after = unchanged()
    assert all(torch.equal(x, y) for x, y in zip(before[0], after[0])) and shared.pos == 0
    with pytest.raises(ArenaFullError):
        model.new_state(capacity=256, max_rewind=REWIND, pages=pool, arena=arena)
    shared.free()
    one = model.new_state(capacity=1, max_rewind=REWIND, pages=pool, arena=arena)
    graphs.step([(1, one)])
    with pytest.raises(CapacityError):
        graphs.step([(1, one)])
    assert one.pos == 1
    pool.decref(held)


def test_graph_decode_in_the_engine_gives_the_forward_engines_tokens_through_admission_cancel_and_prefix_hits():
    """The trained tiny model, more requests than running slots (admission while others decode),
    one cancelled mid-decode, prompts sharing a cached 128-token prefix: the same greedy tokens as
    the engine without graphs, one capture per bucket used, none stale, every slot free at the end."""
    model = kvfold.load_model("tiny")
    shared = long_ids(model, 1000, "shared")[:128]
    tails = [shared + long_ids(model, n, f"tail {n}")[1:] for n in (9, 40, 3)]
    prompts = [long_ids(model, 5, "own"), tails[0], long_ids(model, 70, "own"), tails[1], long_ids(model, 140, "own"),
               tails[2]]
    (want, m_want, _), (got, m, engine) = forward_and_graph_runs(
        model, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), cancel=(8, 2),
        max_seq_len=384, max_running=3)
    assert got == want
    assert len(got[2]) < 24 and all(len(t) == 24 for i, t in enumerate(got) if i != 2)
    assert m["prefix_cache_hits"] == m_want["prefix_cache_hits"] >= 2
    assert m["graph_buckets"] == m["graph_captures"] >= 2 and m["graph_recaptures"] == 0
    assert m["graph_steps"] >= 24 and m["graph_replays"] == 0  # on the CPU every graph step runs eagerly
    assert engine.arena.free_slots == 3 and m["live_states"] == 0


def test_a_replaced_weight_recaptures_and_the_step_reads_the_new_one(model):
    """Reassigning a weight, moving a weight's storage, or replacing a module changes what the
    captured step read: the next step recaptures (counted) and its logits follow the new weight,
    as the forward's do; a step where nothing moved keeps its graph."""
    m = kvfold.load_model("tiny-random")
    m.set_batch_invariant(False)
    pool = m.new_page_pool(16)
    arena = m.new_decode_arena(2, CAP, pool)
    vocab = m.config.vocab_size
    graphs = DecodeGraphs(m, arena, 2)
    a = m.new_state(capacity=CAP, pages=pool, arena=arena)
    b = m.new_state(capacity=CAP, pages=pool)
    ids = random_ids(20, vocab, seed=2)
    m.forward(ids, a)
    m.forward(ids, b)
    graphs.step([(5, a)])
    m.forward([5], b)
    assert (graphs.captures, graphs.recaptures) == (1, 0)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().flip(0).clone(), requires_grad=False)
    got = graphs.step([(6, a)])
    want = m.forward([6], b)
    assert graphs.recaptures == 1
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, m.config.num_hidden_layers)
    graphs.step([(7, a)])
    m.forward([7], b)
    assert graphs.recaptures == 1  # nothing moved: the graph stays
    # a weight's storage swapped under the same Parameter (no registration): still seen
    m.model.layers[1].mlp.experts.down_proj.data = m.model.layers[1].mlp.experts.down_proj.data * 0.5
    got = graphs.step([(8, a)])
    want = m.forward([8], b)
    assert graphs.recaptures == 2
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, m.config.num_hidden_layers)
    # a whole module replaced (its parameters are in another table now): still seen
    from kvfold.layers.basic import Linear
    head = Linear(m.config.hidden_size, vocab, torch.float32)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight * 2)
    m.lm_head = head
    got = graphs.step([(9, a)])
    want = m.forward([9], b)
    assert graphs.recaptures == 3
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, m.config.num_hidden_layers)


def test_graph_decode_refuses_what_it_cannot_run():
    """ConfigError, naming the fix, for private pools, for the batch-invariant mode and for a
    quantized expert stack (also when one is loaded after a capture); the buckets."""
    v4 = kvfold.load_model("tiny-random")
    with pytest.raises(ConfigError, match="kv_page_bytes"):
        Engine(v4, max_seq_len=256, kv_page_bytes=0, decode_graphs=True, batch_invariant=False)
    with pytest.raises(ConfigError, match="batch invariance"):
        Engine(v4, max_seq_len=256, decode_graphs=True, batch_invariant=True)
    engine = Engine(v4, max_seq_len=256, decode_graphs=True)  # None: graph decode without the invariant mode
    assert engine.graphs is not None and not engine.graphs.batch_invariant
    assert v4.batch_invariant  # the engine's mode is its own: the model's stays as it was
    assert buckets_for(16) == [1, 2, 4, 8, 16] and buckets_for(12) == [1, 2, 4, 8, 12]
    assert [engine.graphs.context_bucket(n) for n in (1, 256, 257, 600)] == [256, 256, 256, 256]  # capacity 256
    # an expert stack kept quantized (weights="quantized"): the step gathers plain stacks only;
    # one loaded after a capture is refused at the next step, before anything is written
    from kvfold.layers.basic import hold_quantized
    st = v4.new_state(capacity=256, pages=engine.pages, arena=engine.arena)
    engine.graphs.step([(3, st)])
    assert hold_quantized(v4, "model.layers.1.mlp.experts.down_proj", "fp4", (1, 32), ["float8_e8m0fnu"])
    before = [t.clone() for t in engine.arena.tensors()]
    with pytest.raises(ConfigError, match="weights='dequant'"):
        engine.graphs.step([(4, st)])
    assert st.pos == 1 and all(torch.equal(a, b) for a, b in zip(before, engine.arena.tensors()))
    quantized = kvfold.load_model("tiny-random")
    assert hold_quantized(quantized, "model.layers.1.mlp.experts.down_proj", "fp4", (1, 32), ["float8_e8m0fnu"])
    with pytest.raises(ConfigError, match="weights='dequant'"):
        Engine(quantized, max_seq_len=256, decode_graphs=True)
    assert quantized.batch_invariant  # refused: the model's mode as it was
    plain = kvfold.load_model("tiny-random")
    plain.set_batch_invariant(False)
    wide = DecodeGraphs(plain, plain.new_decode_arena(1, 3000, plain.new_page_pool(30)), 1)
    assert [wide.context_bucket(n) for n in (1, 256, 257, 1025, 2999)] == [256, 256, 512, 2048, 3000]


def test_graph_decode_verifies_drafts_and_continues_where_the_rejected_ones_were_rewound():
    """With n-gram drafts, verify steps (a sequence's last token and its drafts, several rows)
    run as graph steps too; the engine rewinds the rejected tokens and the next steps continue
    there. Greedy tokens are the forward engine's."""
    model = kvfold.load_model("tiny")
    text = long_ids(model, 400, "repeat")  # repeated lines: the n-gram drafter finds matches
    prompts = [text[:n] for n in (90, 150, 60)]
    (want, _, _), (got, m, _) = forward_and_graph_runs(
        model, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), max_seq_len=320,
        max_running=3, speculative="ngram", num_draft=3)
    assert got == want
    assert 0 < m["graph_steps"] < m["steps"] and m["graph_recaptures"] == 0  # prefills ran the forward
    assert m["graph_draft_rows"] > 0
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]  # drafts were rejected: states rewound


def test_a_failed_capture_leaves_its_bucket_eager_and_says_why(model):
    """A capture that raises (here: capturing on a machine without CUDA) is recorded once per
    bucket, and the step runs eagerly with the same logits as a step that never tried."""
    pool = model.new_page_pool(16)
    arenas = [model.new_decode_arena(2, CAP, pool) for _ in range(2)]
    ids = random_ids(40, model.config.vocab_size, seed=6)
    states = []
    for arena in arenas:
        st = model.new_state(capacity=CAP, pages=pool, arena=arena)
        model.forward(ids, st)
        states.append(st)
    trying, eager = DecodeGraphs(model, arenas[0], 2), DecodeGraphs(model, arenas[1], 2)
    trying.capture = True
    for tok in (3, 4, 5):
        assert torch.equal(trying.step([(tok, states[0])]), eager.step([(tok, states[1])]))
    assert len(trying.capture_errors) == 1 and trying.capture_errors[0].startswith("bucket 1 x 256:")
    assert trying.stats()["graph_capture_errors"] == 1 and trying.replays == 0


def test_a_graph_step_writes_only_its_rows_slots_and_pages_and_the_scratch(model):
    """Steps of two and of three of four slots (the second padded to a bucket of four): the slot
    outside them keeps every ring byte, and no page changes but the scratch page and the pages
    the stepped rows' positions fall in."""
    pool = model.new_page_pool(24)
    arena = model.new_decode_arena(4, CAP, pool, max_rewind=REWIND)
    vocab = model.config.vocab_size
    states = [model.new_state(capacity=CAP, max_rewind=REWIND, pages=pool, arena=arena) for _ in range(4)]
    for i, st in enumerate(states):
        model.forward(random_ids(127 + i, vocab, seed=i), st)  # the steps cross page 1 and close windows
    graphs = DecodeGraphs(model, arena, 4)
    pool_rows = {k: v.data.clone() for k, v in pool.storages.items()}
    rings = {k: v.clone() for k, v in arena.rings.items()}
    first = {id(st): st.pos for st in states}
    for tok in (3, 4):
        graphs.step([(tok, st) for st in (states[0], states[2])])
    graphs.step([(5, states[0]), (6, states[2]), (7, states[1])])
    assert graphs.bucket(2) == 2 and graphs.bucket(3) == 4
    for key, before in rings.items():
        assert torch.equal(arena.rings[key][states[3].slot], before[states[3].slot]), key
    touched = {arena.scratch_page} | {st.page_table[p // pool.page_tokens] for st in states[:3]
                                       for p in range(first[id(st)], st.pos)}
    for spec in pool.specs:
        per, key = pool.rows_per_page(spec.ratio), (spec.layer, spec.kind)
        after, before = pool.storages[key].data, pool_rows[key]
        for page in set(range(pool.num_pages)) - touched:
            assert torch.equal(after[page * per:(page + 1) * per], before[page * per:(page + 1) * per]), (key, page)


def test_graph_decode_serves_the_choices_of_one_prompt_from_forked_states():
    """n = 3 sampled choices: the followers' states are forked into arena slots from the leader's
    (its whole pages by reference); each choice's tokens are the forward engine's, and every slot
    is free again at the end."""
    model = kvfold.load_model("tiny")
    prompt = long_ids(model, 1000, "fork")[:200]
    runs = {}
    for graphs in (False, True):
        engine = Engine(model, max_seq_len=320, max_running=4, decode_graphs=graphs, batch_invariant=False)
        ids = engine.add_choices(prompt, [SamplingParams(max_tokens=20, temperature=0.8, seed=s) for s in range(3)])
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs[graphs] = ([out[i] for i in ids], engine)
    (want, _), (got, engine) = runs[False], runs[True]
    assert got == want and len({tuple(t) for t in got}) == 3
    assert engine.metrics()["graph_steps"] >= 19 and engine.arena.free_slots == 4


def test_a_graph_step_of_several_rows_a_sequence_is_the_forwards_verify_chunk(model):
    """Rows of four consecutive positions for each sequence (max_rewind 3), across window closes
    of both ratios and the ring's wrap: logits within the two-paths bound of the forward's chunk,
    rewinds afterwards as after the forward; more rows than the rings' slack are refused."""
    pool = model.new_page_pool(40)
    arena = model.new_decode_arena(3, CAP, pool, max_rewind=3)
    vocab = model.config.vocab_size
    pairs = []
    for n in (2, 29, 125):
        ids = random_ids(n, vocab, seed=n)
        a = model.new_state(capacity=CAP, max_rewind=3, pages=pool, arena=arena)
        b = model.new_state(capacity=CAP, max_rewind=3, pages=pool)
        model.forward(ids, a)
        model.forward(ids, b)
        pairs.append((a, b))
    graphs = DecodeGraphs(model, arena, 12)
    g = torch.Generator().manual_seed(8)
    for step in range(6):
        toks = torch.randint(0, vocab, (len(pairs), 4), generator=g)
        got = graphs.step([(t.tolist(), a) for t, (a, _) in zip(toks, pairs)])
        want = torch.cat(model.forward_batch([(t, b) for t, (_, b) in zip(toks, pairs)], last_only=False))
        assert got.shape == (12, vocab)
        assert (got - want).abs().max().item() <= fp32_paths_bound(want, model.config.num_hidden_layers)
        for a, b in pairs:  # keep one or two of the four, as a verify does
            back = a.pos - 3 + step % 2
            a.rewind_to(back)
            b.rewind_to(back)
    a = pairs[0][0]
    before = (a.pos, [t.clone() for t in arena.tensors()])
    with pytest.raises(CapacityError, match="max_rewind"):
        graphs.step([([1, 2, 3, 4, 5], a)])
    assert a.pos == before[0] and all(torch.equal(x, y) for x, y in zip(before[1], arena.tensors()))


def test_graph_decode_feeds_the_mtp_drafter_the_streams_the_forward_would():
    """With MTP drafts the drafter reads each verified row's final streams: graph steps hand it
    theirs (within the two-paths bound of the forward's), and greedy tokens are the forward
    engine's, through accepted and rejected drafts."""
    model = kvfold.load_model("tiny")  # ships its MTP layer
    prompts = [long_ids(model, n, f"mtp {n}") for n in (40, 90)]
    (want, _, _), (got, m, _) = forward_and_graph_runs(
        model, prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), max_seq_len=256,
        max_running=2, speculative="mtp", num_draft=2)
    assert got == want
    assert m["graph_steps"] > 0 and m["graph_draft_rows"] > 0 and 0 < m["spec_accepted_tokens"]
    # the streams themselves, against the forward's, both outside batch-invariant mode (graph decode's)
    model.set_batch_invariant(False)
    pool = model.new_page_pool(8)
    arena = model.new_decode_arena(1, 256, pool, max_rewind=2)
    a = model.new_state(capacity=256, max_rewind=2, pages=pool, arena=arena)
    b = model.new_state(capacity=256, max_rewind=2, pages=pool)
    for st in (a, b):
        model.forward(prompts[0], st)
    logits, streams = DecodeGraphs(model, arena, 3).step([([5, 6, 7], a)], hidden=True)
    want_logits, want_streams = model.forward([5, 6, 7], b, return_hidden=True)
    assert streams.shape == want_streams.shape
    assert (streams - want_streams).abs().max().item() <= fp32_paths_bound(want_streams, model.config.num_hidden_layers)
    assert (logits - want_logits).abs().max().item() <= fp32_paths_bound(want_logits, model.config.num_hidden_layers)

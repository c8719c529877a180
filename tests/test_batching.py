"""One model call advances many sequences, and each gets exactly the bits it would get alone.

Batch-invariant mode rests on native.c's fixed-order arithmetic, not on a measured property of
MKL or ATen; `make test` runs this file a second time with MKL and ATen held to AVX2, so one
machine checks both instruction sets' kernels around it.
"""
import contextlib
from fractions import Fraction

import numpy as np
import pytest
import torch

from bounds import matmul_bound
from helpers import flat_rows, fp32_paths_bound, ops_for, random_ids
from kvfold.errors import CapacityError, ConfigError
from kvfold.numerics import native
from kvfold.numerics.rows import invariant_mm as _invariant_mm, row_mm, swiglu


pytestmark = pytest.mark.batch_invariance


def prefill(model, ids, capacity=700, kv_dtype=None):
    st = model.new_state(capacity=capacity, kv_dtype=kv_dtype)
    if len(ids):
        model.forward(ids, st, last_only=True)
    return st


@contextlib.contextmanager
def threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def batch_invariance(model, on):
    before = model.batch_invariant
    model.set_batch_invariant(on)
    try:
        yield model
    finally:
        model.set_batch_invariant(before)


@pytest.fixture
def invariant(tiny):
    with batch_invariance(tiny, True):
        yield tiny


INVARIANT = ops_for(invariant=True)  # an fp32 CPU model's kernels in batch-invariant mode


def invariant_mm(x, w):
    return _invariant_mm(native.library(), x, w)


def fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (to nearest, ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    guess = np.float32(float(exact))
    cands = [guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))


def fixed_order_dot(a: np.ndarray, b: np.ndarray, lanes: int = 8) -> np.float32:
    """native.c's `dot` by hand: lane j accumulates a[i] b[i] for i = j (mod lanes) in ascending i
    with fused multiply-adds, the tail likewise, then the lanes summed by halving, the tail last."""
    n = a.shape[0] - a.shape[0] % lanes
    acc = [np.float32(0)] * lanes
    for i in range(0, n, lanes):
        acc = [fma32(a[i + j], b[i + j], acc[j]) for j in range(lanes)]
    tail = np.float32(0)
    for i in range(n, a.shape[0]):
        tail = fma32(a[i], b[i], tail)
    half = lanes // 2
    while half:
        acc = [np.float32(acc[j] + acc[j + half]) for j in range(half)]
        half //= 2
    return np.float32(acc[0] + tail)


@pytest.mark.parametrize("k", [5, 64, 77, 256])
def test_invariant_matmul_is_the_fixed_order_dot_computed_by_hand(k):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(6, k, generator=g), torch.randn(5, k, generator=g)
    got = invariant_mm(x, w)
    xs, ws = x.numpy(), w.numpy()
    want = np.array([[fixed_order_dot(xs[i], ws[j]) for j in range(5)] for i in range(6)], dtype=np.float32)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("k,n", [(64, 96), (128, 256), (256, 1024), (1024, 256), (37, 5)])
def test_invariant_matmul_gives_a_row_the_same_bits_in_any_batch_and_thread_count(k, n):
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
    alone = torch.cat([invariant_mm(x[i:i + 1], w) for i in range(300)])
    for t in (1, 2):
        with threads(t):
            for rows in (1, 2, 3, 4, 5, 11, 16, 33, 100, 300):
                for offset in (0, 3) if rows < 300 else (0,):
                    part = x[offset:offset + rows]
                    assert torch.equal(invariant_mm(part, w), alone[offset:offset + part.shape[0]])
    # and rows read through a stride (a column slice of a wider tensor) are the same rows
    wide = torch.cat([x, torch.randn(300, 3, generator=g)], dim=1)
    assert torch.equal(invariant_mm(wide[:, :k], w), alone)
    # two fp32 K-term dots (fixed order, torch's GEMM order) of the same operands: each within
    # gamma_K |x| @ |w|^T of exact, elementwise; a wrong row or column is off by O(|x| @ |w|^T)
    assert ((alone - x @ w.t()).abs() <= 2 * matmul_bound(x, w)).all()


def test_row_mm_takes_the_invariant_kernel_only_inside_invariant_rows():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 77, generator=g), torch.randn(12, 77, generator=g)
    assert torch.equal(row_mm(ops_for(), x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(row_mm(INVARIANT, x, w), invariant_mm(x, w))


def test_invariant_swiglu_is_per_row_and_matches_the_formula():
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(40, 2, 33, generator=g) * 6
    want = torch.nn.functional.silu(gu[:, 0].clamp(max=5.0)) * gu[:, 1].clamp(-5.0, 5.0)
    got = swiglu(INVARIANT, gu[:, 0], gu[:, 1], 5.0)
    assert torch.equal(torch.cat([swiglu(INVARIANT, gu[i:i + 1, 0], gu[i:i + 1, 1], 5.0) for i in range(40)]), got)
    assert (got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_row_takes_the_same_moe_bits_alone_in_a_few_rows_and_in_a_batch(invariant, n_threads):
    """The native MoE (kv_moe_rows) on one row, on a few rows (rows shared out over the threads)
    and the grouped invariant path on a batch past NATIVE_MOE_ROWS (route, matmuls, swiglu,
    ascending combination) give every row the same bits, for hash and top-k layers."""
    from kvfold.models.deepseek_v4.moe import NATIVE_MOE_ROWS
    g = torch.Generator().manual_seed(5)
    hidden = invariant.config.hidden_size
    n = NATIVE_MOE_ROWS + 3
    x = torch.randn(n, hidden, generator=g)
    tokens = torch.randint(0, invariant.config.vocab_size, (n,), generator=g)
    ops = invariant.backend()
    with threads(n_threads):
        for layer in invariant.model.layers[:2]:  # layer 0: hash routing, layer 1: biased top-k
            moe = layer.mlp
            batched = moe(x, tokens, ops)  # more rows than the native call takes: the grouped path
            few = moe._native_rows(x[:7], tokens[:7], ops)
            assert few is not None and torch.equal(few, batched[:7])
            for i in range(n):
                one = moe._native_rows(x[i:i + 1], tokens[i:i + 1], ops)
                assert one is not None and torch.equal(one, batched[i:i + 1])


def attention_halves(model, n_rows: int, seed: int = 0):
    """For every layer: the fused native halves (project_rows, output_rows) and the per-op path
    (Attention.project; de-rotation, wo_a, wo_b) on the same n_rows rows, as flat tensors, with
    the model's kernels in batch-invariant mode."""
    ops = model.backend(True)
    from kvfold.models.deepseek_v4.config import SLIDING
    from kvfold.models.deepseek_v4.native_attention import output_rows, project_rows
    from kvfold.numerics import apply_rope
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, model.config.hidden_size, generator=g)
    positions = torch.randint(0, 5000, (n_rows,), generator=g)
    pairs = []
    for layer in model.model.layers:
        attn = layer.self_attn
        table = model.rope_main if attn.kind == SLIDING else model.rope_compress
        cos, sin = table.cos_sin(ops, positions)
        first = int(positions[0]) if n_rows == 1 else None  # a lone row gives its position as an int
        o = torch.randn(n_rows, attn.n_heads, attn.head_dim, generator=g)
        fused = project_rows(ops, attn, x, positions, cos, sin)
        per_op = attn.project(x, positions, first, cos, sin, ops)
        assert fused is not None and set(fused) == set(per_op)
        rotated = apply_rope(ops, o, cos, sin, inverse=True)
        y = attn.o_b_proj(attn.o_a_proj(rotated.reshape(n_rows, attn.o_groups, -1), ops), ops)
        pairs.append((torch.cat([flat_rows(fused), output_rows(ops, attn, o, cos, sin).flatten()]),
                      torch.cat([flat_rows(per_op), y.flatten()])))
    return pairs


@pytest.mark.parametrize("n_threads", [1, 2])
def test_fused_attention_halves_give_the_per_op_bits_in_batch_invariant_mode(invariant, n_threads):
    """native_attention.h composes the per-op path's native kernels in its order: the same bits,
    for every layer kind, one decode row, a few verify rows and a prefill chunk past NATIVE_ROWS."""
    with threads(n_threads), torch.inference_mode():
        for n_rows in (1, 5, 40):
            for fused, per_op in attention_halves(invariant, n_rows):
                assert torch.equal(fused, per_op)


def test_fused_attention_halves_follow_a_replaced_weight_or_submodule():
    """The fused halves' cached descriptors point into the weights: a parameter or a submodule
    replaced after a call is read, not the old one (NativeCache)."""
    import kvfold
    from torch import nn
    from kvfold.layers.basic import Linear
    model = kvfold.load_model("tiny-random")
    attn = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        before = attention_halves(model, 3)[1][0]
        attn.q_a_proj.weight = nn.Parameter(torch.randn(attn.q_a_proj.weight.shape, generator=g))
        kv = Linear(attn.kv_proj.weight.shape[1], attn.kv_proj.weight.shape[0], torch.float32)
        kv.weight.copy_(torch.randn(kv.weight.shape, generator=g))
        attn.kv_proj = kv
        fused, per_op = attention_halves(model, 3)[1]
    assert torch.equal(fused, per_op) and not torch.equal(fused, before)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("on", [False, True])
def test_a_decode_row_in_one_native_call_gives_the_per_op_bits_and_state(tiny, monkeypatch, paged, on):
    """native_attention.h's one-call decode row (folds with emission, top-k, attention, window
    write) against the per-op `_one_sequence`: the same logits at every step and the same state
    bytes, through window and compressor ring wrap-around, emitted entries in private and paged
    pools, and a rewind."""
    from kvfold.models.deepseek_v4 import attention, model
    monkeypatch.setattr(model, "model_row", lambda *a: None)
    monkeypatch.setattr(model, "block_row", lambda *a: None)  # the block op by op, its attention row fused
    _fused_against_per_op(tiny, monkeypatch, attention, "sequence_row", paged, on)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("on", [False, True])
def test_a_decode_block_in_one_native_call_gives_the_per_op_bits_and_state(tiny, monkeypatch, paged, on):
    """native_block.h's one-call block (mHC collapses and expands, norms, the attention's three
    fused calls, the MoE row) against Block.forward op by op: the same logits at every step and
    the same state bytes, through ring wrap-around, emitted entries and a rewind."""
    from kvfold.models.deepseek_v4 import model
    monkeypatch.setattr(model, "model_row", lambda *a: None)  # the model's glue op by op, each block fused
    _fused_against_per_op(tiny, monkeypatch, model, "block_row", paged, on)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("on", [False, True])
def test_a_decode_row_of_the_whole_model_in_one_native_call_gives_the_per_op_bits_and_state(tiny, monkeypatch,
                                                                                            paged, on):
    """native_block.h's one-call model row (the embedding, every block, the mHC head, the norm and
    the lm_head) against the per-op path: the same logits at every step and the same state
    bytes. Outside batch invariance an fp32 lm_head runs torch's GEMM, so the row is not fused."""
    from kvfold.models.deepseek_v4 import model
    _fused_against_per_op(tiny, monkeypatch, model, "model_row", paged, on, per_step=1 if on else 0)


def test_the_fused_model_row_follows_replaced_weights_the_numerics_mode_and_the_thread_count(monkeypatch):
    """model_row's plan points into every weight of the model, built once: a parameter or a
    submodule replaced after decode steps is read (the fused row equals the per-op path on the
    new weights, and differs from the old), leaving batch invariance falls back to torch's GEMM
    head (not fused) and coming back fuses again, at any thread count."""
    import kvfold
    from torch import nn
    from kvfold.layers.basic import Linear
    from kvfold.models.deepseek_v4 import model as model_module
    from kvfold.models.deepseek_v4 import native_block
    model = kvfold.load_model("tiny-random")
    g = torch.Generator().manual_seed(11)
    taken = []
    monkeypatch.setattr(model_module, "model_row", lambda *a: taken.append(native_block.model_row(*a)) or taken[-1])
    st = model.new_state(capacity=64)
    prompt = random_ids(9, model.config.vocab_size, seed=12)

    def step(fused: bool) -> torch.Tensor:
        """One decode row from the state after the prompt (the state restored afterwards)."""
        blob = st.snapshot()
        if not fused:
            monkeypatch.setattr(model_module, "model_row", lambda *a: None)
        try:
            return model.forward([7], st)
        finally:
            st.restore(blob)
            monkeypatch.setattr(model_module, "model_row",
                                lambda *a: taken.append(native_block.model_row(*a)) or taken[-1])

    with batch_invariance(model, True):
        model.forward(prompt, st)
        before = step(True)
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[2].mlp
        attn.q_a_proj.weight = nn.Parameter(torch.randn(attn.q_a_proj.weight.shape, generator=g))
        kv = Linear(attn.kv_proj.weight.shape[1], attn.kv_proj.weight.shape[0], torch.float32)
        kv.weight.copy_(torch.randn(kv.weight.shape, generator=g))
        attn.kv_proj = kv
        mlp.experts.down_proj.data = torch.randn(mlp.experts.down_proj.shape, generator=g)
        taken.clear()
        after = step(True)
        assert taken and taken[-1] is not None  # fused, on the new weights
        assert torch.equal(after, step(False)) and not torch.equal(after, before)
    taken.clear()
    with batch_invariance(model, False):
        step(True)
    assert taken == [None]  # an fp32 lm_head outside invariance: torch's GEMM, op by op
    for n in (1, 2):
        taken.clear()
        with batch_invariance(model, True), threads(n):
            assert torch.equal(step(True), after)
        assert taken and taken[-1] is not None


def test_the_fused_model_row_runs_its_attention_halves_at_the_thread_count_it_was_planned_for(monkeypatch):
    """The attention halves' descriptors are shared with the per-op path, which sets their thread
    count on each of its calls; the fused row sets them back to its plan's count before its call."""
    import kvfold
    from kvfold.models.deepseek_v4 import native_block
    from kvfold.models.deepseek_v4.native_attention import fused_halves
    model = kvfold.load_model("tiny-random")
    st = model.new_state(capacity=32)
    attns = [block.self_attn for block in model.model.layers]
    seen, real = [], native_block.sequence_layer

    def spy(*a):  # model_row builds the state's descriptors after the reset, before its native call
        seen.append({half.threads for half in model.__dict__["_native_row_plan"].value.halves})
        return real(*a)

    with batch_invariance(model, True):
        with threads(2):
            model.forward(random_ids(5, model.config.vocab_size, seed=13), st)
            model.forward([3], st)  # the plan, built at two threads
        with threads(1):
            lib = model.backend().weight_mm.native
            assert {half.threads for a in attns for half in fused_halves(a, lib)} == {1}
        monkeypatch.setattr(native_block, "sequence_layer", spy)
        with threads(2):
            model.forward([4], st)
    assert seen and all(s == {2} for s in seen)


def _fused_against_per_op(tiny, monkeypatch, module, name: str, paged: bool, on: bool,
                          per_step: int | None = None) -> None:
    """A 37-token prefill, then 90 decode steps with a rewind of 5 at step 60, with `module.name`
    (a fused decode path) on and then returning None (the per-op path): every decode row must take
    it (`per_step` times; default once per layer), and the logits and the final state's snapshot
    must be the same bytes."""
    from test_pages import fragmented_pool
    fused = getattr(module, name)
    used = []
    v = tiny.config.vocab_size
    prompt, steps = random_ids(37, v, seed=3), random_ids(90, v, seed=4)

    def run(native_row: bool):
        monkeypatch.setattr(module, name, (lambda *a: used.append(fused(*a)) or used[-1])
                            if native_row else (lambda *a: None))
        pool = fragmented_pool(tiny, 8) if paged else None
        st = tiny.new_state(capacity=300, max_rewind=6, pages=pool)
        logits = [tiny.forward(prompt, st)]
        for i, tok in enumerate(steps):
            logits.append(tiny.forward([tok], st))
            if i == 60:
                st.rewind_to(st.pos - 5)
        return torch.cat(logits), st.snapshot()

    with batch_invariance(tiny, on):
        native_logits, native_blob = run(True)
        per_op_logits, per_op_blob = run(False)
    decode_calls = [o for o in used if o is not None]
    per_step = tiny.config.num_hidden_layers if per_step is None else per_step
    assert len(decode_calls) == 90 * per_step  # every decode row took it
    assert torch.equal(native_logits, per_op_logits) and native_blob == per_op_blob


def _decode_batch(tiny, prompts, steps, pool=None, rewound=1):
    """Each prompt prefilled alone, then one forward_batch of every sequence's decode row a step
    (sequence `rewound`, if there, rewinds 4 tokens after step 20). Returns each sequence's logits
    and snapshot."""
    states = [tiny.new_state(capacity=300, max_rewind=6, pages=pool) for _ in prompts]
    logits = [[tiny.forward(p, st, last_only=True)] for p, st in zip(prompts, states)]
    for i, toks in enumerate(steps):
        out = tiny.forward_batch([([t], st) for t, st in zip(toks, states)])
        for acc, row in zip(logits, out):
            acc.append(row)
        if i == 20 and rewound < len(states):
            states[rewound].rewind_to(states[rewound].pos - 4)
    blobs = [st.snapshot() for st in states]
    for st in states:
        st.free()
    return [torch.cat(rows) for rows in logits], blobs


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("name", ["model_row", "block_row"])
def test_decode_rows_of_several_sequences_in_one_native_call_give_each_the_per_op_and_the_alone_bits(
        tiny, monkeypatch, name, on, paged, n_threads):
    """native_block.h's calls for the decode rows of five sequences at different positions (so
    their compressor windows close at different steps, in private or paged pools, one of them
    rewound): every step takes the one call (`model_row`: one per step; `block_row`, with the
    model's glue op by op: one per layer), and each sequence's logits and final state bytes equal
    the per-op path's for the same batch and its own run alone. Outside batch invariance the
    model row is not fused (an fp32 lm_head runs torch's GEMM) and the per-op batch is only close
    to the lone run, so those two comparisons need batch invariance."""
    from kvfold.models.deepseek_v4 import model
    from test_pages import fragmented_pool
    fused, used = getattr(model, name), []
    v = tiny.config.vocab_size
    prompts = [random_ids(n, v, seed=20 + n) for n in (37, 5, 130, 64, 3)]
    steps = [random_ids(len(prompts), v, seed=100 + i).tolist() for i in range(40)]
    if name == "block_row":
        monkeypatch.setattr(model, "model_row", lambda *a: None)  # the model's glue op by op, each block fused

    def run(native_rows: bool, only: int | None = None):
        monkeypatch.setattr(model, name, (lambda *a: used.append(fused(*a)) or used[-1])
                            if native_rows else (lambda *a: None))
        pool = fragmented_pool(tiny, 16) if paged else None
        if only is None:
            return _decode_batch(tiny, prompts, steps, pool)
        return _decode_batch(tiny, [prompts[only]], [row[only:only + 1] for row in steps], pool,
                             rewound=0 if only == 1 else 1)

    def rows(out) -> int:  # model_row returns (logits, streams), block_row the streams
        return -1 if out is None else (out[0] if isinstance(out, tuple) else out).shape[0]

    with batch_invariance(tiny, on), threads(n_threads):
        batched = run(True)
        fused_calls = [rows(o) for o in used]
        per_op = run(False)
        alone = [run(True, i) for i in range(len(prompts))]
    per_step = 1 if name == "model_row" else tiny.config.num_hidden_layers
    assert fused_calls.count(len(prompts)) == (40 * per_step if on or name == "block_row" else 0)
    assert all(torch.equal(a, b) for a, b in zip(batched[0], per_op[0])) and batched[1] == per_op[1]
    if on:
        for i, (logits, blobs) in enumerate(alone):
            assert torch.equal(batched[0][i], logits[0]) and batched[1][i] == blobs[0]


def test_more_decode_rows_than_the_native_moe_takes_run_op_by_op(invariant, monkeypatch):
    """Past NATIVE_MOE_ROWS decode rows the per-op path groups the experts in torch, so the fused
    rows step aside rather than compute something else."""
    from kvfold.models.deepseek_v4 import model
    from kvfold.models.deepseek_v4.moe import NATIVE_MOE_ROWS
    fused, seen = model.model_row, []
    monkeypatch.setattr(model, "model_row", lambda *a: seen.append(fused(*a)) or seen[-1])
    taken = []
    for n in (NATIVE_MOE_ROWS, NATIVE_MOE_ROWS + 1):
        states = [prefill(invariant, random_ids(3 + i, invariant.config.vocab_size, seed=i)) for i in range(n)]
        seen.clear()
        invariant.forward_batch([([1], st) for st in states])
        taken.append(seen[0])
    assert taken[0] is not None and taken[0][0].shape[0] == NATIVE_MOE_ROWS and taken[1] is None


def feeds_and_states(model, lengths, feeds, seed):
    v = model.config.vocab_size
    prompts = [random_ids(n, v, seed=seed + n) for n in lengths]
    chunks = [random_ids(n, v, seed=seed + 1000 + n) for n in feeds]
    return prompts, chunks


@pytest.mark.parametrize("n_threads", [1, 2])
def test_mixed_batch_of_prefills_and_decodes_is_bit_identical_to_each_alone(invariant, n_threads):
    tiny = invariant
    v = tiny.config.vocab_size
    # sequences at different positions (fresh, mid-window, past fold and window edges), fed prefill
    # chunks of 1-300 tokens beside decode rows
    lengths = (0, 5, 37, 130, 200, 301, 64, 3)
    feeds = (3, 1, 1, 17, 1, 260, 300, 1)
    prompts, chunks = feeds_and_states(tiny, lengths, feeds, seed=7)
    with threads(n_threads):
        alone_states = [prefill(tiny, p) for p in prompts]
        alone = [tiny.forward(f, st, last_only=False) for f, st in zip(chunks, alone_states)]
        # several compositions and orders of the same sequences
        for members in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 5, 3, 1], [6, 2], [4, 0, 5]):
            states = [prefill(tiny, prompts[i]) for i in members]
            got = tiny.forward_batch([(chunks[i], st) for i, st in zip(members, states)], last_only=False)
            for i, lg, st in zip(members, got, states):
                assert torch.equal(lg, alone[i]), f"sequence {i} in batch {members}"
                assert st.snapshot() == alone_states[i].snapshot()
        # decoding on, in batches of changing composition, stays identical to decoding alone
        batch_states = [prefill(tiny, p) for p in prompts]
        for st, f in zip(batch_states, chunks):
            tiny.forward(f, st)
        for step in range(4):
            tok = [[(step * 7 + i) % v] for i in range(len(prompts))]
            members = [i for i in range(len(prompts)) if (i + step) % 3]
            got = tiny.forward_batch([(tok[i], batch_states[i]) for i in members])
            for i, lg in zip(members, got):
                assert torch.equal(lg, tiny.forward(tok[i], alone_states[i], last_only=True))
    assert all(sa.snapshot() == sb.snapshot() for sa, sb in zip(alone_states, batch_states))


def test_fp8_and_plain_states_share_a_batch(invariant):
    tiny = invariant
    v = tiny.config.vocab_size
    p = random_ids(40, v, seed=5)
    a8, b8 = prefill(tiny, p, kv_dtype="fp8"), prefill(tiny, p, kv_dtype="fp8")
    a, b = prefill(tiny, p), prefill(tiny, p)
    got = tiny.forward_batch([([3], b8), ([3], b)])
    assert torch.equal(got[0], tiny.forward([3], a8, last_only=True))
    assert torch.equal(got[1], tiny.forward([3], a, last_only=True))
    assert not torch.equal(got[0], got[1])  # the FP8 state really reads its own rows


def test_a_batch_is_one_pass_over_the_weights(tiny, monkeypatch):
    """Every layer's projections run once per call, whatever the number of sequences: per op (the
    q_a projection's hook), fused in one native call (attention.project_rows) or inside the
    block's one native call (model.block_row; the whole-model row, which would skip the lm_head's
    hook too, is kept off)."""
    from kvfold.models.deepseek_v4 import attention, model
    calls = []
    fused, fused_block = attention.project_rows, model.block_row

    def counted(ops, attn, x, *args):
        rows = fused(ops, attn, x, *args)
        if rows is not None:
            calls.append(x.shape[0])
        return rows

    def counted_block(block, streams, batch):
        out = fused_block(block, streams, batch)
        if out is not None:
            calls.append(streams.shape[0])
        return out

    monkeypatch.setattr(attention, "project_rows", counted)
    monkeypatch.setattr(model, "block_row", counted_block)
    monkeypatch.setattr(model, "model_row", lambda *args: None)
    hooks = [layer.self_attn.q_a_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
             for layer in tiny.model.layers]
    hooks.append(tiny.lm_head.register_forward_hook(lambda m, i, o: calls.append(-i[0].shape[0])))
    try:
        for on in (False, True):
            with batch_invariance(tiny, on):
                states = [prefill(tiny, random_ids(9 + i, tiny.config.vocab_size, seed=i)) for i in range(6)]
                calls.clear()
                tiny.forward_batch([([1], st) for st in states])
            n_layers = tiny.config.num_hidden_layers
            assert calls == [6] * n_layers + [-6]  # 6 decode rows: one call per layer, one lm_head call
    finally:
        for h in hooks:
            h.remove()


def test_invariant_and_default_mode_agree_within_fp32_rounding(tiny):
    v = tiny.config.vocab_size
    prompts = [random_ids(n, v, seed=n) for n in (3, 50, 129)]
    with batch_invariance(tiny, True):
        want = [tiny.forward([5], prefill(tiny, p), last_only=True) for p in prompts]
    with batch_invariance(tiny, False):
        got = tiny.forward_batch([([5], prefill(tiny, p)) for p in prompts])
    for a, b in zip(want, got):
        # two fp32 summation orders of the same logits (helpers.fp32_paths_bound); another
        # sequence's row or a lost context row moves them by orders of magnitude more
        assert (a - b).abs().max() <= fp32_paths_bound(b, tiny.config.num_hidden_layers)


def test_batch_invariance_is_the_default_where_it_holds_and_refused_elsewhere(tiny):
    import kvfold
    assert kvfold.load_model("tiny-random").batch_invariant  # fp32 on the CPU with the native kernels
    bf16 = kvfold.load_model("tiny-random", dtype=torch.bfloat16)
    assert not bf16.supports_batch_invariance
    with pytest.raises(ConfigError, match="fp32"):
        bf16.set_batch_invariant(True)
    assert not bf16.batch_invariant
    bf16.set_batch_invariant(False)  # turning it off is always fine


def test_a_refused_batch_changes_no_state(tiny):
    v = tiny.config.vocab_size
    ok = prefill(tiny, random_ids(10, v, seed=1))
    full = tiny.new_state(capacity=4)
    tiny.forward(random_ids(4, v, seed=2), full)
    before = ok.snapshot(), full.snapshot()
    with pytest.raises(CapacityError):
        tiny.forward_batch([([1], ok), ([2], full)])
    assert (ok.snapshot(), full.snapshot()) == before and ok.pos == 10


def test_with_fused_decode_off_a_forward_hook_sees_every_decode_row(tiny):
    """The one-call block and model skip their modules' __call__, so their hooks miss fused decode
    rows; `set_fused_decode(False)` runs every module's forward: a hook on a block's sub-module
    (or a global one) sees every row, and the logits are unchanged."""
    from torch.nn.modules.module import register_module_forward_hook
    v = tiny.config.vocab_size
    prompt, steps = random_ids(20, v, seed=5), random_ids(6, v, seed=6)

    def run():
        st = tiny.new_state(capacity=64)
        return torch.cat([tiny.forward(prompt, st)] + [tiny.forward([t], st) for t in steps])

    plain = run()
    seen, calls = [], []
    tiny.set_fused_decode(False)
    handles = [tiny.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0])),
               register_module_forward_hook(lambda mod, args, out: calls.append(type(mod).__name__))]
    try:
        hooked = run()
    finally:
        tiny.set_fused_decode(True)
        for h in handles:
            h.remove()
    assert seen == [20] + [1] * len(steps) and torch.equal(hooked, plain)
    assert calls.count("MoE") == tiny.config.num_hidden_layers * (1 + len(steps))

"""Batch invariance as CUDA runs it: the Triton fixed-order row kernels (kvfold/numerics/triton_rows.py),
here in Triton's interpreter on the CPU with native.c off (`KernelSet(native=False,
triton_rows_on_cpu=True)`), so that every token-parallel op takes them and every per-sequence op
takes torch's kernels, as on a GPU.

Each kernel is checked against float64 within the rounding of the sums it computes, and for
giving a row the same bits in any batch; then both model families, fp32 and bf16, batched
against alone with torch.equal, as tests/test_batching.py does for native.c; an engine's
request alone and under load; and DeepSeek-V4's graph decode with the Triton kernels on, a
sequence's bits in any bucket, and an engine's request under load with prompts arriving
while it decodes.
"""
import inspect

import pytest
import torch
from helpers import fp32_paths_bound, ops_for
from test_gpu_check import _script

from kvfold.errors import ConfigError
from kvfold.models.deepseek_v4.config import CSA, HCA, SLIDING
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from kvfold.models.glm5.config import glm5_config_from_dict
from kvfold.models.glm5.model import Glm5Model
from kvfold.numerics import hc as hc_math
from kvfold.numerics import native
from kvfold.numerics import triton_rows as R
from kvfold.numerics.backend import KernelSet, invariance_by_default, invariance_unsupported
from kvfold.numerics.rows import route_rows

EPS = torch.finfo(torch.float32).eps

# batch-invariant mode as on CUDA: Triton's row kernels, native.c off (a model's `set_kernels`)
CUDA_PATH = KernelSet(native=False, triton_rows_on_cpu=True)
# and with the Triton sequence kernels on too (graph decode's batch-invariant step)
CUDA_PATH_TRITON = KernelSet(native=False, triton=True, triton_rows_on_cpu=True)
# the ops themselves, as such a model runs them in batch-invariant mode
CUDA_OPS = ops_for(invariant=True, native=False, rows_on_cpu=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_rows_alone(f, x, *rest):
    """f over a batch gives each row the bits it gets alone, and in other slices of the batch."""
    whole = f(x, *rest)
    for i in range(x.shape[0]):
        assert torch.equal(f(x[i:i + 1].clone(), *[r[i:i + 1].clone() for r in rest]), whole[i:i + 1]), f"row {i}"
    for lo, hi in ((1, x.shape[0]), (3, min(x.shape[0], 12))):
        assert torch.equal(f(x[lo:hi].clone(), *[r[lo:hi].clone() for r in rest]), whole[lo:hi])


@pytest.mark.parametrize("m,n,k", [(1, 3, 5), (9, 40, 77), (20, 33, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fixed_matmul_is_the_dot_within_its_rounding_and_a_row_has_one_result_in_any_batch(m, n, k, dtype):
    x = torch.randn(m, k, generator=gen(1)).to(dtype)
    w = torch.randn(n, k, generator=gen(2)).to(dtype)
    got = R.mm(x, w)
    exact = x.double() @ w.double().t()
    # a K-term fp32 sum of exact products (bf16 products are exact in fp32): k * eps * sum |x w|
    bound = k * EPS * (x.double().abs() @ w.double().abs().t())
    assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound).all()
    assert_rows_alone(lambda a: R.mm(a, w), x)
    # a row read in place from a wider buffer (its row stride) gets the same bits
    wide = torch.zeros(m, k + 7, dtype=dtype)
    wide[:, :k] = x
    assert torch.equal(R.mm(wide[:, :k], w), got)


@pytest.mark.parametrize("d", [7, 64, 1500])
@pytest.mark.parametrize("kind", ["rms", "rms_weighted", "l2"])
def test_the_norm_kernel_is_the_formula_and_per_row(d, kind):
    x = 3 * torch.randn(6, d, generator=gen(d))
    w = 1 + 0.1 * torch.randn(d, generator=gen(5)) if kind == "rms_weighted" else None
    got = R.norm(x, w, 1e-6, l2=kind == "l2")
    x64 = x.double()
    ss = (x64 * x64).sum(-1, keepdim=True)
    want = x64 / torch.sqrt(ss + 1e-6) if kind == "l2" else x64 / torch.sqrt(ss / d + 1e-6)
    if w is not None:
        want = want * w.double()
    # the sum of d squares to d * eps relative, the square root halves it, then three roundings
    assert ((got.double() - want).abs() <= (d * EPS + 4 * EPS) * want.abs() + 1e-30).all()
    assert_rows_alone(lambda a: R.norm(a, w, 1e-6, l2=kind == "l2"), x)


def test_the_elementwise_kernels_are_their_formulas_and_per_row():
    x = 6 * torch.randn(5, 300, generator=gen(3))
    up = 6 * torch.randn(5, 300, generator=gen(4))
    x64, u64 = x.double(), up.double()
    sig = torch.sigmoid(x64)
    softplus = torch.where(x64 > 20, x64, torch.log1p(torch.exp(x64)))
    g = x64.clamp(max=5.0)
    want = {"sigmoid": sig, "silu": x64 * sig, "softplus": softplus}

    def tol(v, y):  # exp(v) to (|v| + 4) eps relative (v rounded to fp32 first), then a few rounded ops
        return (v.abs() + 8) * EPS * y.abs() + 1e-30
    for name, y in want.items():
        assert ((R.unary(name, x).double() - y).abs() <= tol(x64, y)).all(), name
        assert_rows_alone(lambda a, n=name: R.unary(n, a), x)
    swi = g * torch.sigmoid(g) * u64.clamp(-5.0, 5.0)
    assert ((R.swiglu(x, up, 5.0).double() - swi).abs() <= tol(g, swi)).all()
    assert_rows_alone(lambda a, b: R.swiglu(a, b, 5.0), x, up)
    angles = torch.cat([x, 3e4 * torch.rand(5, 300, generator=gen(5))])  # rope's reach long contexts
    for name, f in (("cos", torch.cos), ("sin", torch.sin)):  # float64, then one rounding: eps / 2
        assert ((R.unary(name, angles).double() - f(angles.double())).abs() <= EPS / 2).all(), name
        assert_rows_alone(lambda a, n=name: R.unary(n, a), angles)
    sm = torch.softmax(x64, -1)
    assert ((R.softmax(x).double() - sm).abs() <= (12 + 300) * EPS * sm).all()
    assert_rows_alone(R.softmax, x)


@pytest.mark.parametrize("inverse", [False, True])
def test_the_rope_kernel_rotates_the_trailing_pairs_and_is_per_row(inverse):
    t, h, d, half = 5, 3, 20, 6
    x = torch.randn(t, h, d, generator=gen(6))
    ang = torch.rand(t, half, generator=gen(7)) * 40
    cos, sin = ang.cos(), ang.sin()
    got = R.rope(x, cos, sin, inverse)
    s = -sin if inverse else sin
    e, o = x[..., d - 2 * half::2].double(), x[..., d - 2 * half + 1::2].double()
    c64, s64 = cos.double()[:, None], s.double()[:, None]
    assert torch.equal(got[..., :d - 2 * half], x[..., :d - 2 * half])
    for part, want, scale in ((got[..., d - 2 * half::2], e * c64 - o * s64, (e * c64).abs() + (o * s64).abs()),
                              (got[..., d - 2 * half + 1::2], e * s64 + o * c64, (e * s64).abs() + (o * c64).abs())):
        assert ((part.double() - want).abs() <= 2 * EPS * scale).all()
    assert_rows_alone(lambda a, c, sn: R.rope(a, c, sn, inverse), x, cos, sin)


def hc_case(t=6, hc=4, d=48, seed=0):
    g = gen(seed)
    streams = torch.randn(t, hc, d, generator=g)
    fn = torch.randn(hc * (2 + hc), hc * d, generator=g) / (hc * d) ** 0.5
    base, scale = 0.5 * torch.randn(hc * (2 + hc), generator=g), 1 + 0.2 * torch.randn(3, generator=g)
    return streams, fn, base, scale


def test_the_mhc_collapse_and_head_kernels_are_the_float64_formulas_of_their_mix():
    streams, fn, base, scale = hc_case()
    t, hc, _ = streams.shape
    flat = streams.reshape(t, -1)
    mix = flat @ fn.t()  # any fp32 mix: the kernel's input, the formula's too
    out, post, comb = R.hc_collapse(streams, mix, base, scale, 5, 1e-6, 1e-6)
    pre64, post64, comb64 = hc_math.weights_of_mix(hc_math.normalised_mix(mix, flat, 1e-6), hc, base, scale, 5, 1e-6)
    # float64 throughout but for the final rounding to fp32 (the sums' orders differ: 1e-15 relative)
    assert ((post.double() - post64).abs() <= EPS * post64).all()
    assert ((comb.double() - comb64).abs() <= EPS * comb64 + 1e-12).all()
    prod = pre64[..., None] * streams.double()
    # pre rounded to fp32, hc products and hc - 1 adds in fp32
    bound = (hc + 2) * EPS * prod.abs().sum(1)
    assert ((out.double() - prod.sum(1)).abs() <= bound).all()
    head_mix = mix[:, :hc]
    head = R.hc_collapse(streams, head_mix, base[:hc], scale[:1], 0, 1e-6, 1e-6, head=True)
    hpre = torch.sigmoid(hc_math.normalised_mix(head_mix, flat, 1e-6) * scale.double()[0] + base.double()[:hc]) + 1e-6
    hprod = hpre[..., None] * streams.double()
    assert ((head.double() - hprod.sum(1)).abs() <= (hc + 2) * EPS * hprod.abs().sum(1)).all()
    assert_rows_alone(lambda s, m: R.hc_collapse(s, m, base, scale, 5, 1e-6, 1e-6)[0], streams, mix)


def test_the_mhc_expand_kernel_is_the_formula_and_per_row():
    streams, _, _, _ = hc_case(seed=1)
    t, hc, d = streams.shape
    y = torch.randn(t, d, generator=gen(8))
    post = 2 * torch.rand(t, hc, generator=gen(9))
    comb = torch.rand(t, hc, hc, generator=gen(10))
    got = R.hc_expand(streams, y, post, comb)
    terms = torch.einsum("tjk,tjd->tkjd", comb.double(), streams.double())
    want = post.double()[..., None] * y.double()[:, None] + terms.sum(2)
    scale = (post.double()[..., None] * y.double()[:, None]).abs() + terms.abs().sum(2)
    assert ((got.double() - want).abs() <= (hc + 2) * EPS * scale).all()
    assert_rows_alone(R.hc_expand, streams, y, post, comb)


@pytest.mark.parametrize("case", ["softmax", "sigmoid", "sqrtsoftplus", "groups", "hash", "no_renorm"])
def test_fixed_routing_picks_native_routings_experts_with_their_weights(case):
    t, h, e, k = 12, 40, 16, 4
    x = torch.randn(t, h, generator=gen(11))
    w = torch.randn(e, h, generator=gen(12)) / h ** 0.5
    kw = dict(bias=0.1 * torch.randn(e, generator=gen(13)))
    if case == "groups":
        kw.update(n_group=4, topk_group=2)
    if case == "hash":
        kw = dict(tid2eid=torch.stack([torch.randperm(e, generator=gen(i))[:k] for i in range(50)]),
                  token_ids=torch.randint(0, 50, (t,), generator=gen(14)))
    if case == "no_renorm":
        kw["renorm"] = False
    scoring = case if case in ("softmax", "sigmoid", "sqrtsoftplus") else "sigmoid"
    want_w, want_ids = route_rows(ops_for(invariant=True), x, w, scoring, k, 2.5, **kw)  # native.c's kv_route
    got_w, got_ids = route_rows(CUDA_OPS, x, w, scoring, k, 2.5, **kw)
    if case != "hash":  # (the hash case's rows are its table's: nothing to batch)
        def routed(a):
            return torch.cat([r.double() for r in route_rows(CUDA_OPS, a, w, scoring, k, 2.5, **kw)], 1)
        assert_rows_alone(routed, x)
    assert torch.equal(got_ids, want_ids)  # random scores: no two within the rounding of each other
    # two fp32 evaluations of the scores (their H-term dots, one exp) then float64 weights
    assert ((got_w - want_w).abs() <= 4 * (h + 8) * EPS * want_w.abs()).all()


def test_fixed_routing_refuses_a_bad_table_with_a_clear_error():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="out of range"):
        route_rows(CUDA_OPS, x, w, "sigmoid", 2, 1.0, tid2eid=torch.full((3, 2), 9), token_ids=torch.tensor([0, 1]))


def test_the_row_kernels_hold_no_atomics_and_no_shape_chosen_tiles():
    src = inspect.getsource(R)
    assert "atomic" not in src.replace("no atomics", "")
    assert R.MM_TILE == (8, 32, 32)  # the tile is a constant: mm takes no tile argument
    assert "BM" not in inspect.signature(R.mm).parameters


# ---- the models ---------------------------------------------------------------------------------
def v4_model(dtype):
    cfg = tiny_config(vocab_size=64, hidden_size=64, num_hidden_layers=3, head_dim=32, qk_rope_head_dim=8,
                      q_lora_rank=32, o_lora_rank=16, sliding_window=8, layer_types=(SLIDING, CSA, HCA),
                      compress_ratios=(0, 4, 8), mlp_layer_types=("hash_moe", "moe", "moe"), index_n_heads=2,
                      index_head_dim=16, index_topk=2, n_routed_experts=4, moe_intermediate_size=32,
                      hc_sinkhorn_iters=3, num_nextn_predict_layers=0, bos_token_id=62, eos_token_id=63)
    model = Dsv4Model(cfg, dtype=dtype)
    init_random_(model, 0)
    return model


def glm_model(dtype):
    gc = _script()
    model = Glm5Model(glm5_config_from_dict(gc.GLM_TINY), dtype=dtype)
    gc.glm_random_(model, 0)
    return model


def prefilled(model, prompts):
    """States holding the prompts, prefilled by the default path (the same bits for every copy)."""
    states = []
    for p in prompts:
        st = model.new_state(capacity=64)
        if p:
            model.forward(p, st)
        states.append(st)
    return states


def refuse_torch_row_ops(monkeypatch):
    """The token-parallel ops' torch formulas raise: every one must take a Triton kernel."""
    def refused(*a, **k):
        raise AssertionError("a token-parallel op took torch's kernels in batch-invariant mode")
    from kvfold.numerics import rope
    for owner, name in ((torch.nn.functional, "linear"), (torch.nn.functional, "rms_norm"),
                        (hc_math, "weights_of_mix"), (hc_math, "weighted_streams"), (rope, "_rotation")):
        monkeypatch.setattr(owner, name, refused)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.batch_invariance), torch.bfloat16])
def test_each_sequence_gets_its_alone_bits_in_any_batch_on_the_cuda_path(family, dtype, monkeypatch):
    model = (v4_model if family == "deepseek_v4" else glm_model)(dtype)
    v = model.config.vocab_size
    # fresh, mid-window and past window and fold edges (window 8, ratios 4 and 8; k-pools of 4),
    # fed a prefill chunk, decode rows and a verify-sized chunk
    prompts = [[(i * 7 + j * 3 + 1) % (v - 2) for j in range(n)] for i, n in enumerate((0, 5, 11, 17))]
    feeds = [[(i + j * 5) % (v - 2) for j in range(n)] for i, n in enumerate((3, 1, 1, 6))]
    model.set_batch_invariant(False)
    default = [model.forward(f, st, last_only=False) for f, st in zip(feeds, prefilled(model, prompts))]
    model.set_kernels(CUDA_PATH)
    alone_states = prefilled(model, prompts)
    model.set_batch_invariant(True)
    alone = [model.forward(f, st, last_only=False) for f, st in zip(feeds, alone_states)]
    for members in ([0, 1, 2, 3], [3, 1]):
        model.set_batch_invariant(False)
        states = prefilled(model, [prompts[i] for i in members])
        model.set_batch_invariant(True)
        with monkeypatch.context() as m:
            refuse_torch_row_ops(m)
            got = model.forward_batch([(feeds[i], st) for i, st in zip(members, states)], last_only=False)
        for i, lg, st in zip(members, got, states):
            assert torch.equal(lg, alone[i]), f"sequence {i} in batch {members}"
            assert st.snapshot() == alone_states[i].snapshot()
    model.set_batch_invariant(False)
    # and the mode computes the same model as the default path, within two paths' rounding
    for a, b in zip(alone, default):
        assert (a.float() - b.float()).abs().max() <= fp32_paths_bound(b.float(), model.config.num_hidden_layers, dtype)


def test_the_mode_is_asked_for_off_the_cpu_and_refused_where_it_cannot_hold():
    cuda, cpu, kernels = torch.device("cuda"), torch.device("cpu"), KernelSet()
    assert invariance_unsupported(cuda, torch.float32, kernels) is None  # triton is installed (the dev extra)
    assert invariance_unsupported(cuda, torch.bfloat16, kernels) is None
    assert "fp32 and bf16" in invariance_unsupported(cuda, torch.float16, kernels)
    assert not invariance_by_default(cuda, torch.float32, kernels)
    assert invariance_by_default(cpu, torch.float32, kernels) == native.available()
    assert "fp32" in invariance_unsupported(cpu, torch.bfloat16, kernels)  # native.c: fp32 only
    model = v4_model(torch.bfloat16)
    assert not model.batch_invariant  # a bf16 CPU model starts without it
    model.set_kernels(CUDA_PATH)
    model.set_batch_invariant(True)  # the Triton kernels take bf16
    with pytest.raises(ConfigError, match="set_batch_invariant\\(False\\)"):
        model.set_numerics("reference")
    assert model.numerics == "hf" and model.batch_invariant
    model.set_batch_invariant(False)
    model.set_numerics("reference")
    with pytest.raises(ConfigError, match="numerics='hf'"):
        model.set_batch_invariant(True)
    assert not model.batch_invariant


def engine_case(lengths, max_tokens):
    """The test's tiny V4 with a tokenizer, a sampled target request asking for logprobs, and
    others of these prompt lengths (sampled too)."""
    import kvfold
    from kvfold import SamplingParams
    model = v4_model(torch.float32)
    model.tokenizer = kvfold.load_model("tiny-random").tokenizer
    v = model.config.vocab_size - 2
    target = ([(5 * j + 2) % v for j in range(13)],
              SamplingParams(max_tokens=4, temperature=0.9, seed=3, ignore_eos=True, logprobs=3))
    others = [([(3 * j + i) % v for j in range(n)],
               SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True))
              for i, n in enumerate(lengths)]
    return model, target, others


def run_engine(engine, first, now=(), late=()):
    """Step `engine` to the end with the (prompt, params) requests `first` and `now` added at once,
    and each of `late` after a step in which `first` got tokens (so it prefills beside first's
    decode rows): first's tokens and logprobs."""
    rid = engine.add_request(*first)
    for req in now:
        engine.add_request(*req)
    tokens, logprobs, pending = [], [], list(late)
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                logprobs += o.logprobs or []
        if tokens and pending:
            engine.add_request(*pending.pop(0))
    return tokens, logprobs


def test_an_engine_requests_tokens_and_logprobs_do_not_depend_on_the_load_on_the_cuda_path():
    """Engine(batch_invariant=True) as on CUDA: a sampled request alone, then beside two others
    (a longer prefill and decodes in the same steps), gets the same tokens and float32 logprobs."""
    from kvfold import Engine
    model, target, others = engine_case((21, 2), max_tokens=3)
    model.set_kernels(CUDA_PATH)
    solo = Engine(model, max_seq_len=64, batch_invariant=True, prefix_cache_bytes=0)
    assert solo.batch_invariant
    alone = run_engine(solo, target)
    loaded = run_engine(Engine(model, max_seq_len=64, batch_invariant=True, prefix_cache_bytes=0), target,
                        now=others)
    assert len(alone[0]) == 4 and len(alone[1]) == 4
    assert loaded == alone  # the tokens, and the float32 logprobs each with its top 3


def test_a_graph_decode_step_gives_a_row_the_same_bits_in_any_batch_and_bucket_on_the_cuda_path():
    """DeepSeek-V4's capturable step with the Triton kernels on and batch invariance (as a CUDA
    graph replays it; on the CPU it runs eagerly): a sequence's logits and final streams are the
    same bits alone (bucket 1, context bound 256) and beside others (buckets 2 and 4, with padding
    rows; bound 512, which lengthens the indexer's and HCA's entry lists), step after step."""
    from kvfold.engine.graphs import DecodeGraphs
    model = v4_model(torch.float32)
    v = model.config.vocab_size - 2
    prompts = {"a": [(3 * j + 1) % v for j in range(5)], "b": [(7 * j + 2) % v for j in range(300)],
               "c": [(5 * j) % v for j in range(41)]}
    seen: dict = {}
    for members in (["a"], ["b"], ["a", "b"], ["b", "c", "a"]):
        model.set_kernels(KernelSet())  # prefills: the default path, the same bits for every copy
        model.set_batch_invariant(False)
        pool = model.new_page_pool(16)
        arena = model.new_decode_arena(3, 512, pool)
        states = {}
        for name in members:
            states[name] = model.new_state(capacity=512, pages=pool, arena=arena)
            model.forward(prompts[name], states[name])
        model.set_kernels(CUDA_PATH_TRITON)
        model.set_batch_invariant(True)
        graphs = DecodeGraphs(model, arena, 4)
        for step in range(2):
            pairs = [((step * 11 + len(name)) % v, states[name]) for name in members]
            logits, streams = graphs.step(pairs, hidden=True)
            for i, name in enumerate(members):
                key = (name, step)
                if key in seen:
                    assert torch.equal(logits[i], seen[key][0]), (key, members)
                    assert torch.equal(streams[i], seen[key][1]), (key, members)
                else:
                    seen[key] = (logits[i], streams[i])
        model.set_batch_invariant(False)
    assert len(seen) == 6


def test_graph_decode_keeps_batch_invariance_only_where_its_kernels_are_per_row():
    from kvfold import Engine
    model = v4_model(torch.float32)
    model.set_batch_invariant(False)
    model.set_kernels(CUDA_PATH)
    with pytest.raises(ConfigError, match="batch invariance only with the Triton kernels"):
        Engine(model, max_seq_len=256, decode_graphs=True, batch_invariant=True)
    assert not model.batch_invariant  # refused: the mode as it was
    model.set_kernels(CUDA_PATH_TRITON)
    engine = Engine(model, max_seq_len=256, decode_graphs=True, batch_invariant=True)
    assert engine.graphs is not None and engine.graphs.batch_invariant
    assert not model.batch_invariant  # the engine's mode is its own
    glm = glm_model(torch.float32)
    glm.set_kernels(CUDA_PATH_TRITON)
    glm.set_batch_invariant(True)
    assert "promise no batch invariance" in glm.graph_unsupported()


def test_a_graph_engine_requests_bits_do_not_depend_on_the_load_on_the_cuda_path():
    """Engine(decode_graphs=True, batch_invariant=True) with the Triton kernels, as on CUDA: decode
    rows always take the graph step (prefill chunks the forward, in a second call of the same
    step), so a sampled request gets the same tokens and float32 logprobs alone and beside others
    whose prompts arrive while it decodes."""
    from kvfold import Engine
    model, target, late = engine_case((9, 4), max_tokens=2)
    runs = []
    model.set_kernels(CUDA_PATH_TRITON)
    for arrivals in ((), late):
        engine = Engine(model, max_seq_len=64, max_running=3, decode_graphs=True, batch_invariant=True,
                        prefix_cache_bytes=0)
        runs.append((run_engine(engine, target, late=arrivals), engine.metrics()))
    model.set_batch_invariant(False)
    (alone, m_alone), (loaded, m_loaded) = runs
    assert len(alone[0]) == 4 and loaded == alone
    assert m_alone["graph_steps"] == 3 and m_loaded["graph_steps"] >= 3  # the target's decode rows

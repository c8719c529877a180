"""numerics="reference", layer by layer, against the release's formulas written out here.

The formulas restate the DeepSeek-V4 release (inference/model.py `Expert`, `MoE`, `Indexer`;
inference/kernel.py `act_quant`, `sparse_attn_kernel`) in plain torch, one row at a time, without
calling the code under test. Where both sides do the same arithmetic the results must be
bit-identical; where only the order of an fp32 accumulation differs the bound says why.
"""
import math
import pytest
import torch
import torch.nn.functional as F

import kvfold
from kvfold.numerics.reference import release_index_scores, release_sparse_attn
from helpers import random_ids

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def ref():
    return kvfold.load_model("tiny-random", numerics="reference", dtype=BF16)


# ---- the release's formulas ------------------------------------------------------------------

def act_quant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """kernel.py act_quant (later revision, ue8m0 scales): per row, per `block` columns,
    s = 2^ceil(log2(max(amax, 1e-4) / 448)); x <- float(e4m3(clamp(x / s, +-448))) * s, in x's dtype."""
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], block):
            v = x[r, c:c + block].float()
            amax = max(v.abs().max().item(), 1e-4)
            s = 2.0 ** math.ceil(math.log2(amax / 448.0))
            q = (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            out[r, c:c + block] = q.to(x.dtype)
    return out


def expert(x, w1, w3, w2, limit, weight=None):
    """model.py Expert.forward on one bf16 row: each linear quantizes its input (act_quant) and
    returns bf16; silu(gate) * up (and the routing weight) in fp32; cast to bf16 before w2."""
    gate = F.linear(act_quant(x), w1).float()
    up = F.linear(act_quant(x), w3).float()
    up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    h = F.silu(gate.double()).float() * up  # fp32 silu (rounded once: no vector/tail split)
    if weight is not None:
        h = weight * h
    return F.linear(act_quant(h.to(BF16)), w2)


def moe_release(moe, x, token_ids, ops):
    """model.py MoE.forward: y (fp32) += expert(x[idx], weights[idx]) for experts in ascending
    id; y += shared(x); y cast to bf16."""
    weights, ids = moe.gate(x, token_ids, ops)  # routing is the same code in both modes; not under test
    inter = moe.experts.down_proj.shape[2]
    lim = moe.experts.limit
    y = torch.zeros(x.shape[0], x.shape[1], dtype=F32)
    for e in sorted(set(ids.flatten().tolist())):
        w13, w2 = moe.experts.gate_up_proj[e], moe.experts.down_proj[e]
        for t, j in (ids == e).nonzero().tolist():
            y[t] += expert(x[t:t + 1], w13[:inter], w13[inter:], w2, lim, weights[t, j].reshape(1, 1))[0].float()
    sh = moe.shared_experts
    y += expert(x, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, sh.limit).float()
    return y.to(BF16)


# ---- MoE --------------------------------------------------------------------------------------

def test_moe_weights_before_the_down_projection_quantization_bit_identical(ref):
    moe = ref.model.layers[1].mlp  # a score-routed layer
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(12, ref.config.hidden_size, generator=g) * 2).to(BF16)
    tok = random_ids(12, ref.config.vocab_size, seed=4)
    ops = ref.backend()
    got = moe(x, tok, ops)
    assert torch.equal(got, moe_release(moe, x, tok, ops))
    # ... and the placement matters: the weight applied after w2 (kvfold's hf order) moves it
    weights, ids = moe.gate(x, tok, ops)
    inter = moe.experts.down_proj.shape[2]
    after = torch.zeros(12, x.shape[1], dtype=F32)
    for t in range(12):
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            w13 = moe.experts.gate_up_proj[e]
            y = expert(x[t:t + 1], w13[:inter], w13[inter:], moe.experts.down_proj[e], moe.experts.limit)
            after[t] += weights[t, j] * y[0].float()
    sh = moe.shared_experts
    shared = expert(x, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, sh.limit).float()
    assert not torch.equal((after + shared).to(BF16), got)


def test_the_shared_expert_clamps_as_the_later_release_does(ref):
    moe = ref.model.layers[1].mlp
    sh = moe.shared_experts
    x = (torch.randn(4, ref.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 40).to(BF16)
    got = moe._shared_release(x, ref.backend())
    assert torch.equal(got, expert(x, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, sh.limit))
    gate = F.linear(act_quant(x), sh.gate_proj.weight).float()
    assert (gate > sh.limit).any()  # the clamp is exercised


# ---- attention core -----------------------------------------------------------------------------

def attn_release(q, keys, valid, sink, scale, block=64):
    """kernel.py sparse_attn_kernel for one query row and head, written per element in float64
    from the rounded quantities: blocks of 64 columns, running max m_b; p = exp(s - m_b) in fp32,
    cast to bf16 to weight the values; the normaliser from the fp32 p, rescaled like the values."""
    s = (keys.double() @ q.double()).float().double() * scale  # fp32 logits
    acc = torch.zeros(keys.shape[1], dtype=torch.float64)
    l, m = 0.0, -math.inf
    for b0 in range(0, keys.shape[0], block):
        idx = [j for j in range(b0, min(b0 + block, keys.shape[0])) if valid[j]]
        if not idx:
            continue
        m_new = max(m, max(float(s[j]) for j in idx))
        alpha = math.exp(m - m_new) if m > -math.inf else 0.0
        p = [torch.tensor(math.exp(float(s[j]) - m_new), dtype=F32) for j in idx]
        l = l * alpha + sum(float(pj) for pj in p)
        acc = acc * alpha + sum(float(pj.to(BF16)) * keys[j].double() for pj, j in zip(p, idx))
        m = m_new
    return acc / (l + math.exp(sink - m))


def test_attention_core_weights_values_by_bf16_probabilities():
    g = torch.Generator().manual_seed(6)
    n, h, d, k = 3, 2, 64, 150  # three blocks of 64 columns, the last one partial
    q = (torch.randn(n, h, d, generator=g) * 0.4).to(BF16).float()
    keys = torch.randn(n, k, d, generator=g).to(BF16).float()
    keys[:, 70:80] *= 3  # a later block holds the largest logits: the running max moves
    valid = torch.rand(n, k, generator=g) > 0.2
    sinks = torch.randn(h, generator=g)
    scale = d ** -0.5
    got = release_sparse_attn(q, keys, valid, sinks, scale)
    vmax = keys.abs().max().item()
    # the same arithmetic but for the fp32 accumulation order of sum_j bf16(p_j) v_j (k terms,
    # each |p_j v_j| <= l * vmax): |error| <= k * 2^-24 * vmax, plus the fp32 exp's last bits
    bound = (k + 4) * 2.0 ** -24 * vmax
    fp32_p = []
    for i in range(n):
        for hh in range(h):
            want = attn_release(q[i, hh], keys[i], valid[i], sinks[hh].item(), scale)
            assert (got[i, hh].double() - want).abs().max().item() <= bound
            # kvfold's hf rule (fp32 probabilities) differs by up to the bf16 rounding of each
            # p_j (relative 2^-9): |diff| <= 2^-9 * vmax, and here by far more than `bound`
            p = torch.softmax(torch.cat([keys[i] @ q[i, hh] * scale * 1.0, sinks[hh:hh + 1]]).masked_fill(
                torch.cat([~valid[i], torch.tensor([False])]), -math.inf), 0)
            fp32_p.append((p[:-1] @ keys[i] - got[i, hh]).abs().max().item())
    assert max(fp32_p) <= 2.0 ** -9 * vmax + bound
    assert max(fp32_p) > 10 * bound


def test_attention_blocking_moves_the_output_by_at_most_a_bf16_rounding_of_p():
    """Where the release's columns fall into other 64-column blocks (its prefill of a prompt
    shorter than the window packs the window into T columns), each bf16(p_j) is the rounding of
    a differently scaled value: two roundings of one p_j differ by <= 2^-8 p_j, so the outputs
    differ by <= 2^-8 max|v| (+ fp32 noise)."""
    g = torch.Generator().manual_seed(7)
    n, h, d, k = 4, 4, 64, 100
    q = torch.randn(n, h, d, generator=g).to(BF16).float()
    keys = torch.randn(n, k, d, generator=g).to(BF16).float()
    valid = torch.ones(n, k, dtype=torch.bool)
    sinks = torch.zeros(h)
    a = release_sparse_attn(q, keys, valid, sinks, d ** -0.5)
    shifted = torch.cat([torch.zeros(n, 20, d), keys], 1)  # 20 invalid columns first
    b = release_sparse_attn(q, shifted, torch.cat([torch.zeros(n, 20, dtype=torch.bool), valid], 1), sinks, d ** -0.5)
    diff = (a - b).abs().max().item()
    assert 0 < diff <= 2.0 ** -8 * keys.abs().max().item() + 1e-5


# ---- indexer ------------------------------------------------------------------------------------

def index_scores_release(q, keys, w):
    """model.py Indexer.forward: einsum in bf16 (fp32 accumulation, one rounding), relu,
    * weights (bf16, one rounding), sum over heads (fp32 accumulation, one rounding to bf16).
    The dot products are taken exactly (float64: q and keys are FP4 values times power-of-two
    block scales, so the fp32 accumulation is exact in any order) and rounded once."""
    s = torch.einsum("shd,td->sht", q.double(), keys.double()).float().to(BF16)
    terms = (torch.relu(s).float() * w.float()[..., None]).to(BF16)
    return terms.double().sum(dim=1).float().to(BF16)


def test_indexer_scores_bit_identical_and_ties_go_to_the_lower_index(ref):
    from kvfold.models.deepseek_v4.indexer import Indexer
    calls = []
    orig = Indexer._select_release

    def spy(self, q, w, start, st, n_entries, k):
        out = orig(self, q, w, start, st, n_entries, k)
        calls.append((self, q, w, start, st.pool[:n_entries].clone(), out))
        return out

    Indexer._select_release = spy
    try:
        ref.forward(random_ids(200, ref.config.vocab_size, seed=9), ref.new_state(capacity=200))
    finally:
        Indexer._select_release = orig
    rows = ties = 0
    for idx, q, w, start, keys, picks in calls:
        scores = index_scores_release(q, keys, w)
        assert torch.equal(release_index_scores(q, keys, w), scores)
        for i in range(q.shape[0]):
            vis = (start + i + 1) // idx.ratio
            sc = scores[i, :vis].float().tolist()
            order = sorted(range(vis), key=lambda j: (-sc[j], j))[: picks.shape[1]]  # ties: lower index
            assert picks[i].tolist() == order + [-1] * (picks.shape[1] - len(order))
            if vis > len(order):
                rows += 1
                kth = sc[order[-1]]
                ties += sum(x == kth for x in sc) > sum(sc[j] == kth for j in order)
    # bf16 scores tie at the k-th place in a few per cent of rows: the tie rule is exercised
    assert rows > 100 and ties > 0, (rows, ties)


# ---- the model: self-consistency -----------------------------------------------------------------

def test_reference_decode_and_chunked_prefill_equal_one_prefill_bit_for_bit(ref):
    ids = random_ids(80, ref.config.vocab_size, seed=40)
    whole = ref.forward(ids, ref.new_state(capacity=80))
    st = ref.new_state(capacity=80)
    rows = [ref.forward(ids[:40], st)] + [ref.forward(ids[i:i + 1], st) for i in range(40, 80)]
    assert torch.equal(torch.cat(rows), whole)
    st = ref.new_state(capacity=80)
    assert torch.equal(torch.cat([ref.forward(ids[a:a + 7], st) for a in range(0, 80, 7)]), whole)


def test_an_fp32_last_bit_can_flip_an_fp8_rounding_by_one_e4m3_step():
    """Why fp32 reference numerics drifted between prefill and decode: a value within an fp32
    ulp of an e4m3 midpoint rounds to either neighbour, one e4m3 step (2^-3 of the element's
    binade times its scale) apart, and that step is carried on through the KV cache."""
    s = 2.0 ** -5  # the scale of a block whose amax is 448 * 2^-5 (its first element)
    lo, hi = 1.125 * s, 1.25 * s  # e4m3 neighbours in [1, 2): one step is 2^-3 there
    mid = (lo + hi) / 2  # the tie goes to the even code, 1.25
    x = torch.tensor([[448 * s] + [mid] * 127], dtype=F32)
    below = x.clone()
    below[0, 1:] = torch.nextafter(x[0, 1:], torch.zeros(()))  # one fp32 ulp lower
    a, b = act_quant(x)[0, 1].item(), act_quant(below)[0, 1].item()
    assert (a, b) == (hi, lo) and a - b == 2.0 ** -3 * s
    # 3e-7 relative (what fp32 prefill and decode differ by) is ~10^5 fp32 ulps below the step

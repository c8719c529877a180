"""GLM-5.3 DSA selection (models/glm5/dsa_select.py): an independent brute force written here
(plain loops, float64), the tie and tail rules, the state's rows feeding it, and transformers'
Glm5NextTextIndexer as an oracle (split from tests/test_glm5_dsa_state.py, which holds the state)."""
from __future__ import annotations

import math

import pytest
import torch

from kvfold.models.glm5.dsa_select import dsa_pool_keys, dsa_select, selection_mask
from kvfold.models.glm5.indexer_state import Glm5NextDsaConfig, Glm5NextDsaState

# ---- selection: brute force --------------------------------------------------------------------
def brute_select(q, w, k, g, valid, ape, topk, kp, tail=True) -> list[list[int]]:
    """Selection straight from the definitions (pools, pooled keys, visibility, ties, tail): loops
    and float64, no tensor ops shared with the implementation except reading the inputs."""
    seq, d = len(k), len(k[0])
    q_rows = len(q)
    first = next((i for i in range(seq) if valid[i]), seq)
    n_pools = seq // kp
    pool_rows = [[first + p * kp + s for s in range(kp)] for p in range(n_pools)]
    pool_ok = [all(r < seq and valid[r] for r in rows) for rows in pool_rows]
    keys = []
    for rows in pool_rows:
        key = [0.0] * d
        for c in range(d):
            logits = [g[r][c] + ape[s][c] if r < seq and valid[r] else -math.inf for s, r in enumerate(rows)]
            top = max(logits)
            if top == -math.inf:
                continue  # no valid slot: key 0
            e = [math.exp(x - top) for x in logits]
            key[c] = sum(ei / sum(e) * k[r][c] for ei, r in zip(e, rows) if r < seq)
        keys.append(key)
    select_k = min(topk // kp, n_pools)
    width = topk + (kp - 1 if tail else 0)
    out = []
    for i in range(q_rows):
        pos = seq - q_rows + i
        row = [-1] * width
        if not valid[pos]:
            out.append(row)
            continue
        scored = []
        for p in range(n_pools):
            if pool_ok[p] and pool_rows[p][-1] <= pos:
                score = sum(w[i][h] * max(0.0, sum(a * b for a, b in zip(q[i][h], keys[p])) / math.sqrt(d))
                            for h in range(len(w[i])))
                scored.append((-score, p))
        ranked = [p for _, p in sorted(scored)][:select_k]  # ties -> lower pool index
        for j, p in enumerate(ranked):
            row[j * kp:(j + 1) * kp] = pool_rows[p]
        if tail:
            visible = sum(1 for r in range(pos + 1) if valid[r])
            n_tail = visible % kp
            start = first + visible - n_tail
            for j in range(n_tail):
                r = start + j
                if r < seq and valid[r] and r <= pos:
                    row[select_k * kp + j] = r
        out.append(row)
    return out


def random_inputs(seq, q_rows, kp, heads=3, d=8, seed=0, pad=0, hole=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(seq, d, generator=g)
    gate = torch.randn(seq, d, generator=g)
    valid = torch.ones(seq, dtype=torch.uint8)
    valid[:pad] = 0
    if hole is not None:
        valid[hole[0]:hole[1]] = 0
    q = torch.randn(q_rows, heads, d, generator=g)
    w = torch.randn(q_rows, heads, generator=g)
    ape = torch.randn(kp, d, generator=g)
    return q, w, k, gate, valid, ape


@pytest.mark.parametrize("kp,topk", [(1, 4), (2, 6), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_selection_equals_brute_force(kp, topk):
    # random signs: many pools score exactly 0 after ReLU, so the tie rule is exercised too
    cases = [dict(seq=29, q_rows=29), dict(seq=29, q_rows=3), dict(seq=2, q_rows=2),
             dict(seq=30, q_rows=30, pad=3), dict(seq=31, q_rows=10, hole=(12, 21))]
    for j, case in enumerate(cases):
        q, w, k, gate, valid, ape = random_inputs(kp=kp, seed=100 * kp + j, **case)
        got = dsa_select(q, w, k, gate, valid, ape, topk=topk, kpool=kp)
        want = brute_select(q.tolist(), w.tolist(), k.tolist(), gate.tolist(), valid.tolist(), ape.tolist(),
                            topk, kp)
        assert got.dtype == torch.int32 and got.tolist() == want, (kp, topk, case)
    got = dsa_select(q, w, k, gate, valid, ape, topk=topk, kpool=kp, select_tail=False)
    assert got.tolist() == brute_select(q.tolist(), w.tolist(), k.tolist(), gate.tolist(), valid.tolist(),
                                        ape.tolist(), topk, kp, tail=False)


def test_ties_go_to_the_lower_pool_index():
    kp, d = 4, 8
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(kp, d, generator=g)
    k = pool.repeat(6, 1)  # six identical pools: every score ties
    gate = torch.randn(kp, d, generator=g).repeat(6, 1)
    q, w, ape = torch.rand(1, 2, d, generator=g), torch.rand(1, 2, generator=g), torch.zeros(kp, d)
    valid = torch.ones(24, dtype=torch.uint8)
    out = dsa_select(q, w, k, gate, valid, ape, topk=12, kpool=kp)
    assert out[0, :12].tolist() == list(range(12))  # pools 0, 1, 2 in that order
    # two pools share the best score: the lower one ranks first, whatever their positions
    k2 = k.clone()
    k2[20:24] = k2[8:12] = pool * 3 + 1
    out = dsa_select(q, w, k2, gate, valid, ape, topk=8, kpool=kp)
    assert out[0, :8].tolist() == [8, 9, 10, 11, 20, 21, 22, 23]


def test_incomplete_pool_tail_and_padding():
    kp, d = 4, 4
    q, w, k, gate, valid, ape = random_inputs(seq=8, q_rows=8, kp=kp, d=d, seed=1)
    w = w.abs()
    # decode-style (one query at the end): q = 2 dense, q = 3 first pool, q = 5 pool 0 plus tail [4, 5]
    for pos, want_pools, want_tail in [(2, [], [0, 1, 2]), (3, [0, 1, 2, 3], []), (5, [0, 1, 2, 3], [4, 5])]:
        n = pos + 1
        out = dsa_select(q[pos:pos + 1], w[pos:pos + 1], k[:n], gate[:n], valid[:n], ape, topk=2048, kpool=kp)
        assert out.shape == (1, 2051)
        row = out[0].tolist()
        assert row == want_pools + want_tail + [-1] * (2051 - len(want_pools) - len(want_tail))
    # prefill chunk: select_k is shared, so q=2 gets -1 picks, and the tail starts at select_k*kp
    out = dsa_select(q, w, k, gate, valid, ape, topk=16, kpool=kp)
    assert out.shape == (8, 19)
    assert out[2].tolist() == [-1] * 8 + [0, 1, 2] + [-1] * 8
    assert out[5].tolist()[:4] == [0, 1, 2, 3] and out[5].tolist()[4:11] == [-1] * 4 + [4, 5, -1]
    assert sorted(out[7].tolist()[:8]) == list(range(8)) and out[7].tolist()[8:] == [-1] * 11
    # seq < kp: [0..seq) then -1
    out = dsa_select(q[2:3], w[2:3], k[:3], gate[:3], valid[:3], ape, topk=16, kpool=kp)
    assert out[0].tolist() == [0, 1, 2] + [-1] * 16
    # a padded query row is all -1; pooling starts at the first valid row
    valid = valid.clone()
    valid[:2] = 0
    out = dsa_select(q, w, k, gate, valid, ape, topk=16, kpool=kp)
    assert (out[:2] == -1).all()
    assert out[5].tolist()[:4] == [2, 3, 4, 5] and out[7].tolist()[8:10] == [6, 7]


def test_pool_keys_partial_and_invalid_pools():
    kp, d = 4, 3
    g = torch.Generator().manual_seed(2)
    k, gate, ape = torch.randn(10, d, generator=g), torch.randn(10, d, generator=g), torch.randn(kp, d, generator=g)
    valid = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    keys, rows, ok = dsa_pool_keys(k, gate, valid, ape, kp)
    assert keys.shape == (2, d) and ok.tolist() == [True, False]  # rows 8, 9: partial pool dropped
    assert torch.equal(keys[1], torch.zeros(d))  # no valid slot: key 0, not NaN
    wts = torch.softmax(gate[:4] + ape, dim=0)  # per channel, over the slots
    torch.testing.assert_close(keys[0], (wts * k[:4]).sum(0))


def test_selection_mask_reads_a_set():
    idx = torch.tensor([[3, 3, -1, 7, 9, 0], [-1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    m = selection_mask(idx, 8)
    assert m.shape == (2, 8)
    assert m[0].nonzero().flatten().tolist() == [0, 3, 7] and not m[1].any()


def test_state_rows_feed_selection_and_match_geometry():
    kp, d, topk = 4, 8, 8
    cfg = Glm5NextDsaConfig(index_head_dim=d, index_heads=3, index_topk=topk, index_kpool=kp, max_context=64)
    q, w, k, gate, valid, ape = random_inputs(seq=23, q_rows=5, kp=kp, d=d, seed=4)
    s = Glm5NextDsaState.alloc(cfg, dtype=torch.float32)
    s.ensure_room(23)
    s.write_rows(0, k, gate, valid)
    s.advance(23)
    out = dsa_select(q, w, *s.reachable(), ape, topk=topk, kpool=kp)
    geo = s.geometry(cfg, 5)
    assert out.shape == (geo.q_rows, geo.out_width)
    assert out.tolist() == dsa_select(q, w, k, gate, valid, ape, topk=topk, kpool=kp).tolist()
    assert (out[:, geo.select_k * kp + kp - 1:] == -1).all()


# ---- selection: transformers' indexer as the oracle ---------------------------------------------
@pytest.fixture(scope="module")
def hf_indexer():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    def build(kp: int, topk: int, dtype: torch.dtype, seed: int):
        cfg = Glm5NextTextConfig(hidden_size=32, index_n_heads=4, index_head_dim=16, q_lora_rank=16,
                                 index_topk=topk, index_kpool=kp, qk_rope_head_dim=0)
        m = Glm5NextTextIndexer(cfg, 0)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            # keep every q.K positive: no ReLU-zero ties, whose order torch.topk leaves undefined
            m.wq_b.weight.abs_()
            m.k_norm.bias.fill_(3.0)
            m.k_norm.weight.mul_(0.5)
        return m.to(dtype), g
    return build


@pytest.mark.parametrize("kp,topk", [(1, 4), (3, 6), (4, 8), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_matches_transformers_indexer(hf_indexer, kp, topk, dtype):
    import torch.nn.functional as F
    m, g = hf_indexer(kp, topk, dtype, seed=kp)
    seq = 37
    x = torch.randn(1, seq, 32, generator=g).to(dtype)
    q_resid = torch.randn(1, seq, 16, generator=g).abs().to(dtype)
    for pad in (0, 3):
        mask = torch.ones(1, seq, dtype=torch.bool)
        mask[0, :pad] = False
        want = m(x, q_resid, mask, None)[0]
        with torch.no_grad():  # the per-token values the state stores, and the queries
            k = m.k_norm(m.wk(x))[0]
            gate = F.linear(x, m.index_kpool_compress_gate)[0]
            q = m.wq_b(q_resid)[0].view(seq, 4, 16)
            w = m.weights_proj(x)[0].float() * 4 ** -0.5
        s = Glm5NextDsaState(64, 16, kp, dtype=dtype)
        s.write_rows(0, k, gate, mask[0])
        s.advance(seq)
        for q_rows in (seq, 5):  # a whole prefill, and the last chunk over a cached prefix
            got = dsa_select(q[seq - q_rows:], w[seq - q_rows:], *s.reachable(),
                             m.index_kpool_compress_ape.detach(), topk=topk, kpool=kp)
            assert got.shape == want[seq - q_rows:].shape
            if pad == 0:
                assert torch.equal(got, want[seq - q_rows:])
            else:  # with left padding HF may size select_k by valid pools only: compare as sets
                assert torch.equal(selection_mask(got, seq), selection_mask(want[seq - q_rows:], seq))

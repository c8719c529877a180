"""The pure functions, each against an independent formula."""
import math

import pytest
import torch
from helpers import ops_for

from kvfold.models.deepseek_v4.config import YarnParams
from kvfold.numerics import apply_rope, pool_windows, rope_inv_freq, topk_lower_index

OPS = ops_for()  # an fp32 CPU model's ops (native.c's rope and pooling)


def test_topk_ties_go_to_the_lower_index_and_come_back_ascending():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    assert topk_lower_index(scores, 2).tolist() == [[1, 2]]
    assert topk_lower_index(scores, 4).tolist() == [[1, 2, 4, 5]]
    zeros = torch.zeros(1, 5)  # ReLU makes all-zero rows common: lowest indices win
    assert topk_lower_index(zeros, 3).tolist() == [[0, 1, 2]]


def test_topk_pads_invisible_entries_with_minus_one():
    scores = torch.tensor([[0.5, float("-inf"), 2.0, float("-inf")]])
    assert topk_lower_index(scores, 4).tolist() == [[0, 2, -1, -1]]


def test_yarn_matches_the_spec_formula_for_v4_flash():
    # DeepSeek-V4 YaRN: theta 160000, 64 rope dims, factor 16, original 65536 -> low 15, high 25
    yarn = YarnParams(factor=16, original_max_position_embeddings=65536)
    got = rope_inv_freq(64, 160000.0, yarn)
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ramp = ((torch.arange(32, dtype=torch.float32) - 15) / (25 - 15)).clamp(0, 1)
    want = base * (1 - ramp) + base / 16 * ramp
    assert torch.allclose(got, want)
    assert torch.allclose(got[:15], base[:15]) and torch.allclose(got[26:], base[26:] / 16)


def test_rope_rotates_interleaved_pairs_of_trailing_dims_and_inverse_undoes_it():
    x = torch.randn(3, 2, 10)
    inv = rope_inv_freq(4, 10000.0)
    pos = torch.tensor([0, 1, 7]).float()
    freqs = pos[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    y = apply_rope(OPS, x, cos, sin)
    assert torch.equal(y[..., :6], x[..., :6])
    # pair (x[6], x[7]) as a complex number times e^{i p f_0}
    z = torch.complex(x[..., 6], x[..., 7]) * torch.exp(1j * freqs[:, None, 0])
    assert torch.allclose(y[..., 6], z.real, atol=1e-6) and torch.allclose(y[..., 7], z.imag, atol=1e-6)
    assert torch.allclose(apply_rope(OPS, y, cos, sin, inverse=True), x, atol=1e-6)


def test_overlapping_pool_reads_previous_ca_and_own_cb_per_channel():
    r, c = 4, 3
    kv = torch.randn(2 * r, 2 * c)
    sc = torch.randn(2 * r, 2 * c)
    got = pool_windows(OPS, kv, sc, r, overlap=True)[0]
    for d in range(c):
        slots_kv = torch.cat([kv[:r, d], kv[r:, c + d]])
        slots_sc = torch.cat([sc[:r, d], sc[r:, c + d]])
        w = torch.exp(slots_sc - slots_sc.max())
        assert math.isclose(got[d].item(), (w * slots_kv).sum().item() / w.sum().item(), rel_tol=1e-5, abs_tol=1e-6)


def test_window_zero_uses_only_its_own_slots():
    r, c = 4, 2
    kv = torch.randn(2 * r, 2 * c)
    sc = torch.randn(2 * r, 2 * c)
    kv[:r], sc[:r] = 0.0, float("-inf")  # positions before 0
    got = pool_windows(OPS, kv, sc, r, overlap=True)[0]
    alone = pool_windows(OPS, kv[r:, c:], sc[r:, c:], r, overlap=False)[0]
    assert torch.allclose(got, alone)


@pytest.mark.parametrize("n_w", [1, 3])
def test_non_overlapping_pool_is_softmax_weighted_mean_per_channel(n_w):
    r, c = 8, 5
    kv, sc = torch.randn(n_w * r, c), torch.randn(n_w * r, c)
    got = pool_windows(OPS, kv, sc, r, overlap=False)
    want = (torch.softmax(sc.view(n_w, r, c), dim=1) * kv.view(n_w, r, c)).sum(1)
    assert torch.allclose(got, want, atol=1e-6)


def test_sinkhorn_is_doubly_stochastic_up_to_its_eps():
    from kvfold.numerics.hc import sinkhorn
    comb = torch.softmax(torch.randn(5, 4, 4, dtype=torch.float64), dim=-1) + 1e-6
    got = sinkhorn(comb, 20, 1e-6)
    assert torch.allclose(got.sum(-2), torch.ones(5, 4, dtype=torch.float64), atol=1e-5)  # columns last
    assert torch.allclose(got.sum(-1), torch.ones(5, 4, dtype=torch.float64), atol=1e-3)
    one_round = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)  # by hand: one column normalisation
    assert torch.equal(sinkhorn(comb, 1, 1e-6), one_round)

"""One forward path: full prefill, any chunking and token-by-token decode give the same logits,
up to fp32 rounding (`helpers.fp32_paths_bound`: derived from the depth and the logits' scale)."""
import random

import pytest
import torch

from helpers import fp32_paths_bound, random_ids

BOUNDARY_LENGTHS = [1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257]


def run_chunks(model, ids, splits, capacity=400):
    st = model.new_state(capacity=capacity)
    outs, prev = [], 0
    for s in list(splits) + [len(ids)]:
        if s > prev:
            outs.append(model.forward(ids[prev:s], st))
            prev = s
    assert st.pos == len(ids)
    return torch.cat(outs)


@pytest.fixture(scope="module")
def full_257(tiny):
    ids = random_ids(257, tiny.config.vocab_size, seed=1)
    return ids, run_chunks(tiny, ids, [])


def test_token_by_token_decode_matches_full_prefill(tiny, full_257):
    ids, full = full_257
    decoded = run_chunks(tiny, ids, range(1, len(ids)))
    assert (decoded - full).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers)


@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_prefill_then_decode_matches_full_at_boundary_lengths(tiny, full_257, length):
    ids, full = full_257
    # prefill `length` tokens, then decode 6 more one by one, crossing the next fold/window edges
    n = min(length + 6, len(ids))
    out = run_chunks(tiny, ids[:n], [length] + list(range(length + 1, n)))
    assert (out - full[:n]).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers)


def test_random_chunk_splits_match_full_prefill(tiny, full_257):
    ids, full = full_257
    rng = random.Random(7)
    for _ in range(6):
        splits = sorted(rng.sample(range(1, len(ids)), rng.randint(1, 12)))
        out = run_chunks(tiny, ids, splits)
        assert (out - full).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers), splits


def test_splits_at_every_offset_around_ratio_and_window_edges(tiny, full_257):
    ids, full = full_257
    for split in [2, 3, 4, 5, 6, 7, 8, 9, 30, 31, 32, 33, 34, 62, 63, 64, 65, 66, 127, 128, 129]:
        out = run_chunks(tiny, ids[:140], [split])
        assert (out - full[:140]).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers), split


def test_internal_chunking_of_long_inputs_is_exact(tiny, full_257, monkeypatch):
    ids, full = full_257
    monkeypatch.setattr(type(tiny), "max_chunk", 37)
    out = run_chunks(tiny, ids, [])
    assert (out - full).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers)


def test_fresh_state_after_short_prompt_equals_cold_start(tiny):
    # REF's reused compressor instance leaks a previous request's rows into prompts < 4 tokens
    a = random_ids(2, tiny.config.vocab_size, seed=3)
    b = random_ids(9, tiny.config.vocab_size, seed=4)
    cold = run_chunks(tiny, b, [])
    first = tiny.new_state(capacity=64)
    tiny.forward(random_ids(37, tiny.config.vocab_size, seed=5), first)
    tiny.forward(a, tiny.new_state(capacity=64))
    again = run_chunks(tiny, b, [])
    assert torch.equal(cold, again)


def test_same_chunking_is_bit_identical_across_runs(tiny, full_257):
    ids, _ = full_257
    a = run_chunks(tiny, ids, [5, 100, 101, 200])
    b = run_chunks(tiny, ids, [5, 100, 101, 200])
    assert torch.equal(a, b)


def test_interleaved_sequences_do_not_disturb_each_other(tiny, full_257):
    ids, full = full_257
    other = random_ids(257, tiny.config.vocab_size, seed=9)
    s1, s2 = tiny.new_state(capacity=300), tiny.new_state(capacity=300)
    outs = []
    for c0 in range(0, 257, 20):
        outs.append(tiny.forward(ids[c0:c0 + 20], s1))
        tiny.forward(other[c0:c0 + 13], s2)
    assert (torch.cat(outs) - full).abs().max().item() < fp32_paths_bound(full, tiny.config.num_hidden_layers)

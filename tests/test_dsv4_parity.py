"""Parity with the transformers oracle (DeepseekV4ForCausalLM, fp32, eager) on tiny random
checkpoints that have every layer type, both MoE kinds, YaRN and index_topk < entries, read
through kvfold's own loader from the files transformers writes.

kvfold and transformers are two fp32 evaluations of the same logits, so they agree within
helpers.fp32_paths_bound (16 L eps max|logit|: 2.7e-5 to 4.8e-5 here, L = 5). The oracle seeds
have no near-tied top-k pick (hf_oracle.ORACLE_SEEDS), so no discrete choice can flip between the
two. A wrong row, mask or rope position moves the logits by orders of magnitude more."""
import pytest
import torch

import hf_oracle as O
import kvfold
from helpers import fp32_paths_bound

LENGTHS = (1, 3, 4, 5, 127, 128, 129, 255, 256, 257)


@pytest.fixture(scope="module", params=O.ORACLE_SEEDS)
def pair(request, tmp_path_factory):
    seed = request.param
    hf = O.build_hf_model(seed=seed)
    directory = O.save_hf_checkpoint(hf, tmp_path_factory.mktemp(f"ckpt{seed}"))
    return seed, hf, kvfold.load_model(directory)


@pytest.fixture(scope="module")
def oracle(pair):
    seed, hf, _ = pair
    return {n: O.hf_logits(hf, O.random_input_ids(n, seed)) for n in LENGTHS}


def test_index_topk_is_smaller_than_the_entries_at_long_lengths(pair):
    _, hf, model = pair
    assert model.config.index_topk < 257 // 4


@pytest.mark.parametrize("length", LENGTHS)
def test_full_sequence_logits_match_transformers(pair, oracle, length):
    seed, _, model = pair
    ids = O.random_input_ids(length, seed)
    out = model.forward(ids, model.new_state(capacity=length))
    assert (out - oracle[length]).abs().max().item() < fp32_paths_bound(oracle[length], model.config.num_hidden_layers)


def test_chunked_and_token_by_token_match_transformers(pair, oracle):
    seed, _, model = pair
    ids = O.random_input_ids(257, seed)
    ref = oracle[257]
    st = model.new_state(capacity=257)
    chunks = [model.forward(ids[a:b], st) for a, b in [(0, 3), (3, 5), (5, 128), (128, 129), (129, 200)]]
    chunks += [model.forward(ids[p:p + 1], st) for p in range(200, 257)]
    assert (torch.cat(chunks) - ref).abs().max().item() < fp32_paths_bound(ref, model.config.num_hidden_layers)


def test_all_checkpoint_key_layouts_load_to_the_same_model(pair, tmp_path):
    seed, hf, model = pair
    ids = O.random_input_ids(40, seed)
    want = model.forward(ids, model.new_state(capacity=40))
    for fmt in ("module", "official"):
        other = kvfold.load_model(O.save_hf_checkpoint(hf, tmp_path / fmt, key_format=fmt))
        assert torch.equal(other.forward(ids, other.new_state(capacity=40)), want), fmt


def test_sharded_checkpoint_loads(pair, tmp_path):
    seed, hf, model = pair
    directory = O.save_hf_checkpoint(hf, tmp_path / "sharded", max_shard_size="50KB")
    assert (directory / "model.safetensors.index.json").exists()
    sharded = kvfold.load_model(directory)
    ids = O.random_input_ids(20, seed)
    assert torch.equal(sharded.forward(ids, sharded.new_state(capacity=20)),
                       model.forward(ids, model.new_state(capacity=20)))

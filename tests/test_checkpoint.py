"""Checkpoint loading refuses what does not match its config, listing every problem."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
from kvfold.models.deepseek_v4.checkpoint import save_checkpoint
from kvfold.models.deepseek_v4.names import Target, to_kvfold_name


@pytest.fixture()
def ckpt(tiny, tmp_path):
    return save_checkpoint(tiny, tmp_path / "tiny-random")


def rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_saved_checkpoint_round_trips_with_mtp(tiny, ckpt):
    m = kvfold.load_model(ckpt)
    assert m.mtp is not None
    for (a, x), (b, y) in zip(tiny.state_dict().items(), m.state_dict().items()):
        assert a == b and torch.equal(x, y), a


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(ckpt):
    def edit(t):
        del t["model.layers.1.self_attn.kv_proj.weight"]
        t["model.layers.0.bogus.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(7)
    rewrite(ckpt, edit)
    with pytest.raises(kvfold.CheckpointError) as e:
        kvfold.load_model(ckpt)
    msg = str(e.value)
    assert "layers.1.self_attn.kv_proj.weight" in msg and "bogus" in msg and "model.norm.weight" in msg
    assert "missing 1" in msg and "unexpected 1" in msg and "mis-shaped 1" in msg


def test_missing_expert_slice_is_reported(tiny, tmp_path):
    d = save_checkpoint(tiny, tmp_path / "t")

    def to_official_experts(t):
        gate_up = t.pop("model.layers.2.mlp.experts.gate_up_proj")
        inter = tiny.config.moe_intermediate_size
        for e in range(gate_up.shape[0] - 1):  # expert 7's w1/w3 left out
            t[f"model.layers.2.ffn.experts.{e}.w1.weight"] = gate_up[e, :inter].contiguous()
            t[f"model.layers.2.ffn.experts.{e}.w3.weight"] = gate_up[e, inter:].contiguous()
    rewrite(d, to_official_experts)
    with pytest.raises(kvfold.CheckpointError, match="gate_up_proj"):
        kvfold.load_model(d)


def test_config_without_layer_schedule_is_refused(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["layer_types"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kvfold.ConfigError, match="layer_types"):
        kvfold.load_model(ckpt)


def test_not_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(kvfold.ConfigError, match="directory"):
        kvfold.load_model(tmp_path / "nope")


@pytest.mark.parametrize("key,want", [
    ("embed.weight", Target("model.embed_tokens.weight")),
    ("head.weight", Target("lm_head.weight")),
    ("hc_head_fn", Target("model.hc_head.hc_fn")),
    ("layers.3.attn.kv_norm.weight", Target("model.layers.3.self_attn.kv_norm.weight")),
    ("model.layers.3.attn.norm.weight", Target("model.layers.3.self_attn.kv_norm.weight")),
    ("layers.2.attn.indexer.compressor.ape", Target("model.layers.2.self_attn.compressor.indexer.position_bias")),
    ("layers.2.attn.indexer.weights_proj.weight",
     Target("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight")),
    ("layers.0.ffn.gate.bias", Target("model.layers.0.mlp.gate.e_score_correction_bias")),
    ("layers.0.ffn.experts.5.w3.weight", Target("model.layers.0.mlp.experts.gate_up_proj", 5, "w3")),
    ("model.layers.1.self_attn.q_a_proj.weight", Target("model.layers.1.self_attn.q_a_proj.weight")),
])
def test_official_and_transformers_names_map_to_ours(key, want):
    assert to_kvfold_name(key) == want
    assert to_kvfold_name("mtp.0.e_proj.weight") is None

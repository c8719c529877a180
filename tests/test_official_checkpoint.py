"""Official DeepSeek-V4 checkpoints: FP8 (128x128 e8m0 blocks) and packed FP4 (1x32 e8m0) weights under
the release names, decoded at load time; the same weights in the transformers layouts give bit-identical
logits; `convert` between the layouts; the official config keys; the dtype breakdown."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
from kvfold.models.deepseek_v4.checkpoint import checkpoint_dtype_breakdown, load_weights, save_checkpoint
from kvfold.models.deepseek_v4.names import hf_key_for_official, is_mtp_key, mtp_target, to_kvfold_name, to_official_names
from kvfold.models.deepseek_v4.config import CSA, HCA, SLIDING, config_from_dict, load_config
from kvfold.models.deepseek_v4.convert import convert, official_config_dict
from kvfold.errors import CheckpointError, ConfigError
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.mtp import MtpModule
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from kvfold.numerics.quant import e8m0_to_float, quantize_fp4_blocks, quantize_fp8_blocks

# the release's FP8 weights; routed experts are FP4; everything else bf16 / fp32
FP8_KEY = re.compile(r"(?:^|\.)(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                     r"|e_proj|h_proj)\.weight$")
FP4_KEY = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16_KEY = re.compile(r"(^embed\.weight|^head\.weight|\.wkv\.weight|\.wgate\.weight|weights_proj\.weight"
                      r"|\.gate\.weight)$")
FP4_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E8M0 = torch.float8_e8m0fnu
IDS = [256, 5, 77, 3, 200, 9, 14, 250, 1, 33, 64, 128] * 4  # 48 tokens: CSA (r=4) and HCA (r=32) entries


def tiny_v4(**overrides):
    # hidden 256: full 128x128 blocks; q_lora 192, heads*dim 256, kv 64, o 64x128, moe 80: partial blocks too
    cfg = tiny_config(hidden_size=256, q_lora_rank=192, moe_intermediate_size=80, **overrides)
    model = Dsv4Model(cfg)
    model.mtp = MtpModule(cfg, model.dtype, model.device)
    init_random_(model, 11)
    return model.eval()


def slice_of(t, e, part, inter):
    if e is None:
        return t
    return t[e] if part == "w2" else t[e, :inter] if part == "w1" else t[e, inter:]


def official_tensors(model):
    """The model's weights as the release stores them: quantized by kvfold's quantizers, scales as e8m0."""
    cfg, out = model.config, {}
    for name, t in model.state_dict().items():
        for key, e, part in to_official_names(name, cfg.n_routed_experts):
            v = slice_of(t, e, part, cfg.moe_intermediate_size).contiguous()
            stem = key.removesuffix(".weight")
            if FP8_KEY.search(key):
                out[key], s = quantize_fp8_blocks(v)
                out[stem + ".scale"] = s.view(E8M0)
            elif FP4_KEY.search(key):
                out[key], s = quantize_fp4_blocks(v)
                out[stem + ".scale"] = s.view(E8M0)
            elif BF16_KEY.search(key):
                out[key] = v.to(torch.bfloat16)
            elif key.endswith("tid2eid"):
                out[key] = v.to(torch.int32)
            else:
                out[key] = v.clone()
    return out


def write_official(directory, tensors, cfg, config_path="inference/config.json"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / config_path).parent.mkdir(parents=True, exist_ok=True)
    (directory / config_path).write_text(json.dumps(official_config_dict(cfg)))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def decode(tensors, key):
    """Independent decode of one stored tensor by the spec formulas."""
    w = tensors[key]
    stem = key.removesuffix(".weight")
    if w.dtype == torch.float8_e4m3fn:
        e = tensors[stem + ".scale"].view(torch.uint8).to(torch.int32)
        r, c = w.shape
        s = torch.ldexp(torch.ones(e.shape), e - 127).repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
        return w.float() * s
    if w.dtype == torch.int8:
        b = w.view(torch.uint8).long()
        table = torch.tensor(FP4_TABLE)
        vals = torch.stack([table[b & 15], table[b >> 4]], -1).flatten(-2)  # low nibble = even column
        e = tensors[stem + ".scale"].view(torch.uint8).to(torch.int32)
        return vals * torch.ldexp(torch.ones(e.shape), e - 127).repeat_interleave(32, 1)[:, :vals.shape[1]]
    return w.float()


def logits(model, ids=IDS):
    return model.forward(ids, model.new_state(capacity=len(ids)))


@pytest.fixture(scope="module")
def original():
    return tiny_v4()


@pytest.fixture(scope="module")
def stored(original):
    return official_tensors(original)


@pytest.fixture(scope="module")
def official_dir(original, stored, tmp_path_factory):
    return write_official(tmp_path_factory.mktemp("official"), stored, original.config)


@pytest.fixture(scope="module")
def loaded(official_dir):
    return kvfold.load_model(official_dir)


# ---- loading ------------------------------------------------------------------------------------

def test_the_release_dtypes_are_what_the_spec_lists(stored, original):
    fp8 = {k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn}
    fp4 = {k for k, v in stored.items() if v.dtype == torch.int8}
    assert "layers.1.attn.wq_a.weight" in fp8 and "layers.1.attn.indexer.wq_b.weight" in fp8
    assert "mtp.0.e_proj.weight" in fp8 and "mtp.0.attn.wo_a.weight" in fp8
    assert "layers.1.attn.compressor.wkv.weight" not in fp8 and "layers.1.attn.indexer.compressor.wkv.weight" not in fp8
    n_layers = original.config.num_hidden_layers + 1  # + MTP block
    assert len(fp4) == 3 * original.config.n_routed_experts * n_layers
    # per block wq_a wq_b wkv wo_a wo_b + 3 shared experts; indexer wq_b on the 2 CSA layers; MTP e_proj, h_proj
    assert len(fp8) == 8 * n_layers + 2 + 2
    assert all(stored[k.removesuffix(".weight") + ".scale"].dtype == E8M0 for k in fp8 | fp4)
    assert stored["layers.1.attn.wq_b.weight"].shape == (256, 192)
    assert stored["layers.1.attn.wq_b.scale"].shape == (2, 2)      # one full and one partial column block
    assert stored["layers.1.ffn.experts.3.w2.weight"].shape == (256, 40)
    assert stored["layers.1.ffn.experts.3.w2.scale"].shape == (256, 3)  # 80 = 32 + 32 + 16


def test_quantized_weights_load_as_the_spec_formula(loaded, stored):
    cfg = loaded.config
    state = loaded.state_dict()
    checked = 0
    for name, t in state.items():
        for key, e, part in to_official_names(name, cfg.n_routed_experts):
            got = slice_of(t, e, part, cfg.moe_intermediate_size)
            assert torch.equal(got, decode(stored, key).to(got.dtype)), key
            checked += 1
    assert checked == len([k for k in stored if not k.endswith(".scale")])


def test_dequantized_weights_are_close_to_the_unquantized_ones(loaded, original):
    ref = original.state_dict()
    for name, t in loaded.state_dict().items():
        err = (t.float() - ref[name].float()).abs().max().item()
        amax = ref[name].float().abs().max().item()
        # FP4: a block's values lie in (3s, 6s] at most; the widest gap (4s..6s) only exists when amax >= 4s
        bound = amax / 4 if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name else amax / 16
        assert err <= bound, name


def test_same_weights_in_transformers_layout_give_bit_identical_logits(loaded, official_dir, tmp_path):
    hf = kvfold.load_model(save_checkpoint(loaded, tmp_path / "hf"))
    for (a, x), (b, y) in zip(loaded.state_dict().items(), hf.state_dict().items()):
        assert a == b and torch.equal(x, y), a
    assert torch.equal(logits(loaded), logits(hf))
    # bf16: the decoded values are exact in bf16, so both routes land on the same model again
    off16 = kvfold.load_model(official_dir, dtype=torch.bfloat16)
    hf16 = kvfold.load_model(tmp_path / "hf", dtype=torch.bfloat16)
    assert off16.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert torch.equal(off16.model.layers[1].self_attn.q_b_proj.weight,
                       loaded.model.layers[1].self_attn.q_b_proj.weight.to(torch.bfloat16))
    assert torch.equal(logits(off16), logits(hf16))


def test_quantized_mtp_block_loads(loaded, stored):
    assert loaded.mtp is not None
    assert torch.equal(loaded.mtp.e_proj.weight, decode(stored, "mtp.0.e_proj.weight"))
    w = loaded.mtp.block.mlp.experts.gate_up_proj[5, loaded.config.moe_intermediate_size:]
    assert torch.equal(w, decode(stored, "mtp.0.ffn.experts.5.w3.weight"))


def test_hf_names_with_float_weight_scale_inv_load_the_same_model(loaded, stored, original, tmp_path):
    tensors = {}
    for k, v in stored.items():
        if k.endswith(".scale") and not k.startswith("hc_") and k.removesuffix(".scale") + ".weight" in stored:
            base = k.removesuffix(".scale") + ".weight"
            out = base if base.startswith("mtp.") else hf_key_for_official(base)
            tensors[out + "_scale_inv"] = e8m0_to_float(v)  # HF V3-style float32 multipliers
        else:
            tensors[k if k.startswith("mtp.") else hf_key_for_official(k)] = v
    assert "model.layers.1.attn.wq_a.weight_scale_inv" in tensors and "head.weight" in tensors
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = original.config.to_hf_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [128, 128]}
    cfg["expert_dtype"] = "fp4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    other = kvfold.load_model(tmp_path)
    for (a, x), (b, y) in zip(loaded.state_dict().items(), other.state_dict().items()):
        assert a == b and torch.equal(x, y), a


def test_stacked_quantized_experts_in_module_layout(loaded, tmp_path):
    # transformers' fused layout: gate_up_proj [E, 2I, H/2] packed FP4 + gate_up_proj_scale_inv [E, 2I, H/32]
    d = save_checkpoint(loaded, tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    for name in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t[name], s = quantize_fp4_blocks(t[name])
        t[name + "_scale_inv"] = s.view(E8M0)
    save_file(t, str(d / "model.safetensors"))
    other = kvfold.load_model(d)  # 1x32 blocks are per row: the same bytes as per-expert quantization
    assert torch.equal(other.model.layers[2].mlp.experts.down_proj, loaded.model.layers[2].mlp.experts.down_proj)
    assert torch.equal(logits(other), logits(loaded))


def test_release_extras_are_skipped(stored, original, tmp_path):
    t = dict(stored)
    t["mtp.0.emb.tok_emb.weight"] = stored["embed.weight"].clone()  # copies of the shared embedding / head
    t["mtp.0.head.weight"] = stored["head.weight"].clone()
    m = kvfold.load_model(write_official(tmp_path, t, original.config, "config.json"))
    assert m.mtp is not None


def test_quantized_tensor_without_its_scale_is_refused(stored, original, tmp_path):
    t = dict(stored)
    del t["layers.2.attn.wkv.scale"]
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wkv\.weight.*no block scale"):
        kvfold.load_model(write_official(tmp_path / "fp8", t, original.config))
    t = dict(stored)
    del t["layers.3.ffn.experts.1.w2.scale"]  # packed FP4 bytes must not load as plain int8 numbers
    with pytest.raises(CheckpointError, match=r"experts\.1\.w2\.weight.*no block scale"):
        kvfold.load_model(write_official(tmp_path / "fp4", t, original.config))


def test_a_scale_of_the_wrong_shape_is_reported_with_the_others(stored, original, tmp_path):
    t = dict(stored)
    t["layers.1.attn.wq_b.scale"] = t["layers.1.attn.wq_b.scale"][:1].contiguous()
    t["layers.3.ffn.experts.0.w2.scale"] = t["layers.3.ffn.experts.0.w2.scale"][:, :2].contiguous()
    del t["layers.0.attn.wq_a.weight"], t["layers.0.attn.wq_a.scale"]
    with pytest.raises(CheckpointError) as e:
        kvfold.load_model(write_official(tmp_path, t, original.config))
    msg = str(e.value)
    assert "mis-shaped 2" in msg and "layers.1.attn.wq_b.scale" in msg and "(256, 2)" in msg
    assert "missing 1" in msg and "layers.0.self_attn.q_a_proj.weight" in msg


def test_progress_line_only_when_asked_or_on_a_terminal(official_dir, capsys):
    m = Dsv4Model(load_config(official_dir))
    load_weights(m, official_dir)
    assert capsys.readouterr().err == ""  # pytest's stderr is not a terminal
    load_weights(m, official_dir, progress=True)
    err = capsys.readouterr().err
    assert "\rkvfold: loading weights" in err and "100.0%" in err and err.endswith("\n")


# ---- names and config ---------------------------------------------------------------------------

def test_every_parameter_has_an_official_name_that_maps_back(original):
    for name in original.state_dict():
        for key, e, part in to_official_names(name, original.config.n_routed_experts):
            t = mtp_target(key) if is_mtp_key(key) else to_kvfold_name(key)
            assert (t.name, t.expert, t.part) == (name, e, part), key


def test_official_config_round_trips_and_the_flash_release_config_parses():
    cfg = tiny_config(hidden_size=256, q_lora_rank=192, moe_intermediate_size=80)
    assert config_from_dict(json.loads(json.dumps(official_config_dict(cfg)))) == cfg
    flash = {  # the release's inference/config.json (V4-Flash)
        "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
        "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
        "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
        "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
        "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0",
        "expert_dtype": "fp4", "compress_rope_theta": 160000,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}
    c = config_from_dict(flash)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.qk_rope_head_dim) == (4096, 43, 64, 64)
    assert c.layer_types[:4] == ("sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention") and len(c.layer_types) == 43
    assert c.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert (c.compress_yarn.factor, c.compress_yarn.original_max_position_embeddings) == (16.0, 65536)
    assert (c.sliding_window, c.moe_intermediate_size, c.num_experts_per_tok, c.scoring_func) == \
        (128, 2048, 6, "sqrtsoftplus")
    assert config_from_dict({**flash, "norm_eps": 1e-5, "n_mtp_layers": 1, "original_seq_len": 0}).compress_yarn is None


# ---- convert and inspect ------------------------------------------------------------------------

def test_convert_unquantized_to_official_quantizes_like_the_release(original, stored, tmp_path):
    src = save_checkpoint(original, tmp_path / "hf")
    off = convert(src, tmp_path / "off", "official")
    got = load_file(str(off / "model.safetensors"))
    assert set(got) == set(stored)
    for k, v in stored.items():
        if v.dtype in (torch.float8_e4m3fn, torch.int8, E8M0):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    cfg = json.loads((off / "config.json").read_text())
    assert cfg["dim"] == 256 and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["expert_dtype"] == "fp4" and len(cfg["compress_ratios"]) == original.config.num_hidden_layers + 1


def test_convert_floats_writes_the_release_bf16_matrices_and_keeps_fp32_vectors(original, stored, tmp_path):
    """--floats bfloat16: every unquantized float `*.weight` tensor in bf16, as the release (this
    file's BF16_KEY set, and the norms), the hc parameters, biases and sinks as stored (fp32), the
    quantized bytes unchanged."""
    src = save_checkpoint(original, tmp_path / "hf")
    got = load_file(str(convert(src, tmp_path / "off", "official", floats=torch.bfloat16) / "model.safetensors"))
    for k, v in got.items():
        if stored[k].dtype in (torch.float8_e4m3fn, torch.int8, E8M0):  # quantized, and their scales
            assert v.dtype == stored[k].dtype and torch.equal(v.view(torch.uint8), stored[k].view(torch.uint8)), k
        elif not v.is_floating_point():  # the hash table
            assert torch.equal(v.long(), stored[k].long()), k
        elif k.endswith(".weight"):
            assert v.dtype == torch.bfloat16 and torch.equal(v, stored[k].to(torch.bfloat16)), k
        else:
            assert v.dtype == torch.float32 and torch.equal(v, stored[k]), k
    assert {"embed.weight", "head.weight", "norm.weight"} <= {k for k, v in got.items() if v.dtype == torch.bfloat16}
    assert got["hc_head_fn"].dtype == torch.float32


def test_convert_between_layouts_keeps_quantized_bytes_and_the_model(loaded, official_dir, tmp_path):
    hf = convert(official_dir, tmp_path / "hf", "hf", max_shard_bytes=1 << 20)
    assert (hf / "model.safetensors.index.json").exists() and len(list(hf.glob("*.safetensors"))) > 1
    names = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.attn.wq_a.weight_scale_inv" in names and "model.embed_tokens.weight" in names
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    back = convert(hf, tmp_path / "back", "official")
    a, b = load_file(str(official_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 (float8 has no torch.equal)
    assert set(a) == set(b) and all(torch.equal(raw(a[k]), raw(b[k])) and a[k].dtype == b[k].dtype for k in a)
    plain = convert(official_dir, tmp_path / "plain", "hf", quantize=False, dtype=torch.float32)
    assert set(checkpoint_dtype_breakdown(plain)) <= {"F32", "BF16", "I32"}
    for d in (hf, plain):
        other = kvfold.load_model(d)
        assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), other.state_dict().values())), d
    with pytest.raises(kvfold.ConfigError, match="not empty"):
        convert(official_dir, hf, "official")


def test_dtype_breakdown_counts_tensors_and_bytes(official_dir, stored):
    got = checkpoint_dtype_breakdown(official_dir)
    want = {}
    names = {torch.float8_e4m3fn: "F8_E4M3", E8M0: "F8_E8M0", torch.int8: "I8", torch.float32: "F32",
             torch.bfloat16: "BF16", torch.int32: "I32"}
    for v in stored.values():
        c, b = want.get(names[v.dtype], (0, 0))
        want[names[v.dtype]] = (c + 1, b + v.numel() * v.element_size())
    assert got == want
    assert list(got.values()) == sorted(got.values(), key=lambda cb: -cb[1])


def test_convert_refuses_foreign_tensors_before_writing(stored, original, tmp_path):
    t = dict(stored)
    t["layers.0.attn.mystery.weight"] = torch.zeros(2)
    src = write_official(tmp_path / "src", t, original.config, "config.json")
    with pytest.raises(CheckpointError, match="mystery"):
        convert(src, tmp_path / "dst", "hf")
    assert not (tmp_path / "dst").exists()


# ---- official compress ratios: 0 sliding window, 4 CSA, any other positive ratio HCA --------------

ODD_SCHEDULE = dict(layer_types=(CSA, HCA, SLIDING, CSA), compress_ratios=(4, 16, 0, 4))
LONG_IDS = [256] + [(37 * i + 11) % 256 for i in range(79)]  # 80 tokens: 5 entries of the ratio-16 layer


def official_dict_with(ratios, **extra):
    d = official_config_dict(tiny_config(hidden_size=256, q_lora_rank=192, moe_intermediate_size=80))
    for k in ("layer_types", "compress_rate_csa", "compress_rate_hca"):  # the release's keys only
        d.pop(k, None)
    d.update(compress_ratios=ratios, **extra)
    return d


def test_official_compress_ratio_16_loads_in_both_layouts_with_identical_logits(tmp_path):
    original = tiny_v4(**ODD_SCHEDULE)
    official_dir = write_official(tmp_path / "off", official_tensors(original), original.config)
    raw = json.loads((official_dir / "inference" / "config.json").read_text())
    assert raw["compress_ratios"] == [4, 16, 0, 4, 0] and "layer_types" not in raw  # the release's keys only
    off = kvfold.load_model(official_dir)
    assert off.config == original.config and off.page_tokens == 128
    hf = kvfold.load_model(save_checkpoint(off, tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["compress_rates"] == {CSA: 4, HCA: 16}
    assert hf.config == off.config
    st = off.new_state(capacity=len(LONG_IDS))
    ref = off.forward(LONG_IDS, st)
    entries = st.layers[1].compressor.pool[:]  # the HCA layer: one entry per 16 tokens
    assert entries.shape[0] == 5 and bool((entries.abs().sum(-1) > 0).all())
    assert st.layers[1].indexer is None and st.layers[2].compressor is None and st.layers[3].indexer is not None
    assert torch.equal(ref, hf.forward(LONG_IDS, hf.new_state(capacity=len(LONG_IDS))))
    # paged state: pages of lcm(128, 4, 16) tokens hold the ratio-16 entries as well
    pool = off.new_page_pool(1)
    assert torch.equal(ref, off.forward(LONG_IDS, off.new_state(capacity=len(LONG_IDS), pages=pool)))
    # convert round-trips the schedule: to hf (quantized bytes kept) and back to the official keys
    conv = convert(official_dir, tmp_path / "conv", "hf")
    back = convert(conv, tmp_path / "back", "official")
    assert json.loads((back / "config.json").read_text())["compress_ratios"] == raw["compress_ratios"]
    for d in (conv, back):
        m = kvfold.load_model(d)
        assert m.config == original.config, d
        assert torch.equal(ref, m.forward(LONG_IDS, m.new_state(capacity=len(LONG_IDS)))), d


def test_official_compress_ratios_follow_the_release_code():
    c = config_from_dict(official_dict_with([4, 16, 0, 4, 0]))
    assert c.layer_types == (CSA, HCA, SLIDING, CSA) and c.compress_ratios == (4, 16, 0, 4)
    # several HCA ratios in one model: per layer in the official layout, inexpressible in the transformers one
    c = config_from_dict(official_dict_with([4, 48, 128, 0]))
    assert c.layer_types == (CSA, HCA, HCA, SLIDING) and c.compress_ratios == (4, 48, 128, 0)
    assert config_from_dict(official_config_dict(c)) == c
    with pytest.raises(ConfigError, match="one compress rate per layer type"):
        c.to_hf_dict()
    m = Dsv4Model(c)
    assert m.page_tokens == 384  # lcm(128, 4, 48, 128)
    st = m.new_state(capacity=2 * m.page_tokens)  # pools grow by state_bytes_per_token per token
    pools = sum(x.pool.nbytes for ls in st.layers for x in (ls.compressor, ls.indexer) if x is not None)
    assert pools == m.state_bytes_per_token() * 2 * m.page_tokens
    assert st.layers[1].compressor.pool.shape[0] == 16 and st.layers[1].indexer is None
    # a CSA ratio other than 4 keeps its explicit layer types when written in the official keys
    c = config_from_dict(official_dict_with([8, 16, 0, 8], compress_rate_csa=8))
    assert c.layer_types == (CSA, HCA, SLIDING, CSA) and c.compress_ratios == (8, 16, 0, 8)
    d = official_config_dict(c)
    assert d["layer_types"] == list(c.layer_types) and config_from_dict(d) == c


def test_several_hca_ratios_run_from_the_official_layout_and_are_not_written_as_transformers(tmp_path):
    original = tiny_v4(layer_types=(CSA, HCA, HCA, SLIDING), compress_ratios=(4, 16, 48, 0))
    official_dir = write_official(tmp_path / "off", official_tensors(original), original.config)
    off = kvfold.load_model(official_dir)
    assert off.config.compress_ratios == (4, 16, 48, 0) and off.page_tokens == 384
    ids = LONG_IDS + LONG_IDS[1:20]  # 99 tokens: 6 entries at ratio 16, 2 at ratio 48 (rows ceil(99 / r))
    st = off.new_state(capacity=len(ids))
    ref = off.forward(ids, st)
    assert [st.layers[i].compressor.pool.shape[0] for i in (1, 2)] == [7, 3]
    assert torch.equal(ref, off.forward(ids, off.new_state(capacity=len(ids), pages=off.new_page_pool(1))))
    for write in (lambda: save_checkpoint(off, tmp_path / "hf"), lambda: convert(official_dir, tmp_path / "hf", "hf")):
        with pytest.raises(ConfigError, match="one compress rate per layer type"):
            write()
        assert not (tmp_path / "hf").exists()
    m = kvfold.load_model(convert(official_dir, tmp_path / "again", "official"))
    assert m.config == original.config and torch.equal(ref, m.forward(ids, m.new_state(capacity=len(ids))))


@pytest.mark.parametrize("ratios", [[4, -16, 0, 4], [4, 16.5, 0, 4], [4, "16", 0, 4], [4, True, 0, 4],
                                    [4, 16, 0, None], [4, 16, 0, 4, -1], [4, 16, 0], "4,16,0,4"])
def test_negative_or_odd_official_compress_ratios_are_refused(ratios):
    with pytest.raises(ConfigError, match="compress_ratios"):
        config_from_dict(official_dict_with(ratios))


def test_non_integer_compress_rates_are_refused():
    base = tiny_config().to_hf_dict()
    for bad in ({"compress_rates": {CSA: 4, HCA: 0}}, {"compress_rates": {CSA: 4.0, HCA: 16}},
                {"compress_rate_hca": -128}, {"compress_rate_csa": "4"}):
        with pytest.raises(ConfigError, match="compress rate"):
            config_from_dict({**base, **bad})

"""GLM-5.3 block-FP8 checkpoints: float8_e4m3fn weights with an fp32 `weight_scale_inv` per block of
config.json's `quantization_config.weight_block_size`, W[i, j] = q[i, j] * scale_inv[i // br, j // bc]
(the release's format, docs/checkpoints.md). The FP8 checkpoints here are written by this file's own
quantizer (per-block amax / 448 scales) for the tensors the release stores in FP8.

weights="dequant" and weights="quantized" must give bit-identical logits; both must equal a float
checkpoint of the decoded values; quantized residency keeps the FP8 bytes as stored."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
from helpers import fp32_paths_bound
from kvfold.errors import CheckpointError, ConfigError
from kvfold.models.glm5 import checkpoint as glm5_checkpoint
from test_glm5_next import INDEXERS, LAYERS, TEXT, VISION, _randomize, pair, seq  # noqa: F401  (the tiny model)

E4M3_MAX = 448.0
INTER = TEXT["moe_intermediate_size"]  # 16
MLA_LAYERS = [i for i, t in enumerate(LAYERS) if t == "indexed_attention"]
SPARSE_LAYERS = [i for i, t in enumerate(TEXT["mlp_layer_types"]) if t == "sparse"]
# The release's FP8 tensors: MLA projections (KDA layers' stay BF16), the indexer's wq_b and wk, shared
# and routed experts. Embeddings, lm_head, norms, router, weights_proj, k_norm, conv taps stay float.
MLA_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")
EXPERT_FP8 = re.compile(r"\.mlp\.(shared_experts|experts\.\d+)\.(gate|up|down)_proj\.weight$")
# (8, 8) and (12, 8) split every matrix (12: cropped edge blocks, and expert halves of 16 rows that do not
# fill whole row blocks); (128, 128) is the release's size: one cropped block per matrix here.
BLOCKS = [(8, 8), (12, 8), (128, 128)]


def release_fp8(key: str) -> bool:
    if EXPERT_FP8.search(key):
        return True
    layer = int(key.split(".")[3]) if key.startswith("model.language_model.layers.") else None
    return layer in MLA_LAYERS and any(key.endswith(f".self_attn.{a}.weight") for a in MLA_FP8)


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, scale_inv fp32 [ceil(R/br), ceil(C/bc)]): per block scale_inv = amax / 448 and
    q = e4m3(w / scale_inv), block by block."""
    br, bc = block
    r, c = w.shape
    scale = torch.empty(-(-r // br), -(-c // bc), dtype=torch.float32)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)
            part = w[rows, cols].float()
            scale[i, j] = part.abs().max() / E4M3_MAX
            q[rows, cols] = (part / scale[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """q * scale_inv of its block, in fp32 (torch's float8_e4m3fn conversion, one rounded product)."""
    br, bc = block
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * full


def quantization_config(block) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def write_checkpoint(src, dst, tensors: dict, qconfig: dict | None):
    """dst: src's config.json (with `qconfig` as its quantization_config, if any) and `tensors`."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def fp8_tensors(src, block) -> dict:
    out = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        if release_fp8(k):
            out[k], out[k + "_scale_inv"] = quantize_blocks(v, block)
        else:
            out[k] = v
    return out


def decoded(tensors: dict, block) -> dict:
    """The float checkpoint of the same values: each FP8 weight replaced by q * scale_inv, no scales."""
    return {k: dequantize_blocks(v, tensors[k + "_scale_inv"], block) if k + "_scale_inv" in tensors else v
            for k, v in tensors.items() if not k.endswith("_scale_inv")}


@pytest.fixture(scope="module")
def source(pair):
    return pair[2]  # test_glm5_next's transformers checkpoint (float32, with vision tensors)


@pytest.fixture(scope="module", params=BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def fp8(request, source, tmp_path_factory):
    block = request.param
    root = tmp_path_factory.mktemp(f"glm5_fp8_{block[0]}x{block[1]}")
    tensors = fp8_tensors(source, block)
    d = write_checkpoint(source, root / "fp8", tensors, quantization_config(block))
    flat = write_checkpoint(source, root / "float", decoded(tensors, block), None)
    return dict(block=block, tensors=tensors, dir=d, float_dir=flat,
                deq=kvfold.load_model(d), q=kvfold.load_model(d, weights="quantized"))


def expected_fp8_slots() -> set[str]:
    """kvfold's names of the weights a quantized load keeps in FP8: every FP8 tensor."""
    want = set()
    for i in MLA_LAYERS:
        want |= {f"model.layers.{i}.self_attn.{a}.weight" for a in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                   "kv_b_proj", "o_proj")}
        if INDEXERS[i] == "full":
            want |= {f"model.layers.{i}.self_attn.indexer.{a}.weight" for a in ("wq_b", "wk")}
    for i in SPARSE_LAYERS:
        want |= {f"model.layers.{i}.mlp.experts.{a}" for a in ("gate_up_proj", "down_proj")}
        want |= {f"model.layers.{i}.mlp.shared_experts.{a}_proj.weight" for a in ("gate", "up", "down")}
    return want


def logits_of(model, ids, decode_steps: int = 6) -> torch.Tensor:
    """A full prefill of ids[:-decode_steps], then the rest one token at a time: [len(ids), vocab]."""
    st = model.new_state(capacity=len(ids))
    n = len(ids) - decode_steps
    outs = [model.forward(ids[:n], st)] + [model.forward(ids[p:p + 1], st) for p in range(n, len(ids))]
    return torch.cat(outs)


def test_quantized_residency_keeps_the_fp8_weights_as_stored_in_fewer_bytes(fp8):
    deq, q, block, tensors = fp8["deq"], fp8["q"], fp8["block"], fp8["tensors"]
    held = q.quantized_weights()
    assert set(held) == expected_fp8_slots() and not deq.quantized_weights()
    for name, w in held.items():
        assert w.q.dtype == torch.float8_e4m3fn and w.scale.dtype == torch.float32, name
        # routed experts: each expert's gate, up and down tensors held apart, with their stored scale blocks
        assert w.block == block and w.pieces == (2 if name.endswith("gate_up_proj") else
                                                 1 if name.endswith("experts.down_proj") else 0), name
    # every other tensor stays float: router, lm_head, KDA projections
    for name in ("model.layers.1.mlp.gate.weight", "lm_head.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.indexer.weights_proj.weight"):
        assert isinstance(q.get_parameter(name), torch.nn.Parameter), name
    # the stored bytes, as stored: a projection, and one routed expert's gate and up halves
    src = "model.language_model.layers.4"
    assert torch.equal(held["model.layers.4.self_attn.o_proj.weight"].q.view(torch.uint8),
                       tensors[f"{src}.self_attn.o_proj.weight"].view(torch.uint8))
    (gate, _), (up, _) = held["model.layers.4.mlp.experts.gate_up_proj"].matrix_pieces(3)
    assert torch.equal(gate.view(torch.uint8), tensors[f"{src}.mlp.experts.3.gate_proj.weight"].view(torch.uint8))
    assert torch.equal(up.view(torch.uint8), tensors[f"{src}.mlp.experts.3.up_proj.weight"].view(torch.uint8))
    # decoded per matmul to exactly what the load-time decode wrote
    params = dict(deq.named_parameters())
    for name, w in held.items():
        assert w.dtype == torch.float32 and torch.equal(w.dequant(), params[name]), name
    saved = sum(w.numel() * 4 - w.nbytes for w in held.values())
    assert saved > 0 and deq.weight_bytes() - q.weight_bytes() == saved
    assert q.num_parameters() == deq.num_parameters()


def test_dequant_and_quantized_logits_are_bit_identical(fp8, seq):
    deq, q, ids = fp8["deq"], fp8["q"], seq[:46]
    assert torch.equal(logits_of(q, ids), logits_of(deq, ids))
    # one model to its states: a snapshot taken under one residency continues bit-identically under the other
    assert q.fingerprint == deq.fingerprint
    st = deq.new_state(capacity=46)
    deq.forward(ids[:30], st)
    blob = st.snapshot()
    want = deq.forward(ids[30:], st)
    other = q.new_state(capacity=46)
    other.restore(blob)
    assert torch.equal(q.forward(ids[30:], other), want)
    # bf16: native.c reads the stored FP8 for up to NATIVE_ROWS rows with fp32 accumulation, where the
    # dequantized bf16 weights go through torch's bf16 GEMM: the same values, another rounding order
    deq16 = kvfold.load_model(fp8["dir"], dtype=torch.bfloat16)
    q16 = kvfold.load_model(fp8["dir"], dtype=torch.bfloat16, weights="quantized")
    want16 = logits_of(deq16, ids).float()
    bound = fp32_paths_bound(want16, deq16.config.num_hidden_layers, torch.bfloat16)
    assert q16.quantized_weights() and (logits_of(q16, ids).float() - want16).abs().max() <= bound


def test_fp8_checkpoint_computes_the_float_model_of_its_decoded_values(fp8, seq):
    """The FP8 checkpoint's fp32 model is the float checkpoint holding this file's q * scale_inv.
    kvfold decodes each weight as one fp32 product q * scale_inv, as `dequantize_blocks` does, so
    the weights agree bit for bit, and the logits of the same fp32 paths over them are not merely
    within rounding (tests/helpers.py fp32_paths_bound) but equal."""
    flat = kvfold.load_model(fp8["float_dir"])
    deq = fp8["deq"]
    want = dict(flat.named_parameters())
    for name, p in deq.named_parameters():
        assert torch.equal(p, want[name]), name
    ids = seq[:46]
    assert torch.equal(logits_of(deq, ids), logits_of(flat, ids))


def test_stored_codes_decode_as_torch_float8_e4m3fn_does(source, tmp_path):
    """Every e4m3 byte, NaN codes 0x7F / 0xFF and negative zero 0x80 included, decodes to torch's
    float8_e4m3fn value times its block's scale, under both residencies."""
    block = (8, 8)
    tensors = fp8_tensors(source, block)
    key = "model.language_model.layers.1.self_attn.q_a_proj.weight"  # [24, 32]: codes fill rows 0-7
    codes = tensors[key].view(torch.uint8).clone()
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    tensors[key] = codes.view(torch.float8_e4m3fn)
    d = write_checkpoint(source, tmp_path / "codes", tensors, quantization_config(block))
    want = dequantize_blocks(tensors[key], tensors[key + "_scale_inv"], block)
    assert want[3, 31].isnan() and want[7, 31].isnan() and want[4, 0] == 0 and want[4, 0].signbit()
    deq = kvfold.load_model(d).get_parameter("model.layers.1.self_attn.q_a_proj.weight")
    held = kvfold.load_model(d, weights="quantized").get_submodule("model.layers.1.self_attn.q_a_proj.weight")
    assert torch.equal(held.q.view(torch.uint8), codes)
    for got in (deq.detach(), held.dequant()):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan], want[~nan]) and torch.equal(got.signbit()[~nan], want.signbit()[~nan])


def _refused(monkeypatch, d, err, *fragments):
    """Both residencies refuse d with `err` naming every fragment, before the model is built."""
    def no_model(*a, **kw):
        raise AssertionError("the model was built before the checkpoint was refused")
    with monkeypatch.context() as m:
        m.setattr(glm5_checkpoint, "Glm5Model", no_model)
        for weights in ("dequant", "quantized"):
            with pytest.raises(err) as e:
                kvfold.load_model(d, weights=weights)
            assert all(f in str(e.value) for f in fragments), str(e.value)


def test_missing_misshaped_or_misblocked_scales_are_refused_naming_the_tensor(source, tmp_path, monkeypatch):
    block = (8, 8)
    good = fp8_tensors(source, block)
    attn = "model.language_model.layers.1.self_attn"
    up = "model.language_model.layers.4.mlp.experts.2.up_proj.weight"

    def variant(name, edit, qconfig=quantization_config(block)):
        t = dict(good)
        edit(t)
        return write_checkpoint(source, tmp_path / name, t, qconfig)

    d = variant("missing", lambda t: t.pop(f"{attn}.q_b_proj.weight_scale_inv"))
    _refused(monkeypatch, d, CheckpointError, f"{attn}.q_b_proj.weight is stored F8_E4M3 but has no block scale")
    d = variant("misshaped", lambda t: t.update({up + "_scale_inv": torch.ones(3, 4)}))  # [16, 32] needs [2, 4]
    _refused(monkeypatch, d, CheckpointError, f"{up}_scale_inv has shape [3, 4]", "needs [2, 4]")
    d = variant("int_scale", lambda t: t.update({up + "_scale_inv": torch.ones(2, 4, dtype=torch.int32)}))
    _refused(monkeypatch, d, CheckpointError, f"{up}_scale_inv is stored I32")
    d = variant("orphan", lambda t: t.pop(f"{attn}.o_proj.weight"))
    _refused(monkeypatch, d, CheckpointError, f"{attn}.o_proj.weight_scale_inv is a block scale, but its weight")
    # the config's block size is not the one the scales were made with: every FP8 tensor is refused
    n_fp8 = sum(k.endswith("_scale_inv") for k in good)
    first = "model.language_model.layers.1.mlp.experts.0.down_proj.weight"  # [32, 16], the first by name
    d = variant("block16", lambda t: None, quantization_config((16, 16)))
    _refused(monkeypatch, d, CheckpointError, f"{n_fp8} FP8 weights cannot be decoded",
             f"{first}_scale_inv has shape [4, 2], but {first} [32, 16] in weight_block_size [16, 16] blocks "
             f"needs [2, 1]")
    d = variant("no_qconfig", lambda t: None, None)
    _refused(monkeypatch, d, CheckpointError, f"{n_fp8} FP8 weights cannot be decoded",
             f"{first} has a block scale", "declares no quantization_config.weight_block_size")
    for name, bad, says in (("gptq", {"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
                            ("static", dict(quantization_config(block), activation_scheme="static"), "static"),
                            ("per_tensor", {"quant_method": "fp8", "fmt": "e4m3"}, "without weight_block_size"),
                            ("bad_block", quantization_config((8, 0)), "two positive ints")):
        _refused(monkeypatch, variant(name, lambda t: None, bad), ConfigError, says)


def test_bf16_floats_are_held_as_stored_and_compute_the_fp32_models_bits(source, tmp_path, seq):
    """A release stores its unquantized matrices in bf16: weights="quantized" holds them as bf16 (half
    the bytes, exact in an fp32 model), and the logits equal the dequantized load's bit for bit."""
    block = (128, 128)
    tensors = {k: (v.to(torch.bfloat16) if v.dim() == 2 and v.dtype == torch.float32
                   and not k.endswith("_scale_inv") else v)
               for k, v in fp8_tensors(source, block).items()}
    d = write_checkpoint(source, tmp_path / "bf16", tensors, quantization_config(block))
    deq, q = kvfold.load_model(d), kvfold.load_model(d, weights="quantized")
    held = q.quantized_weights()
    bf16 = {n for n, w in held.items() if w.fmt == "bf16"}
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= bf16
    assert set(held) - bf16 == expected_fp8_slots()
    assert q.weight_bytes() < deq.weight_bytes()
    ids = seq[:30]
    assert torch.equal(logits_of(q, ids), logits_of(deq, ids))


def test_a_quantized_load_builds_on_meta_and_allocates_no_float_placeholder(fp8, monkeypatch):
    """As DeepSeek-V4's loader: weights="quantized" builds on the meta device (GLM-5.3-Flash's fp32
    expert placeholders would be 29 GB per layer) and the loaded model lives on the CPU."""
    from kvfold.models.glm5.model import Glm5Model
    built, real = [], Glm5Model.__init__

    def spy(self, cfg, dtype=torch.float32, device="cpu", tp=None):
        built.append(torch.device(device))
        real(self, cfg, dtype, device, tp)
    monkeypatch.setattr(Glm5Model, "__init__", spy)
    q = kvfold.load_model(fp8["dir"], weights="quantized")
    assert built == [torch.device("meta")]
    assert all(t.device.type == "cpu" for t in [*q.parameters(), *q.buffers()])
    assert q.device == torch.device("cpu") and q.batch_invariant
    assert q.mtp is None or q.mtp.device == torch.device("cpu")
    assert kvfold.load_model(fp8["dir"]).device == torch.device("cpu")

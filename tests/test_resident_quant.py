"""weights="quantized": FP8 / FP4 checkpoint weights stay in memory as stored. native.c reads them as stored
for decode and verify rows (and for every row in batch-invariant mode); longer prefill chunks decode one
weight per matmul (routed experts: only the ones a batch uses). The decoded values are the ones a load-time
decode writes, so where the arithmetic is the same (batch-invariant fp32, the default, and bf16 prefill)
logits, generations and snapshots are bit-identical to weights="dequant", in a fraction of the bytes."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
import kvfold.layers.moe
from kvfold.models.deepseek_v4.checkpoint import save_checkpoint
from kvfold.models.deepseek_v4.names import to_official_names
from kvfold.errors import CheckpointError, ConfigError
from kvfold.layers.basic import NATIVE_ROWS, QuantizedWeight
from kvfold.models.deepseek_v4.moe import NATIVE_MOE_ROWS
from kvfold.layers.moe import Experts
from kvfold.numerics.quant import dequant_fp4_into, dequant_fp8_into, quantize_fp8_blocks, unpack_fp4
from helpers import fp32_paths_bound
from test_official_checkpoint import BF16_KEY, E8M0, FP8_KEY, IDS, logits, official_tensors, slice_of, tiny_v4, write_official


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_decoding_by_table_lookup_equals_conversion_for_every_byte(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    unit = torch.full((1, 1), 127, dtype=torch.uint8)  # e8m0 2^0
    got = dequant_fp8_into(torch.empty(2, 128, dtype=dtype), codes.view(torch.float8_e4m3fn).view(2, 128), unit)
    want = codes.view(torch.float8_e4m3fn).to(dtype).view(2, 128)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])
    got = dequant_fp4_into(torch.empty(256, 2, dtype=dtype), codes.view(256, 1), unit.expand(256, 1), 32)
    assert torch.equal(got, unpack_fp4(codes.view(256, 1)).to(dtype)) and not got.signbit()[got == 0].any()


@pytest.fixture(scope="module")
def original():
    return tiny_v4()  # moe_intermediate_size 80: partial FP4 scale blocks; hidden 256, q_lora 192


@pytest.fixture(scope="module")
def official_dir(original, tmp_path_factory):
    return write_official(tmp_path_factory.mktemp("official"), official_tensors(original), original.config)


@pytest.fixture(scope="module")
def both(official_dir):
    """{dtype: (dequant model, quantized model)}"""
    return {dt: (kvfold.load_model(official_dir, dtype=dt),
                 kvfold.load_model(official_dir, dtype=dt, weights="quantized"))
            for dt in (torch.float32, torch.bfloat16)}


def test_fp8_and_fp4_weights_stay_as_stored(both):
    deq, q = both[torch.float32]
    held = q.quantized_weights()
    assert not deq.quantized_weights()
    fp8 = {n for n, w in held.items() if w.fmt == "fp8"}
    fp4 = {n for n, w in held.items() if w.fmt == "fp4"}
    n_blocks = q.config.num_hidden_layers + 1  # + MTP block
    assert len(fp4) == 2 * n_blocks  # gate_up_proj and down_proj of every block
    assert len(fp8) == 8 * n_blocks + 2 + 2  # wq_a wq_b wkv wo_a wo_b + 3 shared; 2 indexer wq_b; MTP e/h_proj
    wq_b = q.model.layers[1].self_attn.q_b_proj.weight
    assert isinstance(wq_b, QuantizedWeight) and wq_b.q.dtype == torch.float8_e4m3fn
    assert wq_b.scale.shape == (2, 2) and wq_b.scale.dtype == torch.uint8 and wq_b.block == (128, 128)
    experts = q.model.layers[2].mlp.experts
    gu, down = experts.gate_up_proj, experts.down_proj  # each expert's w1, w3 and w2 held apart, as stored
    assert gu.pieces == 2 and down.pieces == 1 and gu.shape == (8, 160, 256)
    (w1, s1), (w3, _) = gu.matrix_pieces(5)
    assert w1.dtype == torch.uint8 and w1.shape == w3.shape == (80, 128) and s1.shape == (80, 8)
    assert down.matrix_pieces(7)[0][1].shape == (256, 3)  # 80 columns: blocks of 32, 32, 16
    # the release's bf16 matrices (embed, head, compressor and indexer projections) are held in
    # bf16 too, except the router's (not a matmul weight: it stays an fp32 parameter); norms stay fp32
    bf16 = {n for n, w in held.items() if w.fmt == "bf16"}
    stored_bf16 = {n for n, _ in deq.named_parameters()
                   if any(BF16_KEY.search(k) and not FP8_KEY.search(k)
                          for k, _, _ in to_official_names(n, q.config.n_routed_experts))}
    assert bf16 == {n for n in stored_bf16 if not n.endswith("mlp.gate.weight")}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= bf16 and q.lm_head.weight.q.dtype == torch.bfloat16
    assert isinstance(q.model.layers[1].mlp.gate.weight, torch.nn.Parameter)
    assert not both[torch.bfloat16][1].quantized_weights().keys() & bf16  # a bf16 model keeps its parameters
    assert set(held) == fp8 | fp4 | bf16
    # every held weight decodes to exactly the dequant model's parameter
    params = dict(deq.named_parameters())
    for name, w in held.items():
        assert w.dtype == params[name].dtype and torch.equal(w.dequant(), params[name]), name
    assert q.num_parameters() == deq.num_parameters()
    ids = torch.tensor([0, 257, 5, 5, 130])  # the embedding decodes only the rows it looks up
    assert torch.equal(q.model.embed_tokens(ids), deq.model.embed_tokens(ids))
    assert torch.equal(q.model.embed_tokens(ids.view(1, 5)), deq.model.embed_tokens(ids.view(1, 5)))


def test_row_lookups_decode_exactly_the_rows_of_every_format(both):
    """`QuantizedWeight.rows` (an embedding lookup) gives `dequant()[ids]` in each format, block
    rows included (FP8's 128-row scale blocks), and `dequant(dtype)` decodes into the dtype asked."""
    from kvfold.numerics.quant import quantize_fp4_blocks
    _, q = both[torch.float32]
    ids = torch.tensor([0, 191, 128, 127, 5, 5])
    fp4 = QuantizedWeight("fp4", (200, 64), torch.float32, (1, 32))
    fp4.load_(*quantize_fp4_blocks(torch.randn(200, 64, generator=torch.Generator().manual_seed(1))), (1, 32))
    for w in (q.model.layers[1].self_attn.q_b_proj.weight, fp4, q.lm_head.weight):
        assert torch.equal(w.rows(ids), w.dequant()[ids]), w.fmt
        assert w.dequant(torch.bfloat16).dtype == torch.bfloat16
        assert torch.equal(w.dequant(torch.bfloat16), w.dequant().to(torch.bfloat16))


def test_fp32_logits_are_bit_identical(both):
    # batch-invariant fp32 (the default): every matmul is native.c's dot over the same values
    deq, q = both[torch.float32]
    assert deq.batch_invariant and torch.equal(logits(q), logits(deq))
    assert q.fingerprint == deq.fingerprint
    # outside it, the dequantized weights take torch's GEMM, the stored ones native.c for decode rows
    deq.set_batch_invariant(False)
    q.set_batch_invariant(False)
    try:
        st_d, st_q = deq.new_state(capacity=len(IDS)), q.new_state(capacity=len(IDS))
        deq.forward(IDS[:-1], st_d)
        q.forward(IDS[:-1], st_q)
        want = deq.forward(IDS[-1:], st_d)
        got = q.forward(IDS[-1:], st_q)
    finally:
        deq.set_batch_invariant(True)
        q.set_batch_invariant(True)
    assert (got - want).abs().max() <= fp32_paths_bound(want, deq.config.num_hidden_layers)


def test_bf16_logits_are_within_bf16_rounding(both):
    # bf16: native.c reads the stored weights for decode rows with fp32 accumulation, where the
    # dequantized bf16 weights take torch's bf16 GEMM: the same values, another rounding order
    deq, q = both[torch.bfloat16]
    want = logits(deq).float()
    bound = fp32_paths_bound(want, deq.config.num_hidden_layers, torch.bfloat16)
    assert (logits(q).float() - want).abs().max() <= bound
    assert q.fingerprint == deq.fingerprint


def test_resident_bytes_are_a_quarter_for_fp8_and_under_a_seventh_for_fp4(both):
    for dtype, (deq, q) in both.items():
        esz = torch.finfo(dtype).bits // 8
        held = q.quantized_weights().values()
        for fmt, low in (("fp8", 3.99 * esz / 4), ("fp4", 7.4 * esz / 4)):
            ws = [w for w in held if w.fmt == fmt]
            float_bytes = sum(w.numel() * esz for w in ws)
            resident = sum(t.nbytes for w in ws for t in w.buffers())
            ratio = float_bytes / resident
            # fp32: FP8 4 / (1 + 1/16384 per full block); FP4 4 / (1/2 + 1/32), a little less with partial blocks
            assert low < ratio <= (4 if fmt == "fp8" else 32 / 4.25) * esz / 4, (dtype, fmt, ratio)
        saved = sum(w.numel() * esz - w.nbytes for w in held)
        assert deq.weight_bytes() - q.weight_bytes() == saved
    deq, q = both[torch.float32]
    assert deq.weight_bytes() / q.weight_bytes() > 3  # norms, router and hc parameters stay fp32


def test_experts_read_only_the_experts_a_batch_uses(both, monkeypatch):
    # outside batch-invariant mode an expert with more than NATIVE_ROWS rows is decoded for its matmul,
    # one with fewer is read as stored; either way only the experts a batch routes to are touched
    # (chunks past NATIVE_MOE_ROWS rows: fewer run as one native call, test_decode_and_verify_...)
    _, q = both[torch.float32]
    routed, read, decoded = {}, [], []
    real_mm, real_dequant = kvfold.layers.moe.weight_mm, QuantizedWeight.dequant

    def spy_mm(ops, x, w, index=None):
        read.append((w, index))
        return real_mm(ops, x, w, index)

    def spy_dequant(self, dtype=None, index=None):
        decoded.append((self, index))
        return real_dequant(self, dtype, index)

    def record(module, args):  # Experts.forward(x, weights, ids, ops)
        routed.setdefault(module, []).append(set(args[2].flatten().tolist()))

    hooks = [m.register_forward_pre_hook(record) for m in q.modules() if isinstance(m, Experts)]
    monkeypatch.setattr(kvfold.layers.moe, "weight_mm", spy_mm)
    monkeypatch.setattr(QuantizedWeight, "dequant", spy_dequant)
    q.set_batch_invariant(False)
    try:
        # a prompt (some experts past NATIVE_ROWS rows), then a short chunk of one repeated token
        for chunk in ((IDS * 3)[:4 * NATIVE_ROWS], IDS[:1] * (NATIVE_MOE_ROWS + 1)):
            q.forward(chunk, q.new_state(capacity=4 * NATIVE_ROWS))
    finally:
        q.set_batch_invariant(True)
        for h in hooks:
            h.remove()
    assert routed and all(len(calls) == 2 for calls in routed.values())
    for m in (m for m in q.modules() if isinstance(m, Experts)):
        for w in (m.gate_up_proj, m.down_proj):
            got = [i for holder, i in read if holder is w]
            # once per used expert per forward, never the whole stack
            assert sorted(got) == sorted(e for step in routed.get(m, []) for e in step), m
    stacks = {id(w) for m in q.modules() if isinstance(m, Experts) for w in (m.gate_up_proj, m.down_proj)}
    expert_decodes = [i for holder, i in decoded if id(holder) in stacks]
    assert expert_decodes and None not in expert_decodes  # the long prompt decoded some experts, one at a time
    assert all(len(calls[1]) < q.config.n_routed_experts for calls in routed.values())  # the short chunk's


@pytest.mark.parametrize("invariant", [True, False])
def test_decode_and_verify_read_every_quantized_weight_as_stored(both, monkeypatch, invariant):
    # up to NATIVE_ROWS rows (and any rows in batch-invariant mode) native.c reads FP8 / FP4 as stored:
    # no weight is ever decoded into memory
    _, q = both[torch.float32]
    decoded = []
    real = QuantizedWeight.dequant
    monkeypatch.setattr(QuantizedWeight, "dequant", lambda self, *a, **k: decoded.append(self) or real(self, *a, **k))
    q.set_batch_invariant(invariant)
    try:
        st = q.new_state(capacity=64)
        q.forward(IDS[:40] if invariant else IDS[:NATIVE_ROWS], st)  # a prompt, then decode and a verify call
        q.forward(IDS[40:41], st)
        q.forward(IDS[41:45], st)
    finally:
        q.set_batch_invariant(True)
    assert decoded == []


def test_fused_attention_halves_read_quantized_weights_with_the_per_op_bits(both):
    """The fused attention halves on FP8 weights read as stored equal the per-op path (each
    projection native.c's format-reading matmul) bit for bit, and the dequantized model's."""
    from test_batching import attention_halves
    deq, q = both[torch.float32]
    with torch.inference_mode():
        for n_rows in (1, 6):
            for (fused, per_op), (fused_deq, _) in zip(attention_halves(q, n_rows), attention_halves(deq, n_rows)):
                assert torch.equal(fused, per_op) and torch.equal(fused, fused_deq)


def test_generation_and_snapshots_are_unaffected(both):
    deq, q = both[torch.float32]
    prompt = IDS[:20]
    a = kvfold.generate(deq, prompt, 12, stop_ids=[])
    b = kvfold.generate(q, prompt, 12, stop_ids=[])
    assert a.tokens == b.tokens
    # the MTP drafter's e_proj / h_proj / block are held quantized too: same drafts, same acceptances
    ma = kvfold.generate(deq, prompt, 12, stop_ids=[], speculative="mtp")
    mb = kvfold.generate(q, prompt, 12, stop_ids=[], speculative="mtp")
    assert (ma.tokens, ma.drafted, ma.accepted) == (mb.tokens, mb.drafted, mb.accepted)
    # a snapshot taken on one residency continues bit-identically on the other
    st = deq.new_state(capacity=64)
    deq.forward(IDS[:30], st)
    blob = st.snapshot()
    want = deq.forward(IDS[30:40], st)
    other = q.new_state(capacity=64)
    other.restore(blob)
    assert torch.equal(q.forward(IDS[30:40], other), want)


def test_fp8_experts_whose_halves_split_row_blocks(original, tmp_path):
    # FP8 experts (not the release's FP4): w1 / w3 of 80 rows each, so gate_up_proj's 160 rows cannot share
    # 128-row blocks; each row keeps its block's scale instead. Stacked FP8 in the module layout keeps 128x128.
    t = official_tensors(original)
    deq = kvfold.load_model(write_official(tmp_path / "fp4", t, original.config))
    cfg = original.config
    for name, v in deq.state_dict().items():
        for key, e, part in to_official_names(name, cfg.n_routed_experts):
            if e is not None:  # re-quantize the decoded FP4 expert as FP8
                t[key], s = quantize_fp8_blocks(slice_of(v, e, part, cfg.moe_intermediate_size).contiguous())
                t[key.removesuffix(".weight") + ".scale"] = s.view(E8M0)
    d = write_official(tmp_path / "fp8", t, original.config)
    a = kvfold.load_model(d)
    b = kvfold.load_model(d, weights="quantized")
    gu = b.model.layers[1].mlp.experts.gate_up_proj
    # each half is a piece of its own, with the scale blocks the file stores for it
    assert gu.fmt == "fp8" and gu.pieces == 2 and gu.block == (128, 128)
    assert [s.shape for _, s in gu.matrix_pieces(0)] == [(1, 2), (1, 2)]
    assert b.model.layers[1].mlp.experts.down_proj.block == (128, 128)
    assert torch.equal(gu.dequant(), a.model.layers[1].mlp.experts.gate_up_proj)
    assert torch.equal(logits(b), logits(a))
    # joined into one stack (a placement's copy), the blocks that would straddle w1 and w3 become a scale a row
    joined = gu.take(torch.tensor([6, 2]))
    assert joined.pieces == 0 and joined.block == (1, 128) and joined.scale.shape == (2, 160, 2)
    assert torch.equal(joined.dequant(), a.model.layers[1].mlp.experts.gate_up_proj[[6, 2]])
    # module layout, stacked: gate_up_proj [E, 160, 256] FP8 with [E, 2, 2] scales: kept with 128x128 blocks
    hf = save_checkpoint(a, tmp_path / "hf")
    ht = load_file(str(hf / "model.safetensors"))
    for name in [k for k in ht if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        ht[name], s = quantize_fp8_blocks(ht[name])
        ht[name + "_scale_inv"] = s.view(E8M0)
    save_file(ht, str(hf / "model.safetensors"))
    c, cq = kvfold.load_model(hf), kvfold.load_model(hf, weights="quantized")
    assert cq.model.layers[2].mlp.experts.gate_up_proj.block == (128, 128)
    assert torch.equal(logits(cq), logits(c))


def test_float_checkpoints_stay_float_and_quantized_models_are_not_saved(both, original, tmp_path):
    plain = save_checkpoint(original, tmp_path / "plain")  # unquantized: nothing to keep quantized
    m = kvfold.load_model(plain, weights="quantized")
    assert not m.quantized_weights() and m.weight_bytes() == original.weight_bytes()
    assert not kvfold.load_model("tiny-random", weights="quantized").quantized_weights()
    deq, q = both[torch.float32]
    save_checkpoint(deq, tmp_path / "deq")  # dequant models save as before
    with pytest.raises(CheckpointError, match="weights='dequant'"):
        save_checkpoint(q, tmp_path / "q")
    with pytest.raises(ConfigError, match="weights must be one of"):
        kvfold.load_model(plain, weights="fp16")


def test_serve_weights_quantized_holds_the_checkpoint_formats(official_dir, both):
    import argparse
    from kvfold.server import add_serve_parser, build_app
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    for flag, want in (([], set()), (["--weights", "quantized"], set(both[torch.float32][1].quantized_weights()))):
        args = parser.parse_args(["serve", "--model", str(official_dir), "--max-seq-len", "256", *flag])
        served = build_app(args).state.engine.engine.model
        assert set(served.quantized_weights()) == want
    assert want  # the quantized load holds FP8 / FP4 / bf16 matrices
    assert torch.equal(logits(served, IDS), logits(both[torch.float32][0], IDS))


def test_a_quantized_load_builds_on_meta_and_allocates_no_float_placeholder(official_dir, monkeypatch):
    """weights="quantized" builds the model on the meta device and allocates only what it keeps
    as floats (V4-Flash's fp32 placeholders alone would be 1.1 TB); the loaded model lives on
    the CPU, rope tables and MTP block included, in the CPU's default mode."""
    from kvfold.models.deepseek_v4.model import Dsv4Model
    built, real = [], Dsv4Model.__init__

    def spy(self, cfg, dtype=torch.float32, device="cpu", tp=None):
        built.append(torch.device(device))
        real(self, cfg, dtype, device, tp)
    monkeypatch.setattr(Dsv4Model, "__init__", spy)
    q = kvfold.load_model(official_dir, weights="quantized")
    assert built == [torch.device("meta")]
    assert all(t.device.type == "cpu" for t in [*q.parameters(), *q.buffers()])
    assert q.device == torch.device("cpu") and q.rope_main.inv_freq.device.type == "cpu"
    assert q.mtp is not None and q.mtp.device == torch.device("cpu")
    assert q.batch_invariant  # an fp32 CPU model's default, decided for the CPU, not for meta
    dq = kvfold.load_model(official_dir)
    assert q.weight_bytes() < dq.weight_bytes()

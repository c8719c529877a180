"""The sparse-expert fp32 models of bench/fidelity_real_shapes.py (kvfold/bench/fidelity.py, issue 42
item 5), checked on small configs in the real-shape checkpoints' formats: DeepSeek-V4's tiny-bench
(FP8 blocks, FP4 experts, bf16 embedding and head) and GLM-5.3's small schedule (block FP8), both
with 32 routed experts, so that a 6-row run (4 prompt tokens, 2 decode steps) leaves most of them
unrouted and unwritten.

The quantized model, the same model made fp32 with only its routed experts written (the others
zero pages nobody reads), and the model the loader dequantizes whole give the same logits bit for
bit; transformers on the sparse model's own tensors routes every row alike and agrees within the
suite's fp32 paths bound. The controls: a routed expert zeroed moves the logits far past rounding,
and NaNs in every unrouted expert move nothing (nobody reads them; the kernel's page accounting
says the same)."""
import dataclasses
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

import kvfold
from helpers import fp32_paths_bound
from kvfold.bench import fidelity as F
from kvfold.bench import real_shapes as R
from kvfold.bench.configs import build_config
from kvfold.bench.real_shapes_glm import glm_write
from kvfold.models.deepseek_v4.convert import write_official
from kvfold.models.glm5.config import glm5_config_from_dict

PROMPT, DECODE, EXPERTS = 4, 2, 32


def _v4(directory):
    cfg = dataclasses.replace(build_config("tiny-bench"), n_routed_experts=EXPERTS)
    return write_official(directory, cfg, R.random_tensors(cfg, seed=3), max_shard_bytes=1 << 20)


def _glm(directory):
    # tests/test_bench_real_shapes.py's small GLM-5.3 schedule (3 KDA layers, one DSA + MoE layer)
    cfg = glm5_config_from_dict(dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=EXPERTS, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16,
        index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=5,
        pad_token_id=None))
    return glm_write(directory, cfg, seed=5, max_shard_bytes=1 << 20)


@pytest.fixture(scope="module", params=["v4", "glm"])
def run(request, tmp_path_factory):
    """Both kvfold runs and the transformers run of one family, and what each routed and read."""
    d = (_v4 if request.param == "v4" else _glm)(tmp_path_factory.mktemp(request.param))
    model = kvfold.load_model(d, weights="quantized")
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    routed = F.RoutedExperts(model)
    quantized, tokens = F.run_prompt(model, prompt, DECODE)
    routed.close()
    written = routed.experts()
    model = kvfold.load_model(d, weights="quantized")  # as the script does: converted before it runs
    held = [weakref.ref(w) for w in model.quantized_weights().values()]
    F.dequantize_(model, F.expert_rows(written))
    gc.collect()
    freed = not model.quantized_weights() and all(r() is None for r in held)
    again = F.RoutedExperts(model)
    sparse, _ = F.run_prompt(model, prompt, DECODE, feed=tokens)
    again.close()
    kv_pages = F.expert_pages(model)
    full = kvfold.load_model(d)  # every expert dequantized by the loader
    whole, _ = F.run_prompt(full, prompt, DECODE, feed=tokens)
    hf = F.hf_model(model)
    weights, head = F.hf_weights(model)
    F.load_hf_weights(hf, weights)
    hf_routed = F.HfRouted(hf)
    hf_out = F.hf_logits(hf, tokens, head)
    hf_routed.close()
    return SimpleNamespace(model=model, freed=freed, prompt=prompt, tokens=tokens, quantized=quantized, sparse=sparse,
                           whole=whole, written=written, rows=routed.rows(), rows_again=again.rows(),
                           kv_pages=kv_pages, hf=hf, head=head, hf_out=hf_out, hf_ids=hf_routed.ids,
                           hf_pages=F.expert_pages(hf))


def _expert_bytes(model, written):
    ex = [m.experts for m in F.moe_layers(model).values()]
    per = ex[0].gate_up_proj[0].nbytes + ex[0].down_proj[0].nbytes
    return per * sum(len(v) for v in written.values())


def test_the_sparse_fp32_model_equals_the_quantized_and_the_whole_fp32_model_bit_for_bit(run):
    assert run.quantized.shape == (PROMPT + DECODE, run.model.config.vocab_size)
    assert torch.equal(run.sparse, run.whole) and torch.equal(run.sparse, run.quantized)
    assert run.freed  # every weight held as stored was replaced, and nothing keeps it alive
    assert all(p.dtype == torch.float32 for n, p in run.model.named_parameters() if "tid2eid" not in n)
    # the fp32 run routed every row as the quantized run did, and most experts were never written
    assert run.rows_again.keys() == run.rows.keys() and all(torch.equal(run.rows_again[k], v)
                                                            for k, v in run.rows.items())
    assert all(0 < len(ids) <= EXPERTS // 2 for ids in run.written.values())
    # only the routed experts' pages were written, and no other page of the stacks was read
    assert run.kv_pages == {"written": _expert_bytes(run.model, run.written), "read_unwritten": 0}


def test_transformers_on_the_same_tensors_routes_alike_and_agrees_within_the_paths_bound(run):
    assert run.hf.config._experts_implementation == "eager" and run.hf.config._attn_implementation == "eager"
    report = F.routing_report(run.rows, run.hf_ids, run.written)
    assert report and all(r["same"] and not r["unwritten"] for r in report.values()), report
    # two fp32 evaluations of the same logits: the bound of tests/test_dsv4_parity.py and test_glm5_next.py
    bound = fp32_paths_bound(run.hf_out, run.model.config.num_hidden_layers)
    assert (run.hf_out - run.sparse).abs().max().item() < bound
    assert run.hf_pages == {"written": _expert_bytes(run.model, run.written), "read_unwritten": 0}


def _stacks(model, layer):
    ex = F.moe_layers(model)[layer].experts
    return ex.gate_up_proj, ex.down_proj


def test_a_zeroed_routed_expert_is_detected(run):
    """The negative control: the fp32 model missing one expert a row routes to (as a model would
    whose routing differed from the quantized run's) is off by far more than rounding."""
    layer = sorted(run.written)[-1]
    e = run.written[layer][0]
    stacks = _stacks(run.model, layer)
    saved = [s[e].clone() for s in stacks]
    try:
        for s in stacks:
            s[e].zero_()
        got, _ = F.run_prompt(run.model, run.prompt, DECODE, feed=run.tokens)
        hf = F.hf_logits(run.hf, run.tokens, run.head)  # the same tensors
    finally:
        for s, v in zip(stacks, saved):
            s[e].copy_(v)
    bound = fp32_paths_bound(run.hf_out, run.model.config.num_hidden_layers)
    assert (got - run.sparse).abs().max().item() > 100 * bound
    assert (hf - run.hf_out).abs().max().item() > 100 * bound


def test_nans_in_every_unrouted_expert_change_nothing(run):
    """Nothing reads an expert no row routes to: NaN there, and both models' logits stay the same bits."""
    touched = []
    try:
        for layer, ids in run.written.items():
            for s in _stacks(run.model, layer):
                free = [i for i in range(s.shape[0]) if i not in ids]
                s[free] = float("nan")
                touched.append((s, free))
        got, _ = F.run_prompt(run.model, run.prompt, DECODE, feed=run.tokens)
        hf = F.hf_logits(run.hf, run.tokens, run.head)
    finally:
        for s, free in touched:
            s[free] = 0.0
    assert torch.equal(got, run.sparse) and torch.equal(hf, run.hf_out)


def test_sparse_zeros_cost_nothing_until_written():
    t = F.sparse_zeros((64, 1024, 1024))  # 256 MiB of address space
    assert F.mapping_pages(t) == (0, 0)
    t[3].fill_(1.0)
    assert F.mapping_pages(t) == (4 << 20, 4 << 20)  # one slice written: its pages, private copies
    assert t[5].abs().max().item() == 0.0 and t[3].min().item() == 1.0  # a hole reads as zeros
    rss, anon = F.mapping_pages(t)
    assert anon == 4 << 20 and rss == anon + (4 << 20)  # the read is seen: resident but not written

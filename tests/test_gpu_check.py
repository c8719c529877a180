"""bench/gpu_check.py, the one prepared run for a GPU machine, kept working on the CPU: with the
CPU as the "device" every cross-device comparison compares a computation with itself, so each must
come out exact, and every speed cell and the transformers cell must run."""
import importlib.util
import json
from pathlib import Path

import torch

from helpers import fp32_paths_bound

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_runs_on_the_cpu_and_finds_every_same_device_comparison_exact(tmp_path):
    out = tmp_path / "report.json"
    assert _script().main(["--device", "cpu", "--out", str(out), "--config", "tiny-bench", "--contexts", "48",
                           "--batches", "1,2", "--steps", "2", "--flash-layers", "0", "--no-triton"]) == 0
    report = json.loads(out.read_text())
    assert set(report["families"]) == {"deepseek_v4-float32", "deepseek_v4-bfloat16", "glm5_next-float32",
                                       "glm5_next-bfloat16"}
    for name, got in report["families"].items():
        assert "error" not in got, (name, got.get("traceback"))
        assert got["prefill_max_diff_vs_cpu"] == 0 and got["decode_max_diff_vs_cpu"] == 0, name
        assert got["greedy_tokens_equal_cpu"] and got["cpu_snapshot_on_device_max_diff"] == 0, name
        assert got["device_snapshot_on_cpu_max_diff"] == 0, name
        assert got["device_snapshot_on_cpu_tokens_equal"] and got["cpu_snapshot_on_device_tokens_equal"], name
        assert got["other_device_state_refused"] == "same device"
        if name.endswith("float32"):  # batch-invariant mode runs fp32 on the CPU: exact by construction
            assert got["batched_equals_alone_invariant"], name
    for name, got in report["graphs"].items():  # eager on the CPU: "replay" and eager are one computation
        assert "error" not in got, (name, got.get("traceback"))
        assert got["replay_equals_eager"] and got["arenas_equal"] and not got["captured"], name
        dtype = getattr(torch, name.split("-")[1])
        # two fp32 evaluations of the same logits (helpers.fp32_paths_bound); GLM-5.3's two KDA
        # layers add their readouts' gains (helpers.KdaReadoutGains), at most max|S| ||q||_1 /
        # sqrt(rms_norm_eps) each, where ||q||_1 <= 1 (q is L2-normalised, then scaled by dk^-0.5)
        blocks = 4 if name.startswith("deepseek") else 5 + 2 * got["kda_state_absmax"] / 1e-5 ** 0.5
        assert name.startswith("deepseek") or got["kda_state_absmax"] > 0
        assert got["vs_forward_max_diff"] <= fp32_paths_bound(torch.tensor(got["logit_scale"]), blocks, dtype), \
            (name, got)
        assert got["graph_captures"] == 2 and got["graph_recaptures"] == 0, got  # buckets 4, then 5 (of 1, 2, 4, 5)
    for cell in ("split_tiny", "split_flash"):  # a CPU run without --virtual has no second side to split to
        assert "--virtual" in report[cell]["skipped"], report[cell]
    for label in ("tiny-bench-fp32", "tiny-bench-bf16"):
        speed = report["speed"][label]
        assert [(c["batch"], c["context"]) for c in speed["cells"]] == [(1, 48), (2, 48)], speed
        assert all(c["tok_s"] > 0 and c["bytes_per_step"] > 0 and c["graph_tok_s"] > 0 for c in speed["cells"])
        hf = speed["transformers"]
        assert "error" not in hf and hf["weights_not_loaded"] == 0 and hf["unexpected_weights"] == 0, hf


def test_the_v4_flash_shaped_stack_builds_routes_and_decodes(tmp_path):
    # the release's config.json, shrunk: the same keys and layer kinds, random weights drawn in place
    gc = _script()
    model = gc.flash_stack(3, torch.bfloat16, torch.device("cpu"), vocab_size=512, dim=64, moe_inter_dim=32,
                           n_routed_experts=8, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32,
                           o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=32, index_topk=8)
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe") and cfg.num_experts_per_tok == 6
    tid2eid = dict(model.named_buffers())["model.layers.0.mlp.gate.tid2eid"]
    assert all(len(set(row.tolist())) == 6 for row in tid2eid)  # distinct experts a token
    with torch.inference_mode():
        cell = gc.decode_cell(model, batch=2, context=40, steps=2)
    assert cell["tok_s"] > 0
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    # two tokens route to at most 12 of 8 experts: all of them are read
    assert gc.bytes_per_step(model, 2, 0) - gc.bytes_per_step(model, 1, 0) == expert_bytes - expert_bytes * 6 // 8


# V4-Flash's keys with small values: the release's layer kinds and routing at test sizes
FLASH_SHRINK = dict(vocab_size=512, dim=64, moe_inter_dim=32, n_routed_experts=8, n_heads=4, head_dim=64,
                    rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=4,
                    index_head_dim=32, index_topk=8)


def test_the_split_cells_run_on_virtual_devices_and_give_the_cpus_bits(tmp_path):
    from test_bench_peers import _fake_llama_cpp
    llama, gguf = _fake_llama_cpp(tmp_path), tmp_path / "flash.gguf"
    gguf.write_bytes(b"GGUF")  # the fake llama-bench never reads it
    out = tmp_path / "report.json"
    assert _script().main(["--device", "cpu", "--virtual", "--out", str(out), "--no-families", "--no-triton",
                           "--no-graphs", "--no-speed", "--split-dtypes", "float32", "--steps", "2",
                           "--split-context", "40", "--flash-shrink", json.dumps(FLASH_SHRINK),
                           "--llama-cpp", str(llama), "--gguf", str(gguf), "--llama-n-cpu-moe", "99,1"]) == 0
    report = json.loads(out.read_text())
    assert set(report["split_tiny"]) == {"deepseek_v4-float32", "glm5_next-float32"}
    for name, got in report["split_tiny"].items():
        assert "error" not in got, (name, got.get("traceback"))
        assert got["virtual"] and got["virtual_ops_checked"] > 0, name
        assert got["logits_equal_cpu"] and got["greedy_tokens_equal_cpu"], (name, got)
        assert got["prefill_max_diff_vs_cpu"] == 0 and got["decode_max_diff_vs_cpu"] == 0, (name, got)
        hits, routed = got["expert_hits"]
        assert 0 < hits < routed, (name, got)  # half of each card layer's experts: some rows cross, some stay
    flash = report["split_flash"]
    assert "error" not in flash, flash.get("traceback")
    assert flash["virtual"] and flash["layers"] == 3 and flash["n_experts"] == 8
    for label, card_only in (("host_experts", False), ("partial_pack", True)):
        got = flash[label]
        assert "error" not in got, (label, got.get("traceback"))
        assert got["placement"] == f"--gpu-layers 2 --gpu-experts {4 if card_only else 0}", got
        assert got["logits_equal_cpu"] and got["greedy_tokens_equal_cpu"], (label, got)
        assert got["prefill_max_diff_vs_cpu"] == 0 and got["decode_max_diff_vs_cpu"] == 0, (label, got)
        hits, routed = got["expert_hits"]
        assert routed > 0 and (0 < hits < routed if card_only else hits == 0), (label, got)
        assert got["decode"]["tok_s"] > 0 and got["decode"]["context"] == 40, got["decode"]
    cells = flash["llama_cpp"]
    assert [c["n_cpu_moe"] for c in cells] == [99, 1], cells
    for n, cell in zip((99, 1), cells):
        assert cell["decode_status"] == "ok" and cell["decode_tok_s"] > 0, cell
        assert any(f"-ngl 99 --n-cpu-moe {n}" in c and "-d 40" in c for c in cell["commands"]), cell


def test_the_llama_cpp_comparison_says_why_it_did_not_run(tmp_path):
    import argparse
    from test_bench_peers import _fake_llama_cpp
    gc = _script()
    args = argparse.Namespace(split_context=40, steps=2, llama_n_cpu_moe=[99], llama_cpp=None, gguf=None)
    bench = _fake_llama_cpp(tmp_path)
    far = float("inf")
    for llama_cpp, gguf, why in ((str(tmp_path / "none"), None, "not a directory"),
                                 (str(bench), None, "no GGUF at hand"),
                                 (str(bench), str(tmp_path / "x.gguf"), "x.gguf: no such file")):
        args.llama_cpp, args.gguf = llama_cpp, gguf
        [cell] = gc.llama_cpp_cells(args, far)
        assert cell["not_run"] and why in cell["decode_status"], (why, cell)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    [cell] = gc.llama_cpp_cells(args, 0.0)  # a spent --time-budget starts no llama-bench
    assert cell["not_run"] and "--time-budget spent" in cell["decode_status"] and "commands" not in cell, cell

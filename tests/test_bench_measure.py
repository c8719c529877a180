"""`kvfold bench` machine measurements (issue 42 item 3): decode bytes per token term by term
(hand-computed for tiny-bench, the release layout of v4-flash), the copy and streaming-read
bandwidth record and its report lines, page-cache eviction, and load time against read time."""
from __future__ import annotations

import os

import pytest
import torch

from kvfold.bench import configs as C
from kvfold.bench import decode_bytes as D
from kvfold.bench import measure as M
from kvfold.bench import report
from kvfold.bench import report_measure as RM
from kvfold.bench import runner as R
from kvfold.bench.real_shapes import real_config

_MIB = 1 << 20


def _meta_tensors(cfg) -> dict:
    """{name: (shape, bytes)} of the fp32 model in the transformers layout, as checkpoint_tensor_sizes gives."""
    from kvfold.models.deepseek_v4.model import Dsv4Model
    sd = Dsv4Model(cfg, dtype=torch.float32, device="meta").state_dict(keep_vars=True)
    return {k: (tuple(v.shape), v.numel() * v.element_size()) for k, v in sd.items()}


# ---- decode bytes per token ---------------------------------------------------------------------------
# tiny-bench (configs.py): vocab 512, hidden 64, 2 heads of 32, q_lora 32, o_lora 16 x 2 groups, window 8,
# layers sliding / CSA(4) / HCA(16) / CSA(4), 4 experts (top 2) of 32, index 2 heads of 16, top 4, hc_mult 4
# sinks, q_a, q_norm, q_b, kv, kv_norm, o_a, o_b
ATTN_BASE = 2 + 32 * 64 + 32 + 64 * 32 + 32 * 64 + 32 + 32 * 32 + 64 * 32
CSA_EXTRA = (4 * 64 + 2 * 64 * 64 + 32) + (4 * 32 + 2 * 32 * 64 + 16 + 32 * 32 + 2 * 64)  # compressor + indexer
HCA_EXTRA = 16 * 32 + 2 * 32 * 64 + 32  # ape [16, 32], kv and gate [32, 64], norm
HC_PER_LAYER = 2 * (24 * 256 + 24 + 3) + 2 * 64  # attn / ffn hyper-connections, two norms
TINY_FP32 = {
    "lm_head": 512 * 64 * 4,
    "embedding_row": 64 * 4,
    "attention_sliding": ATTN_BASE * 4,
    "attention_csa": 2 * (ATTN_BASE + CSA_EXTRA) * 4,
    "attention_hca": (ATTN_BASE + HCA_EXTRA) * 4,
    "routed_experts_active": 2 * (64 * 64 + 64 * 32) * 4 * 4,  # top-2 x one expert (gate_up + down) x 4 layers
    "shared_expert": 4 * 3 * 32 * 64 * 4,
    "dense_mlp": 0,
    "router": 4 * 4 * 64 * 4 + 2 * 8 + 3 * 4 * 4,  # 4 gates fp32, one int64 tid2eid row, 3 score biases
    "norms_hc": (4 * HC_PER_LAYER + 64 + 4 * 256 + 4 + 1) * 4,
    "other": 0,
}


def test_tiny_bench_terms_match_hand_computed_sizes():
    cfg = C.build_config("tiny-bench")
    terms = D.decode_terms(cfg, _meta_tensors(cfg), 40)
    by = {t.key: t.bytes for t in terms}
    for key, want in TINY_FP32.items():
        assert by[key] == want, key
    # context 40: window min(40, 8) rows per layer; CSA top-min(4, 10) entries and 10 index keys; HCA 40 // 16
    assert by["state_window"] == 4 * 8 * 32 * 4
    assert by["state_compressed"] == 2 * 4 * 32 * 4 + 2 * 32 * 4
    assert by["state_index_keys"] == 2 * 10 * 16 * 4
    tot = C.decode_bytes_per_token(cfg, _meta_tensors(cfg), 40)
    assert tot["weights_total"] == sum(TINY_FP32.values())
    assert tot["total"] == sum(t.bytes for t in terms) == tot["weights_total"] + tot["state"]
    assert tot["attention"] == by["attention_sliding"] + by["attention_csa"] + by["attention_hca"]
    short = D.decode_terms(cfg, _meta_tensors(cfg), 2, state_elem_bytes=2)  # bf16 state, no entry complete yet
    assert [t.bytes for t in short if t.group == "state"] == [4 * 2 * 32 * 2, 0, 0]
    formulas = {t.key: t.formula for t in terms}
    assert formulas["routed_experts_active"] == "2 (top-k) x 24,576 B/expert x 4 MoE layers"
    assert formulas["state_window"] == "4 layers x min(40, 8) x 32 x 4 B"


def test_official_layout_counts_scales_and_reads_the_router_in_fp32(tmp_path):
    ckpt = C.ensure_official_checkpoint(C.ensure_checkpoint("tiny-bench", tmp_path, 0))
    tensors = C.checkpoint_tensor_sizes(ckpt)
    cfg = C.build_config("tiny-bench")
    by = {t.key: t.bytes for t in D.decode_terms(cfg, tensors, 40)}
    # FP4 expert: w1 and w3 [32, 64] -> 32 x 32 bytes + 32 x 2 e8m0 scales, w2 [64, 32] -> 64 x 16 + 64 x 1
    assert by["routed_experts_active"] == 2 * (2 * (32 * 32 + 32 * 2) + 64 * 16 + 64) * 4
    assert by["lm_head"] == 512 * 64 * 2 and by["embedding_row"] == 64 * 2  # bf16
    assert by["router"] == TINY_FP32["router"]  # stored bf16, held and read in fp32
    assert by["other"] == 0 and 0 < by["attention_csa"] < TINY_FP32["attention_csa"]
    # every stored byte is counted once, but the embedding (one row), the experts (top-k of E), the
    # tid2eid tables (one row) and the routers (bf16 stored, read as fp32)
    total = sum(n for _, n in tensors.values())
    experts = sum(n for k, (_, n) in tensors.items() if ".ffn.experts." in k)
    tid = sum(n for k, (_, n) in tensors.items() if k.endswith("tid2eid"))
    gates = sum(n for k, (_, n) in tensors.items() if k.endswith(".ffn.gate.weight"))
    embed = tensors["embed.weight"][1]
    want = total - embed + embed / 512 - experts * (1 - 2 / 4) - tid + tid / 512 + (4 * 4 * 64 * 4 - gates)
    assert sum(v for k, v in by.items() if not k.startswith("state_")) == pytest.approx(want, abs=1e-6)


def _v4_flash_release_tensors(cfg) -> dict:
    """A few tensors of each kind with V4-Flash's stored shapes and bytes (release layout, 4 layers)."""
    t = {"embed.weight": ((129280, 4096), 129280 * 4096 * 2), "head.weight": ((129280, 4096), 129280 * 4096 * 2),
         "norm.weight": ((4096,), 8192), "hc_head_fn": ((4, 16384), 4 * 16384 * 4)}
    for i in range(4):
        p = f"layers.{i}."
        t[p + "attn.wq_a.weight"], t[p + "attn.wq_a.scale"] = ((1024, 4096), 1024 * 4096), ((8, 32), 256)
        t[p + "attn.attn_sink"] = ((64,), 256)
        t[p + "attn_norm.weight"], t[p + "hc_attn_fn"] = ((4096,), 8192), ((24, 16384), 24 * 16384 * 4)
        for e in range(256):
            for w, shape in (("w1", (2048, 2048)), ("w3", (2048, 2048)), ("w2", (4096, 1024))):
                t[f"{p}ffn.experts.{e}.{w}.weight"] = (shape, 4194304)
                t[f"{p}ffn.experts.{e}.{w}.scale"] = ((shape[0], shape[1] * 2 // 32), 262144)
        t[p + "ffn.shared_experts.w1.weight"] = ((2048, 4096), 8388608)
        t[p + "ffn.shared_experts.w1.scale"] = ((16, 32), 512)
        t[p + "ffn.gate.weight"] = ((256, 4096), 256 * 4096 * 2)
        if i < 3:
            t[p + "ffn.gate.tid2eid"] = ((129280, 6), 129280 * 6 * 8)
        else:
            t[p + "ffn.gate.bias"] = ((256,), 1024)
    t["layers.2.attn.indexer.wq_b.weight"] = ((8192, 1024), 8192 * 1024)
    t["layers.2.attn.compressor.wkv.weight"] = ((1024, 4096), 1024 * 4096 * 2)
    t["layers.3.attn.compressor.wkv.weight"] = ((512, 4096), 512 * 4096 * 2)
    t["mtp.0.attn.wq_a.weight"] = ((1024, 4096), 1024 * 4096)  # not read by a plain decode step
    return t


def test_v4_flash_release_layout_terms():
    cfg = real_config("v4-flash")
    terms = D.decode_terms(cfg, _v4_flash_release_tensors(cfg), 4096)
    by = {t.key: t.bytes for t in terms}
    attn = 1024 * 4096 + 256 + 256  # wq_a FP8 + its scale + sink
    assert by["lm_head"] == 129280 * 4096 * 2 and by["embedding_row"] == 4096 * 2
    assert by["attention_sliding"] == 2 * attn  # layers 0 and 1
    assert by["attention_csa"] == attn + 8192 * 1024 + 1024 * 4096 * 2  # + indexer wq_b, compressor wkv
    assert by["attention_hca"] == attn + 512 * 4096 * 2
    assert by["routed_experts_active"] == 6 * (3 * 4194304 + 3 * 262144) * 4  # 6 of 256 x 13,369,344 B x 4
    assert by["shared_expert"] == 4 * (8388608 + 512)
    assert by["router"] == 4 * 256 * 4096 * 4 + 3 * 6 * 8 + 1024
    assert by["norms_hc"] == 8192 + 4 * 16384 * 4 + 4 * (8192 + 24 * 16384 * 4)  # hc_attn_fn is not "other"
    assert by["other"] == 0
    n_csa, topk = 1, cfg.index_topk  # the CSA layer: top-k of 4096 // 4 entries, every index key scored
    assert by["state_compressed"] == n_csa * min(topk, 1024) * 512 * 4 + (4096 // 128) * 512 * 4
    assert by["state_index_keys"] == 1024 * cfg.index_head_dim * 4


def test_families_plug_in_and_a_missing_one_is_reported():
    class QwenConfig:  # a family with no formula
        pass
    assert D.family_of_config(C.build_config("bench")) == "deepseek_v4" and "deepseek_v4" in D.FAMILIES
    assert "glm5_next" in D.FAMILIES
    with pytest.raises(ValueError, match="QwenConfig"):
        D.decode_terms(QwenConfig(), {}, 16)
    per, info = D.per_context(QwenConfig(), {}, [16])
    assert per == {} and "QwenConfig" in info["missing"]
    assert RM.decode_bytes_lines({"decode_bytes": info})[0].startswith("decode bytes per token: no formula")


def test_decode_bytes_report_prints_every_term_and_its_formula():
    cfg = C.build_config("tiny-bench")
    per, info = D.per_context(cfg, _meta_tensors(cfg), [16, 40])
    text = "\n".join(RM.decode_bytes_lines({"decode_bytes": info}))
    for ctx in ("16", "40"):
        for t in info["terms"][ctx]:
            if t["key"] != "other":
                assert t["formula"] in text and t["label"] in text
        assert f"{per[ctx]['total'] / 1e6:10.3f} MB = weights {per[ctx]['weights_total'] / 1e6:.3f} MB" in text
    assert f"{sum(TINY_FP32.values()) / 1e6:10.3f} MB = the sum of the above" in text
    assert "formula: total = lm_head + embedding_row + attention_sliding" in text


# ---- bandwidth -------------------------------------------------------------------------------------------
def test_read_buffer_is_sized_from_the_l3(tmp_path):
    for cpu, shared in ((0, "0-1"), (1, "0-1"), (2, "2-3")):
        d = tmp_path / f"cpu{cpu}" / "cache" / "index3"
        d.mkdir(parents=True)
        (d / "level").write_text("3\n")
        (d / "size").write_text("32768K\n")
        (d / "shared_cpu_list").write_text(shared + "\n")
        l1 = tmp_path / f"cpu{cpu}" / "cache" / "index0"
        l1.mkdir()
        (l1 / "level").write_text("1\n")
        (l1 / "size").write_text("32K\n")
        (l1 / "shared_cpu_list").write_text(f"{cpu}\n")
    assert M.l3_cache_bytes(str(tmp_path)) == 2 * 32 * _MIB  # two L3 instances, each counted once
    assert M.read_buffer_bytes(64 * _MIB) == 1 << 30  # 8x is below the 1 GiB floor
    assert M.read_buffer_bytes(200 * _MIB) == 1600 * _MIB
    assert M.read_buffer_bytes(None) == 1 << 30
    assert M.read_buffer_bytes(1 << 30, available=16 << 30) == 4 << 30  # 8 GiB wanted, a quarter of 16 GiB
    assert M.read_buffer_bytes(1 << 30, available=2 << 30) == 1 << 30  # never below 1 GiB


def test_bandwidth_record_has_copy_and_read():
    bw = M.measure_bandwidth(copy_mib=8, read_mib=8, repeats=2, threads=1)
    read, copy = bw["read"], bw["copy"]
    assert set(read["methods"]) == {"amax", "dot", "sum"} and read["buffer_mib"] == 8
    assert read["bytes_per_s"] == max(m["bytes_per_s"] for m in read["methods"].values()) > 0
    assert read["bytes_per_s"] == read["methods"][read["method"]]["bytes_per_s"]
    assert bw["read_bytes_per_s"] == read["bytes_per_s"] and bw["copy_bytes_per_s"] == copy["bytes_per_s"] > 0
    assert bw["threads"] == 1 and copy["tensor_mib"] == 8


def _bw_result() -> dict:
    read = {"bytes_per_s": 30e9, "median_bytes_per_s": 29e9, "method": "amax", "buffer_mib": 1024,
            "l3_bytes": 32 * _MIB, "repeats": 5, "threads": 2,
            "methods": {"amax": {"bytes_per_s": 30e9}, "dot": {"bytes_per_s": 29.5e9}, "sum": {"bytes_per_s": 24e9}}}
    copy = {"bytes_per_s": 25e9, "tensor_mib": 512, "repeats": 5, "threads": 2}
    cell = {"engine": "kvfold", "context": 512, "status": "ok", "decode_status": "ok", "decode_tok_s": 100.0}
    return {"settings": {"contexts": [512], "engines": ["kvfold"], "kvfold_weights": "quantized"},
            "cells": [cell], "decode_bytes_per_token": {"512": {"total": 90e6, "weights_total": 89e6,
                                                                "routed_experts_active": 10e6, "state": 1e6}},
            "bandwidth": {"read": read, "copy": copy, "read_bytes_per_s": 30e9, "copy_bytes_per_s": 25e9,
                          "threads": 2, "status": "ok"}}


def test_decode_share_is_of_the_read_bandwidth_and_reported():
    res = _bw_result()
    report.summarize(res)
    (cell,) = res["cells"]
    assert cell["decode_achieved_bytes_per_s"] == 90e6 * 100.0
    assert cell["decode_fraction_of_read_bandwidth"] == pytest.approx(9e9 / 30e9)
    assert cell["decode_fraction_of_copy_bandwidth"] == pytest.approx(9e9 / 25e9)
    first, line = RM.bandwidth_lines(res)
    assert first.startswith("memory bandwidth, threads=2: read 30.00 GB/s (amax over a 1024 MiB fp32 buffer, "
                            "32x the 32 MiB L3, best of 5 after a warm-up; other reads: dot 29.50, sum 24.00 GB/s)")
    assert "copy 25.00 GB/s read+write (dst.copy_(src), 512 MiB fp32, best of 5)" in first
    assert line == ("  decode kvfold @ 512: 90.00 MB/token (weights 89.00 MB incl. 10.00 MB selected experts, "
                    "state 1.00 MB) x 100.0 tok/s = 9.00 GB/s = 30.0% of the read bandwidth, "
                    "36.0% of the copy bandwidth")
    failed = {"cells": [], "bandwidth": {"status": "error: boom", "threads": 2}}
    assert RM.bandwidth_lines(failed) == ["memory bandwidth: error: boom"]


# ---- page cache and load times ----------------------------------------------------------------------------
def test_eviction_drops_a_files_pages(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4 * _MIB + 123))
    pages = -(-f.stat().st_size // os.sysconf("SC_PAGE_SIZE"))
    nbytes, _ = M.read_files([f])
    assert nbytes == f.stat().st_size
    assert M.resident_pages(f) == (pages, pages)
    M.evict_page_cache([f])
    assert M.resident_fraction([f]) < M.COLD_RESIDENT_MAX
    assert M.prepare_page_cache(tmp_path, "warm") == 1.0
    assert M.prepare_page_cache(tmp_path, "cold") < M.COLD_RESIDENT_MAX


def _runs(read_s, load_s, resident=0.0, load_status="ok"):
    read = {"status": "ok", "seconds": read_s, "bytes": 200e6, "files": 2, "resident_before": resident}
    load = {"status": load_status, "seconds": load_s, "bytes": 200e6, "files": 2, "resident_before": resident}
    return read, load


def test_load_read_ratio_and_its_lines():
    cold = M.load_time_row(*_runs(0.4, 0.6), "cold")
    warm = M.load_time_row(*_runs(0.05, 0.2, resident=1.0), "warm")
    assert cold["ratio"] == pytest.approx(1.5) and cold["cold_reached"] and warm["ratio"] == pytest.approx(4.0)
    lines = RM.load_time_lines({"load_times": {"checkpoint": "/ck", "target_ratio": 1.5, "cold": cold, "warm": warm}})
    assert lines[0] == "load time vs reading the files (200.0 MB in 2 files, /ck; target: load <= 1.5x read):"
    assert lines[1] == ("  cold page cache: read 0.40 s (500 MB/s), load 0.60 s: load/read 1.50x (within the 1.5x "
                        "target); resident before: read 0.0%, load 0.0%")
    assert "warm page cache: read 0.05 s (4000 MB/s), load 0.20 s: load/read 4.00x (over the 1.5x target)" in lines[2]
    not_cold = M.load_time_row(*_runs(0.4, 0.6, resident=0.5), "cold")
    failed = M.load_time_row(*_runs(0.4, None, load_status="timeout"), "warm")
    assert not not_cold["cold_reached"] and failed["ratio"] is None
    lines = RM.load_time_lines({"load_times": {"checkpoint": "/ck", "target_ratio": 1.5, "cold": not_cold,
                                               "warm": failed}})
    assert lines[1].endswith("NOT cold: eviction left pages cached (mapped by another process?)")
    assert "load timeout: load/read -" in lines[2]


def test_load_times_end_to_end(tmp_path):
    ckpt = C.ensure_official_checkpoint(C.ensure_checkpoint("tiny-bench", tmp_path, 0))
    rec = M.run_load_times(ckpt, weights="quantized", dtype="float32", threads=1, time_limit=120.0,
                           mem_limit=lambda: 0, log=lambda m: None)
    size = sum(p.stat().st_size for p in M.checkpoint_files(ckpt))
    for cache in ("cold", "warm"):
        row = rec[cache]
        assert row["read"]["status"] == "ok" and row["load"]["status"] == "ok", row
        assert row["bytes"] == size and row["ratio"] == pytest.approx(row["load_s"] / row["read_s"])
    assert rec["cold"]["cold_reached"] and rec["cold"]["read"]["resident_before"] < M.COLD_RESIDENT_MAX
    assert rec["warm"]["read"]["resident_before"] == rec["warm"]["load"]["resident_before"] == 1.0
    assert "cold page cache: read" in "\n".join(RM.load_time_lines({"load_times": rec}))


def test_load_times_flag_defaults_off():
    assert R.build_parser().parse_args([]).load_times == "off"
    assert R.build_parser().parse_args(["--load-times", "on"]).load_times == "on"

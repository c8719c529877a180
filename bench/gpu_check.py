"""Everything issue 20 asks of a GPU, as one prepared run: `python bench/gpu_check.py --device cuda`.

No session has had a GPU yet, so this script is what the first one runs (it also runs with
`--device cpu`, which is how tests/test_gpu_check.py keeps it working). Each check runs on its
own; a failure is recorded with its error and the run goes on, and the report is rewritten after
every check, so a run cut short still says what it measured. The report (JSON, `--out`) holds:

- `families`: the tiny DeepSeek-V4 and GLM-5.3, fp32 and bf16, built on the CPU and copied to the
  device: logits on the device against the CPU's (max |diff| and greedy tokens), whole prefill
  against chunked on the device, snapshots taken on the device restored on the CPU and the other
  way round (each continued and compared), a CPU state refused by the device model and unchanged,
  and batched against alone, prompts and then decode rows beside a chunk, with torch's kernels
  and in batch-invariant mode (on CUDA the Triton row kernels; `torch.equal` must hold there);
- `triton`: the tiny V4 with the Triton kernels on against off, on the device;
- `graphs`: the tiny V4's decode steps replayed from captured CUDA graphs (engine/graphs.py)
  against the same step run eagerly on a twin arena (`torch.equal` of logits, final streams and
  every arena tensor), and against the forward (max |diff|), through a rewind and an admission;
- `invariant_graphs`: the tiny V4's graph decode with the Triton kernels and batch invariance on,
  a sequence's replayed logits and streams alone against beside others (`torch.equal`);
- `split_tiny`: the tiny V4 and GLM-5.3 split by `CausalLM.place` (all but the last two layers
  on the device, each holding half its routed experts, the rest on the host; embedding on the
  host, head on the device) against the same weights on the CPU alone: prefill and greedy steps
  (max |diff|, each step's argmax; `torch.equal` under `--virtual`), the pack's expert hits;
- `split_flash`: a V4-Flash-shaped stack (`--split-flash-layers`, bf16, random weights drawn on the
  device, held on the host) run on the CPU alone, then split (`--split-gpu-layers`, default all
  but the last) with every card layer's experts on the host (`host_experts`) and with a partial
  pack (`partial_pack`, `--split-gpu-experts`, default half): logits against the CPU run and one
  sequence's decode tok/s at `--split-context`; beside it (`llama_cpp`) llama-bench's decode with
  `-ngl 99 --n-cpu-moe N` when `--llama-cpp DIR` and `--gguf FILE` are given, else why not.
  `--virtual` runs both on the CPU with every device virtual (layers/virtual_devices.py), where
  a crossing the split misses raises and the bits must equal the CPU's;
- `speed`: decode tokens/s of the `medium` config and of a V4-Flash-shaped stack (the release's
  shapes, `--flash-layers` layers, random bf16 weights) at 1, 8 and 64 sequences and at the given
  contexts, with the fraction of `--bandwidth` (bytes/s) that one step's weight and state bytes
  reach, each also as replayed graphs (`graph_*`, `graph_triton_*` with the Triton kernels
  reading keys and experts in place, `graph_invariant_*` with them in batch-invariant mode);
  and transformers' decode of the same model on
  the same device where it imports.

On the GPU machine (torch and triton are there; transformers 5.23 is not):
    pip download --no-deps transformers==5.23.0 -d .gpu-wheels    # here, once
    run: pip install --no-deps -t /tmp/tf .gpu-wheels/*.whl && PYTHONPATH=/tmp/tf:. \
         python bench/gpu_check.py --device cuda --out $OUT/gpu.json        (carry .gpu-wheels)
The split cells alone (a few minutes; host RAM: --split-flash-layers x 13 GB and a copy of the
card layers' host experts, the GPU: their dense parts, pack and head):
    python bench/gpu_check.py --device cuda --no-families --no-triton --no-graphs --no-speed \
         --out $OUT/split.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfold.errors import StateMismatchError
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from kvfold.models.glm5.config import glm5_config_from_dict
from kvfold.models.glm5.model import Glm5Model

GLM_TINY = dict(
    model_type="glm5_next_text", vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=8,
    index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=5,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
START = time.perf_counter()
FLASH_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepseek_v4_flash_config.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def glm_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random GLM-5.3 weights scaled so activations stay O(1) (as tests/test_glm5_next.py's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("_hc.scale"):
                p.copy_(1 + 0.1 * r)
            elif "embed_tokens" in name or "conv1d" in name or name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))


def tiny_pair(family: str, dtype: torch.dtype, device: torch.device):
    """(CPU model, device model) of one family with the same weights."""
    if family == "deepseek_v4":
        cfg = tiny_config(num_nextn_predict_layers=0)
        cpu = Dsv4Model(cfg, dtype=dtype)
        init_random_(cpu, 0)
        dev = Dsv4Model(cfg, dtype=dtype, device=device)
    else:
        cfg = glm5_config_from_dict(GLM_TINY)
        cpu = Glm5Model(cfg, dtype=dtype)
        glm_random_(cpu, 0)
        dev = Glm5Model(cfg, dtype=dtype, device=device)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev


def prompt(model, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size - 2, (n,), generator=g).tolist()


def greedy(model, st, last: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(last[-1].argmax()))
        last = model.forward([tokens[-1]], st)
        rows.append(last[-1].float().cpu())
    return tokens, torch.stack(rows)


def check_family(family: str, dtype: torch.dtype, device: torch.device) -> dict:
    cpu, dev = tiny_pair(family, dtype, device)
    ids, cap = prompt(cpu, 40), 96
    out: dict = {}
    st_c, st_d = cpu.new_state(capacity=cap), dev.new_state(capacity=cap)
    lc, ld = cpu.forward(ids, st_c), dev.forward(ids, st_d)
    out["prefill_max_diff_vs_cpu"] = max_diff(lc, ld)
    snap_c, snap_d = st_c.snapshot(), st_d.snapshot()
    tok_c, rows_c = greedy(cpu, st_c, lc, 8)
    tok_d, rows_d = greedy(dev, st_d, ld, 8)
    out["greedy_tokens_equal_cpu"] = tok_c == tok_d
    out["decode_max_diff_vs_cpu"] = max_diff(rows_c, rows_d)
    st_chunks = dev.new_state(capacity=cap)
    chunked = torch.cat([dev.forward(ids[i:i + 13], st_chunks) for i in range(0, len(ids), 13)])
    out["chunked_vs_whole_max_diff"] = max_diff(chunked, ld)
    out["chunked_vs_whole_equal"] = torch.equal(chunked.cpu(), ld.cpu())
    # a device snapshot continues on the CPU, a CPU snapshot on the device
    on_cpu = cpu.new_state(capacity=cap)
    on_cpu.restore(snap_d)
    tok_on_cpu, rows_on_cpu = greedy(cpu, on_cpu, ld.cpu(), 8)
    out["device_snapshot_on_cpu_tokens_equal"] = tok_on_cpu == tok_d
    out["device_snapshot_on_cpu_max_diff"] = max_diff(rows_on_cpu, rows_d)
    on_dev = dev.new_state(capacity=cap)
    on_dev.restore(snap_c)
    tok_back, rows_back = greedy(dev, on_dev, lc.to(device), 8)
    out["cpu_snapshot_on_device_tokens_equal"] = tok_back == tok_c
    out["cpu_snapshot_on_device_max_diff"] = max_diff(rows_back, rows_c)
    out.update(refusal(cpu, dev, ids))
    out.update(batched_vs_alone(dev, ids))
    return out


def refusal(cpu, dev, ids) -> dict:
    """A CPU state handed to the device model is refused and unchanged (when the devices differ)."""
    if cpu.device == dev.device:
        return {"other_device_state_refused": "same device"}
    st = cpu.new_state(capacity=64)
    cpu.forward(ids[:8], st)
    before = st.snapshot()
    try:
        dev.forward(ids[8:9], st)
        refused = False
    except StateMismatchError:
        refused = True
    return {"other_device_state_refused": refused, "refused_state_unchanged": st.snapshot() == before}


def batched_vs_alone(dev, ids) -> dict:
    """Three sequences advanced together against each alone: their prompts (7, 19 and 30 tokens) in
    one forward_batch, then a step of two decode rows beside a 5-token chunk. With torch's kernels
    and, where the model has it (on CUDA: the Triton row kernels of numerics/triton_rows.py), in
    batch-invariant mode, which must give torch.equal for every row and equal snapshots."""
    out, was = {"batch_invariant_mode": dev.supports_batch_invariance}, dev.batch_invariant
    lengths, feeds = (7, 19, 30), ([ids[30]], ids[31:36], [ids[37]])
    for mode in ("torch", "invariant") if dev.supports_batch_invariance else ("torch",):
        dev.set_batch_invariant(mode == "invariant")
        alone, alone_states = [], []
        for n, feed in zip(lengths, feeds):
            st = dev.new_state(capacity=64)
            alone.append((dev.forward(ids[:n], st, last_only=True), dev.forward(feed, st, last_only=False)))
            alone_states.append(st)
        states = [dev.new_state(capacity=64) for _ in lengths]
        sync(dev.device)
        t0 = time.perf_counter()
        first = dev.forward_batch([(ids[:n], st) for n, st in zip(lengths, states)])
        second = dev.forward_batch([(f, st) for f, st in zip(feeds, states)], last_only=False)
        sync(dev.device)
        out[f"batched_seconds_{mode}"] = time.perf_counter() - t0
        pairs = [(a, b) for (a1, a2), b1, b2 in zip(alone, first, second) for a, b in ((a1, b1), (a2, b2))]
        out[f"batched_equals_alone_{mode}"] = all(torch.equal(a.cpu(), b.cpu()) for a, b in pairs) and all(
            sa.snapshot() == sb.snapshot() for sa, sb in zip(alone_states, states))
        out[f"batched_vs_alone_max_diff_{mode}"] = max(max_diff(a, b) for a, b in pairs)
    dev.set_batch_invariant(was)
    return out


def check_triton(device: torch.device) -> dict:
    from kvfold.numerics.backend import KernelSet, triton_available
    if not triton_available(device):
        return {"skipped": f"triton cannot run on {device} (not installed, or CPU without TRITON_INTERPRET=1)"}
    model = Dsv4Model(tiny_config(sliding_window=8, compress_ratios=(0, 4, 8, 4), index_topk=2,
                                  num_nextn_predict_layers=0), dtype=torch.float32, device=device)
    cpu = Dsv4Model(model.config, dtype=torch.float32)
    init_random_(cpu, 0)
    model.load_state_dict(cpu.state_dict())
    ids = prompt(model, 40)

    def run():
        st = model.new_state(capacity=48)
        return torch.cat([model.forward(ids[:32], st)] + [model.forward(ids[i:i + 1], st) for i in range(32, 40)])

    want = run()
    model.set_kernels(KernelSet(triton=True))
    got = run()
    # a query's index scores over its first entries: the same bits whatever the call's entry count
    from kvfold.numerics import triton_kernels
    g = torch.Generator().manual_seed(0)
    q, w = torch.randn(3, 4, 32, generator=g).to(device), torch.randn(3, 4, generator=g).to(device)
    keys, visible = torch.randn(300, 32, generator=g).to(device), torch.tensor([20, 7, 15], device=device)
    ref = triton_kernels.index_scores(q, w, keys[:20], visible)
    bound_invariant = all(torch.equal(triton_kernels.index_scores(q, w, keys[:n], visible)[:, :20], ref)
                          for n in (100, 300))
    return {"triton_vs_torch_max_diff": max_diff(got, want), "logit_scale": want.abs().max().item(),
            "index_scores_same_bits_at_any_entry_count": bound_invariant}


def check_invariant_graphs(dtype: torch.dtype, device: torch.device, lengths=(5, 300, 41)) -> dict:
    """DeepSeek-V4's graph decode with the Triton kernels on and batch invariance: a sequence's
    logits and final streams, replayed in buckets 1, 2 and 4 (with padding rows) and at context
    bounds 256 and 512 (prompts of `lengths`), must be the same bits alone and beside others
    (`torch.equal`). The prompts are prefilled by the default path, the same bits every time."""
    from kvfold.engine.graphs import DecodeGraphs
    from kvfold.numerics.backend import KernelSet, triton_available
    if not triton_available(device):
        return {"skipped": f"triton cannot run on {device}"}
    _, model = tiny_pair("deepseek_v4", dtype, device)
    model.set_kernels(KernelSet(triton=True))
    model.set_batch_invariant(True)
    if model.graph_unsupported() is not None:
        return {"skipped": model.graph_unsupported()}
    seen, equal, captured = {}, True, 0
    for members in ((0,), (1,), (0, 1), (1, 2, 0)):
        pool = model.new_page_pool(16)
        arena = model.new_decode_arena(3, 512, pool)
        states = {m: model.new_state(capacity=512, pages=pool, arena=arena) for m in members}
        model.set_batch_invariant(False)
        model.set_kernels(KernelSet(triton=False))
        for m in members:
            model.forward(prompt(model, lengths[m], seed=m), states[m])
        model.set_kernels(KernelSet(triton=True))
        model.set_batch_invariant(True)
        graphs = DecodeGraphs(model, arena, 4)
        for step in range(3):
            logits, streams = graphs.step([((step * 11 + m) % 50 + 2, states[m]) for m in members], hidden=True)
            for i, m in enumerate(members):
                got = (logits[i].cpu(), streams[i].cpu())
                if (m, step) in seen:
                    equal &= torch.equal(got[0], seen[m, step][0]) and torch.equal(got[1], seen[m, step][1])
                seen[m, step] = got
        captured += graphs.captures - len(graphs.capture_errors)
    model.set_batch_invariant(False)
    return {"alone_equals_batched": equal, "graphs_captured": captured, "capture_errors": graphs.capture_errors}


def check_graphs(family: str, dtype: torch.dtype, device: torch.device) -> dict:
    """Graph replay against eager on twin arenas, and against the forward, through a rewind (GLM-5.3:
    whose next step replays its KDA state from the base)."""
    from kvfold.engine.graphs import DecodeGraphs
    _, model = tiny_pair(family, dtype, device)
    model.set_batch_invariant(False)
    rewind = 2
    cap, lens = 512, (1, 30, 127, 200)
    pools = [model.new_page_pool(24) for _ in range(3)]
    arenas = [model.new_decode_arena(5, cap, pools[i], max_rewind=rewind) for i in range(2)]
    states = [[], [], []]  # replayed, eager twin, forward twin
    for n in lens:
        ids = prompt(model, n, seed=n)
        for k in range(3):
            st = model.new_state(capacity=cap, max_rewind=rewind, pages=pools[k], arena=arenas[k] if k < 2 else None)
            model.forward(ids, st)
            states[k].append(st)
    graphs = DecodeGraphs(model, arenas[0], 5)
    same_logits = same_arena = True
    worst, scale, kda_max = 0.0, 0.0, 0.0
    for i in range(24):
        if i == 8:  # a rewind of two tokens, in all three
            for k in range(3):
                states[k][1].rewind_to(states[k][1].pos - 2)
        if i == 12:  # an admission mid-run
            ids = prompt(model, 70, seed=70)
            for k in range(3):
                st = model.new_state(capacity=cap, max_rewind=rewind, pages=pools[k],
                                     arena=arenas[k] if k < 2 else None)
                model.forward(ids, st)
                states[k].append(st)
        toks = [(7 * i + j) % (model.config.vocab_size - 4) + 2 for j in range(len(states[0]))]
        got, got_streams = graphs.step(list(zip(toks, states[0])), hidden=True)
        twin = states[1]
        context = graphs.context_bucket(max(st.pos for st in twin) + 1)  # the same shapes as the replayed step
        plans = [st.graph_inputs(1) for st in twin]  # GLM-5.3: each state's KDA plan
        eager, eager_streams = model.decode_graph_step(
            model.backend(graphs.batch_invariant), arenas[1], torch.tensor(toks, device=device), torch.tensor([st.pos for st in twin], device=device),
            torch.tensor([st.slot for st in twin], device=device), context,
            torch.tensor(plans, device=device) if plans[0] else None)
        for st in twin:
            st.after_graph_step(1)
        want = torch.cat(model.forward_batch([([t], st) for t, st in zip(toks, states[2])]))
        n = len(toks)
        same_logits &= torch.equal(got, eager[:n]) and torch.equal(got_streams, eager_streams[:n])
        worst, scale = max(worst, max_diff(got, want)), max(scale, want.abs().max().item())
        kda_max = max([kda_max] + [ls.rec.abs().max().item() for st in states[2] for ls in getattr(st, "layers", ())
                                   if hasattr(ls, "rec") and ls.rec.numel()])
    for a, b in zip(arenas[0].rings.values(), arenas[1].rings.values()):
        same_arena &= torch.equal(a, b)
    return {"replay_equals_eager": same_logits, "arenas_equal": same_arena, "vs_forward_max_diff": worst,
            "logit_scale": scale, "kda_state_absmax": kda_max, "captured": graphs.capture, **graphs.stats()}


@torch.no_grad()
def device_random_(model: torch.nn.Module, seed: int = 0, draw: torch.device | None = None) -> None:
    """init_random_'s kinds of values drawn on the model's device (a V4-Flash-shaped stack is too
    big to draw on the CPU in reasonable time): O(1) activations, valid hash routing. `draw`: the
    device to draw on when it is not the model's (split_flash's CPU model gets its values drawn on
    the GPU a tensor at a time and copied)."""
    draw = torch.device(draw) if draw is not None else next(model.parameters()).device
    g = torch.Generator(device=draw).manual_seed(seed)
    for name, p in model.named_parameters():
        t = p if p.device == draw else torch.empty(p.shape, dtype=p.dtype, device=draw)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif leaf in ("sinks", "position_bias", "base", "hc_base", "scale", "hc_scale"):
            t.normal_(1.0 if "scale" in leaf else 0.0, 0.2, generator=g)
        else:
            t.normal_(0.0, 1.0 if name.endswith("embed_tokens.weight") else p.shape[-1] ** -0.5, generator=g)
        if t is not p:
            p.copy_(t)
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, device=draw, generator=g)
                    .argsort(dim=1)[:, :cfg.num_experts_per_tok])
        elif name.endswith("e_score_correction_bias"):
            b.zero_()


def flash_stack(layers: int, dtype: torch.dtype, device: torch.device, draw: torch.device | None = None,
                **shrink) -> Dsv4Model:
    """The release's V4-Flash shapes (tests/data's config.json) with `layers` layers: sliding, CSA,
    HCA, CSA, ... (the first one hash-routed), random weights (drawn on `draw`, default `device`);
    `shrink` overrides config.json keys (how the CPU test builds a small one)."""
    from kvfold.models.deepseek_v4.config import config_from_dict
    d = json.loads(FLASH_CONFIG.read_text())
    d.update(n_layers=layers, n_hash_layers=1, compress_ratios=([0] + [4, 128] * layers)[:layers], n_mtp_layers=0,
             **shrink)
    model = Dsv4Model(config_from_dict(d), dtype=dtype, device=device)
    device_random_(model, draw=draw)
    return model


def bytes_per_step(model, batch: int, state_bytes: int) -> int:
    """Bytes one decode step reads at least: every weight but the embedding table and the routed
    experts, the experts `batch` tokens route to at most (num_experts_per_tok each, capped at all of
    them), and the states."""
    cfg = model.config
    experts = total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "embed_tokens" in name:
            continue
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            experts += size
        else:
            total += size
    share = min(1.0, batch * cfg.num_experts_per_tok / cfg.n_routed_experts)
    return int(total + experts * share + state_bytes)


def decode_cell(model, batch: int, context: int, steps: int, graphs: bool = False) -> dict:
    """Median decode step of `batch` sequences at `context`: one prefill, its snapshot restored into
    every other state (exact, and cheaper than `batch` prefills). `graphs`: the states in an arena
    and each step replayed from a captured graph (engine/graphs.py)."""
    device = model.device
    cap = context + steps + 8
    kw, runner = {}, None
    if graphs:
        from kvfold.engine.graphs import DecodeGraphs
        pool = model.new_page_pool(batch * -(-cap // model.page_tokens) + 1)
        arena = model.new_decode_arena(batch, cap, pool)
        kw, runner = {"pages": pool, "arena": arena}, DecodeGraphs(model, arena, batch)
    first = model.new_state(capacity=cap, **kw)
    ids = prompt(model, context)
    sync(device)
    t = time.perf_counter()
    model.forward(ids, first, last_only=True)
    sync(device)
    prefill_s = time.perf_counter() - t
    blob = first.snapshot()
    states = [first] + [model.new_state(capacity=cap, **kw) for _ in range(batch - 1)]
    for st in states[1:]:
        st.restore(blob)
    times = []
    for i in range(steps + 3):
        sync(device)
        t = time.perf_counter()
        if runner is not None:
            runner.step([((7 * i + j) % 200 + 2, st) for j, st in enumerate(states)])
        else:
            model.forward_batch([([(7 * i + j) % 200 + 2], st) for j, st in enumerate(states)])
        sync(device)
        times.append(time.perf_counter() - t)
    step = sorted(times[3:])[len(times[3:]) // 2]
    state_bytes = sum(st.nbytes for st in states)
    return {"batch": batch, "context": context, "prefill_s": prefill_s, "step_ms": step * 1e3,
            "tok_s": batch / step, "spread_ms": [min(times[3:]) * 1e3, max(times[3:]) * 1e3],
            "bytes_per_step": bytes_per_step(model, batch, state_bytes)}


def hf_decode(model, context: int, steps: int) -> dict:
    """transformers' DeepseekV4ForCausalLM with the same config and weights, one sequence."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    device, default = model.device, torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:  # built in place: a V4-Flash-shaped stack would not fit the host's memory in fp32
        with torch.device(device):
            hf = DeepseekV4ForCausalLM(DeepseekV4Config(**model.config.to_hf_dict()))
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    hf.eval()
    ids = torch.tensor([prompt(model, context)], device=device)
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        cache, times = out.past_key_values, []
        for i in range(steps + 3):
            sync(device)
            t = time.perf_counter()
            out = hf(input_ids=torch.tensor([[(7 * i) % 200 + 2]], device=device), past_key_values=cache,
                     use_cache=True)
            cache = out.past_key_values
            sync(device)
            times.append(time.perf_counter() - t)
    step = sorted(times[3:])[len(times[3:]) // 2]
    del hf
    return {"context": context, "step_ms": step * 1e3, "tok_s": 1 / step,
            "weights_not_loaded": len(missing), "unexpected_weights": len(unexpected)}


def speed(args, device: torch.device, report: dict, save) -> None:
    """Decode cells of the medium config (fp32, bf16) and of the V4-Flash-shaped stack (bf16), and
    transformers' decode of each, until --time-budget is spent (the cells left are marked)."""
    models = [(f"{args.config}-{name}", lambda dt=dt: medium_model(args.config, dt, device))
              for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))]
    if args.flash_layers:
        models.append((f"v4-flash-{args.flash_layers}-layers-bf16",
                       lambda: flash_stack(args.flash_layers, torch.bfloat16, device, **args.flash_shrink)))
    for label, make in models:
        entry = report["speed"].setdefault(label, {"cells": []})
        try:
            time_model(args, make(), entry, save)
        except Exception as exc:  # record and go on to the next model
            entry["error"] = failure(exc)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def time_model(args, model, entry: dict, save) -> None:
    deadline = START + args.time_budget
    entry["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    for context in args.contexts:
        for batch in args.batches:
            if time.perf_counter() > deadline:
                entry["cells"].append({"batch": batch, "context": context, "skipped": "--time-budget spent"})
                continue
            cell = run_check(lambda: decode_cell(model, batch, context, args.steps))
            if not args.no_graphs and time.perf_counter() < deadline:
                cell.update(graph_cells(args, model, batch, context))
            for prefix in ("", "graph_", "graph_triton_", "graph_invariant_"):
                if prefix + "step_ms" in cell and "bytes_per_step" in cell and args.bandwidth:
                    cell[prefix + "bandwidth_fraction"] = \
                        cell["bytes_per_step"] / (cell[prefix + "step_ms"] / 1e3) / args.bandwidth
            entry["cells"].append(cell)
            save()
            if device_is_cuda(model):
                torch.cuda.empty_cache()
    if time.perf_counter() < deadline:  # at the shortest context: its prefill is the cheapest
        entry["transformers"] = run_check(lambda: hf_decode(model, min(args.contexts), args.steps))


def graph_cells(args, model, batch: int, context: int) -> dict:
    """The cell's step as graph decode (`graph_*`), and on CUDA with the Triton kernels reading
    keys and experts in place (`graph_triton_*`; the interpreter's times would mean nothing),
    outside the invariant mode, and with it (`graph_invariant_*`: the fixed-order row kernels)."""
    from kvfold.numerics.backend import KernelSet, triton_available
    out, invariant, kernels_before = {}, model.batch_invariant, model.kernels  # (invariant: on for fp32 CPU models)
    try:
        on_gpu = model.device.type == "cuda" and triton_available(model.device)
        variants = [("graph_", False, False)]
        if on_gpu:
            variants += [("graph_triton_", True, False), ("graph_invariant_", True, True)]
        for prefix, kernels, inv in variants:
            model.set_kernels(KernelSet(triton=kernels))
            model.set_batch_invariant(inv)
            got = run_check(lambda: decode_cell(model, batch, context, args.steps, graphs=True))
            out.update({prefix + k: v for k, v in got.items() if k in ("step_ms", "tok_s", "error")})
    finally:
        model.set_kernels(kernels_before)
        model.set_batch_invariant(invariant)
    return out


def device_is_cuda(model) -> bool:
    return model.device.type == "cuda"


def medium_model(name: str, dtype: torch.dtype, device: torch.device) -> Dsv4Model:
    from kvfold.bench.configs import build_config
    model = Dsv4Model(build_config(name), dtype=dtype, device=device)
    device_random_(model)
    return model


# ---- split cells: one model across the device and the host (CausalLM.place, issue 46) ----------------
def split_placement(model, gpu_layers: int, gpu_experts: int, accelerator: str):
    """Layers 0..gpu_layers-1 on `accelerator` holding experts 0..gpu_experts-1 of each there (a
    partial pack; the others run on the host), the later layers and the embedding on the host, the
    head on the accelerator: every crossing a placement makes (kvfold/placement.py), in one model."""
    from kvfold.placement import HOST, Placement
    _, blocks, _ = model._placement_units()
    moe = [getattr(b.mlp, "experts", None) is not None for b in blocks]
    devices = tuple(accelerator if i < gpu_layers else HOST for i in range(len(blocks)))
    experts = tuple(frozenset(range(gpu_experts if i < gpu_layers else 0)) if m else None for i, m in enumerate(moe))
    return Placement(devices, experts, model.config.n_routed_experts, HOST, accelerator, accelerator)


@contextlib.contextmanager
def placed(model, placement, virtual: bool):
    """`model` split as `placement` for the block's runs: on the real devices, or (`virtual`) with
    every device the CPU under a VirtualDevices mode, in which an op that mixes the two sides
    raises, so a missing crossing shows on a CPU-only machine. Yields the mode (None when real)."""
    from kvfold.layers.virtual_devices import VirtualDevices
    vd = VirtualDevices() if virtual else None
    with vd if vd is not None else contextlib.nullcontext():
        model.place(placement, virtual=vd)
        yield vd


def reference_run(model, ids: list[int], steps: int, cap: int):
    """The one-device run: (its greedy tokens, (prefill logits, each step's logits) as float on the CPU)."""
    st = model.new_state(capacity=cap)
    first = model.forward(ids, st)
    tokens, rows = greedy(model, st, first, steps)
    return tokens, (first.float().cpu(), rows)


def forced_run(model, ids: list[int], tokens: list[int], cap: int):
    """(prefill logits, the logits after each of `tokens`) as float on the CPU. The split model is fed
    the reference's greedy tokens, so each row answers the same history as the reference's and a
    difference is the arithmetic's, never a divergence's."""
    st = model.new_state(capacity=cap)
    first = model.forward(ids, st).float().cpu()
    return first, torch.stack([model.forward([t], st)[-1].float().cpu() for t in tokens])


def split_vs_reference(want, got) -> dict:
    """What check_family reports for device against CPU, for a split run against the one-device one;
    `greedy_tokens_equal_cpu`: each step's argmax (the next greedy token) the same."""
    def argmaxes(first, rows):
        return [int(first[-1].argmax())] + rows.argmax(-1).tolist()
    (wf, wr), (gf, gr) = want, got
    return {"prefill_max_diff_vs_cpu": max_diff(wf, gf), "decode_max_diff_vs_cpu": max_diff(wr, gr),
            "greedy_tokens_equal_cpu": argmaxes(wf, wr) == argmaxes(gf, gr),
            "logits_equal_cpu": torch.equal(wf, gf) and torch.equal(wr, gr),
            "logit_scale": max(wf.abs().max().item(), wr.abs().max().item())}


def check_split_tiny(family: str, dtype: torch.dtype, accelerator: str, virtual: bool) -> dict:
    """The tiny model split (all but its last two layers on the device, each holding half its
    experts; the head there too) against the same weights on the CPU alone: a 40-token prefill and
    8 greedy steps. Virtual: the same bits (`logits_equal_cpu`); on a GPU: its arithmetic's difference."""
    ref, model = tiny_pair(family, dtype, torch.device("cpu"))
    ids, cap = prompt(ref, 40), 96
    tokens, want = reference_run(ref, ids, 8, cap)
    placement = split_placement(model, model.config.num_hidden_layers - 2, model.config.n_routed_experts // 2,
                                accelerator)
    with placed(model, placement, virtual) as vd:
        got = forced_run(model, ids, tokens, cap)
    out = {"placement": placement.flags(), "virtual": virtual, **split_vs_reference(want, got),
           "expert_hits": list(model.expert_hits())}
    if vd is not None:
        out["virtual_ops_checked"] = vd.checked
    return out


def twin(model: Dsv4Model) -> Dsv4Model:
    """A second model holding `model`'s very tensors (V4-Flash-shaped weights do not fit the host
    twice), to be placed while `model` stays whole on the CPU; placing copies only what moves."""
    other = Dsv4Model(model.config, dtype=model.dtype, device="meta")  # no placeholders: 42 GB at 3 layers
    other.load_state_dict(model.state_dict(), assign=True)
    other.materialize_(model.device)  # what is computed at construction (RoPE tables), on the CPU
    return other


def split_flash_run(master, gpu_experts: int, args, accelerator: str, reference) -> dict:
    """`master`'s twin split (--split-gpu-layers, `gpu_experts` per card layer): logits against the
    one-device run (`reference`: its prompt, greedy tokens, logits and state capacity), then one
    sequence's decode at --split-context, timed as the speed cells are."""
    ids, tokens, want, cap = reference
    model = twin(master)
    gpu_layers = args.split_gpu_layers if args.split_gpu_layers is not None else args.split_flash_layers - 1
    placement = split_placement(model, gpu_layers, gpu_experts, accelerator)
    if not args.virtual:
        torch.cuda.reset_peak_memory_stats()
    with placed(model, placement, args.virtual):
        out = {"placement": placement.flags(), **split_vs_reference(want, forced_run(model, ids, tokens, cap)),
               "expert_hits": list(model.expert_hits())}
        out["decode"] = run_check(lambda: decode_cell(model, 1, args.split_context, args.steps))
        # its count takes a split layer's card and host stacks for dense weights, all read each step
        out["decode"].pop("bytes_per_step", None)
    if not args.virtual:
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def check_split_flash(args, accelerator: str, draw: torch.device | None, deadline: float) -> dict:
    """A V4-Flash-shaped stack (--split-flash-layers layers, bf16, random weights drawn on `draw`)
    built on the CPU, run there alone for the reference, then split twice: every card layer's
    routed experts on the host (`host_experts`, --gpu-experts 0) and a partial pack
    (`partial_pack`, --split-gpu-experts, default half). Each: logits against the reference (max
    |diff|) and decode tok/s."""
    master = flash_stack(args.split_flash_layers, torch.bfloat16, torch.device("cpu"), draw=draw,
                         **args.flash_shrink)
    cfg = master.config
    k = args.split_gpu_experts if args.split_gpu_experts is not None else cfg.n_routed_experts // 2
    ids, cap = prompt(master, 32), 64
    t = time.perf_counter()
    tokens, want = reference_run(master, ids, 8, cap)
    out = {"layers": cfg.num_hidden_layers, "n_experts": cfg.n_routed_experts, "virtual": args.virtual,
           "weight_bytes": sum(p.numel() * p.element_size() for p in master.parameters()),
           "cpu_reference_s": time.perf_counter() - t}
    for label, experts in (("host_experts", 0), ("partial_pack", k)):
        if time.perf_counter() > deadline:
            out[label] = {"skipped": "--time-budget spent"}
            continue
        out[label] = run_check(lambda: split_flash_run(master, experts, args, accelerator, (ids, tokens, want, cap)))
        gc.collect()  # the twin's card tensors go before the next one's arrive
        if not args.virtual:
            torch.cuda.empty_cache()
    # whole process, earlier checks included: what the host held at most beside the card
    out["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def llama_cpp_cells(args, deadline: float) -> list[dict]:
    """llama.cpp's decode of a GGUF at hand (--gguf) with every layer on the card and the routed
    experts of the first N layers on the host (`-ngl 99 --n-cpu-moe N`, N of --llama-n-cpu-moe; 99:
    all of them, as `host_experts`), at --split-context: the peer's number beside split_flash's.
    A record saying why where it cannot run (kvfold/bench/llamacpp.py's records)."""
    from kvfold.bench import llamacpp as LL
    context, llama = args.split_context, LL.locate(args.llama_cpp)
    why = llama.problem if llama.bench is None else None
    if why is None and not (args.gguf and Path(args.gguf).is_file()):
        why = "no GGUF at hand (--gguf FILE)" if not args.gguf else f"--gguf {args.gguf}: no such file"
    if why is not None:
        return [LL.unavailable_record(context, why)]
    cells = []
    for n in args.llama_n_cpu_moe:
        left = deadline - time.perf_counter()
        if left <= 0:
            cells.append(LL.unavailable_record(context, "--time-budget spent"))
            continue
        cell = LL.run_cell(llama, Path(args.gguf), context, decode_tokens=args.steps, threads=os.cpu_count() or 1,
                           time_limit=left, extra=["-ngl", "99", "--n-cpu-moe", str(n)])
        cells.append({"n_cpu_moe": n, **cell})
    return cells


def split_cells(args, device: torch.device, report: dict, save) -> None:
    """split_tiny (each family and --split-dtypes) and split_flash, within --time-budget."""
    if device.type != "cuda" and not args.virtual:
        why = {"skipped": "a split needs an accelerator: --device cuda, or --virtual (every device the CPU)"}
        report["split_tiny"], report["split_flash"] = dict(why), dict(why)
        return
    from kvfold.placement import ACCELERATOR
    accelerator = ACCELERATOR if args.virtual else f"cuda:{device.index or 0}"
    deadline = START + args.time_budget
    report["split_tiny"] = {}
    for family in ("deepseek_v4", "glm5_next"):
        for dtype in args.split_dtypes:
            name = f"{family}-{str(dtype)[6:]}"
            report["split_tiny"][name] = {"skipped": "--time-budget spent"} if time.perf_counter() > deadline \
                else run_check(lambda: check_split_tiny(family, dtype, accelerator, args.virtual))
            save()
    if not args.split_flash_layers:
        report["split_flash"] = {"skipped": "--split-flash-layers 0"}
    elif time.perf_counter() > deadline:
        report["split_flash"] = {"skipped": "--time-budget spent"}
    else:
        draw = device if device.type == "cuda" and not args.virtual else None
        report["split_flash"] = run_check(lambda: check_split_flash(args, accelerator, draw, deadline))
    save()
    report["split_flash"]["llama_cpp"] = llama_cpp_cells(args, deadline)
    save()


def failure(exc: BaseException) -> dict:
    return {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}


def run_check(fn) -> dict:
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # a check that fails is a result; the others still run
        out = failure(exc)
    out["wall_s"] = round(time.perf_counter() - t, 3)
    return out


def split_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-split", action="store_true", help="leave out the split cells")
    p.add_argument("--virtual", action="store_true",
                   help="split cells on the CPU, every device virtual (VirtualDevices): the bits must be the CPU's")
    p.add_argument("--split-dtypes", default="float32,bfloat16", help="split_tiny's dtypes")
    p.add_argument("--split-flash-layers", type=int, default=3, help="layers of split_flash's stack (0: none)")
    p.add_argument("--split-gpu-layers", type=int, default=None,
                   help="split_flash's layers on the device (default: all but the last)")
    p.add_argument("--split-gpu-experts", type=int, default=None,
                   help="split_flash's partial pack: experts a card layer holds (default: half)")
    p.add_argument("--split-context", type=int, default=512, help="split_flash's decode context")
    p.add_argument("--llama-cpp", default=None, help="a llama.cpp checkout or build with llama-bench")
    p.add_argument("--gguf", default=None, help="the GGUF llama-bench runs beside split_flash")
    p.add_argument("--llama-n-cpu-moe", default="99", help="llama-bench --n-cpu-moe values (comma-separated)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-check.json")
    p.add_argument("--config", default="medium", help="the kvfold bench config timed besides V4-Flash")
    p.add_argument("--contexts", default="4096,65536")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per cell (median)")
    p.add_argument("--flash-layers", type=int, default=4, help="layers of the V4-Flash-shaped stack (0: none)")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="the device's memory bandwidth, bytes/s")
    p.add_argument("--no-speed", action="store_true", help="the correctness checks only")
    p.add_argument("--no-families", action="store_true", help="leave out the families checks")
    p.add_argument("--no-triton", action="store_true", help="leave out the Triton check")
    p.add_argument("--no-graphs", action="store_true", help="leave out the graph-decode checks and cells")
    p.add_argument("--time-budget", type=float, default=500,
                   help="seconds after which no split or speed cell starts")
    p.add_argument("--flash-shrink", type=json.loads, default={},
                   help="JSON of config.json keys overriding the V4-Flash shapes (how the tests shrink them)")
    split_arguments(p)
    args = p.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.split_dtypes = [getattr(torch, d) for d in args.split_dtypes.split(",")]
    args.llama_n_cpu_moe = [int(n) for n in args.llama_n_cpu_moe.split(",")]
    device = torch.device(args.device)
    report = {"device": str(device), "torch": torch.__version__, "families": {}, "speed": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(report, indent=1))

    torch.manual_seed(0)
    with torch.inference_mode():
        for family in () if args.no_families else ("deepseek_v4", "glm5_next"):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"{family}-{str(dtype)[6:]}"
                report["families"][name] = run_check(lambda: check_family(family, dtype, device))
                save()
        if not args.no_triton:
            report["triton"] = run_check(lambda: check_triton(device))
            save()
        if not args.no_graphs:
            report["graphs"] = {f"{family}-{str(dt)[6:]}": run_check(lambda: check_graphs(family, dt, device))
                                for family in ("deepseek_v4", "glm5_next") for dt in (torch.float32, torch.bfloat16)}
            save()
            if not args.no_triton:
                report["invariant_graphs"] = {str(dt)[6:]: run_check(lambda: check_invariant_graphs(dt, device))
                                              for dt in (torch.float32, torch.bfloat16)}
                save()
        if not args.no_split:
            split_cells(args, device, report, save)
        if not args.no_speed:
            speed(args, device, report, save)
    save()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

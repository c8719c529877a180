"""Fidelity of the quantized real-shape bench models (issue 42 item 5):

    .venv/bin/python bench/fidelity_real_shapes.py --config v4-flash|glm53-flash [--tokens N]
        [--decode S] [--out results.json]

On the random checkpoint of `kvfold.bench.real_shapes` (DeepSeek-V4-Flash's or GLM-5.3-Flash's
widths, 4 layers, the release's formats), a prompt of N random tokens (default 4) and S greedy decode
steps (default 2), fp32 activations, in three phases of one process, each of which frees (or hands
on) its model before the next one grows, and waits for the memory it needs (others share the
machine; the peaks are about 18 GB, 21.5 GB and 20.5 GB for v4-flash, 13-14 GB for glm53-flash):

1. kvfold quantized (`weights="quantized"`): the logits of every row, and the experts each MoE layer
   routed every row to (`fidelity.RoutedExperts`).
2. kvfold dequantized: the checkpoint loaded again as stored and, before it runs, every weight it
   holds so made an fp32 parameter (`fidelity.dequantize_`), the stored bytes freed as each is
   replaced (phase 1's model, which has run, would keep them alive through its native descriptors
   until its next forward). Dense weights are decoded whole (--sparse-embedding: only the fed
   tokens' embedding rows); each stacked expert tensor is a sparse mapping with only the routed
   experts written (the others zero pages, never read). Fed the same tokens, its logits must be
   torch.equal to phase 1's: in batch-invariant mode (the default for fp32 CPU models) native.c
   reads a stored weight into the products the dequantized weight gives, summed in the same order
   (docs/checkpoints.md, "Exactness"). Both kvfold runs decode op by op (`RoutedExperts` turns the
   fused decode call off to see the routing; the same bits).
3. transformers: the checkpoint's config on the meta device, given phase 2's fp32 tensors (shared,
   not copied; the kvfold model is dropped), eager attention and eager experts; one forward of the
   fed tokens without a cache. Within the suite's bound for two fp32 evaluations of the same logits,
   `fp32_paths_bound` of tests/helpers.py (2 * 8 * L * eps * max|logit|), as tests/test_dsv4_parity.py
   and tests/test_glm5_next.py compare kvfold with transformers.

Either fp32 model reading an expert nobody wrote would read zeros and miss the bound by far
(tests/test_fidelity_sparse_experts.py); besides, both runs' routing is compared with phase 1's
and the kernel's page accounting tells whether any unwritten page of the expert stacks was read.
Prints a short report; `--out` writes it as JSON. The exit status is 1 when a check fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers' hub kernels: the torch fallbacks, never a download

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the suite's bound, as its tests use it

import torch  # noqa: E402

import kvfold  # noqa: E402
from helpers import fp32_paths_bound  # noqa: E402
from kvfold.bench import fidelity as F  # noqa: E402
from kvfold.bench import real_shapes as R  # noqa: E402
from kvfold.bench.cell import current_rss, max_rss, reset_peak_rss  # noqa: E402

GB = 1e9


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def available() -> int:
    """MemAvailable, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def wait_for_memory(need: int, what: str, timeout: float) -> None:
    """Until `need` more bytes are available (others share the machine), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while available() < need:
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} needs {need / GB:.1f} GB more; {available() / GB:.1f} GB available "
                             f"after waiting {timeout:.0f} s")
        log(f"waiting for memory: {what} needs {need / GB:.1f} GB, {available() / GB:.1f} GB available")
        time.sleep(30)


class Phase:
    """Wall time and peak RSS of one phase (the kernel's peak mark reset at its start)."""

    def __init__(self, name: str, out: dict):
        self.name, self.out = name, out.setdefault(name, {})

    def __enter__(self):
        reset_peak_rss()
        self.t0 = time.perf_counter()
        log(f"phase {self.name} ...")
        return self.out

    def __exit__(self, *exc):
        self.out["seconds"] = round(time.perf_counter() - self.t0, 2)
        self.out["peak_rss_bytes"], self.out["rss_bytes_after"] = max_rss(), current_rss()
        return False


def load_quantized(ckpt: Path, rec: dict):
    t0 = time.perf_counter()
    model = kvfold.load_model(ckpt, weights="quantized")
    rec["load_seconds"] = round(time.perf_counter() - t0, 2)
    rec["batch_invariant"] = bool(model.batch_invariant)
    return model


def quantized_phase(args, ckpt: Path, prompt: list[int], out: dict):
    """Phase 1: the quantized model's logits, the tokens fed, its routed experts, and the bytes the
    fp32 model of phase 2 will hold (`fp32_bytes`). The model is freed before returning."""
    with Phase("quantized", out) as rec:
        model = load_quantized(ckpt, rec)
        routed = F.RoutedExperts(model)
        t0 = time.perf_counter()
        logits, tokens = F.run_prompt(model, prompt, args.decode)
        rec["run_seconds"] = round(time.perf_counter() - t0, 2)
        routed.close()
        rec["routed_experts"] = routed.experts()
        sparse = sparse_rows(args, routed, tokens)
        need = fp32_bytes(model, sparse)
        del model
        gc.collect()  # its native caches and modules refer to each other
    return logits, tokens, routed, sparse, need


def sparse_rows(args, routed, tokens: list[int]) -> dict[str, list[int]]:
    """What `dequantize_` writes of the weights it makes sparse: the routed experts, and with
    --sparse-embedding the fed tokens' rows of the embedding (read by row)."""
    sparse = F.expert_rows(routed.experts())
    if args.sparse_embedding:
        sparse["model.embed_tokens.weight"] = sorted(set(tokens))
    return sparse


def fp32_bytes(model, sparse: dict[str, list[int]]) -> int:
    """What the fp32 model made of `model` by `dequantize_(model, sparse)` holds: its float tensors
    as they are, and each held weight in fp32, whole or the listed slices."""
    held = model.quantized_weights()
    stored = {id(t) for w in held.values() for t in (w.q, w.scale)}
    total = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if id(t) not in stored)
    for name, w in held.items():
        total += torch.Size(w.shape[1:]).numel() * 4 * (len(sparse[name]) if name in sparse else w.shape[0])
    return total


def dequantized_phase(args, ckpt: Path, q_logits, tokens, routed, sparse, out: dict):
    """Phase 2: the model loaded again and made fp32 (experts sparse) before it runs, the same
    tokens, logits torch.equal to phase 1's. (Not phase 1's model converted: a model that has run
    keeps native descriptors of its stored weights, which would hold them until its next forward.)"""
    with Phase("dequantized", out) as rec:
        model = load_quantized(ckpt, rec)
        t0 = time.perf_counter()
        rec["decoded_bytes"] = F.dequantize_(model, sparse)
        rec["convert_seconds"] = round(time.perf_counter() - t0, 2)
        again = F.RoutedExperts(model)
        t0 = time.perf_counter()
        logits, _ = F.run_prompt(model, tokens[:args.tokens], args.decode, feed=tokens)
        rec["run_seconds"] = round(time.perf_counter() - t0, 2)
        again.close()
        rec["equal_to_quantized"] = torch.equal(logits, q_logits)
        diff = (logits - q_logits).abs()
        rec["max_abs_diff"] = diff.max().item()
        rec["rows_differing"] = [int(r) for r in torch.nonzero(diff.amax(-1) > 0).flatten()]
        rec["routing"] = F.routing_report(routed.rows(), again.rows(), routed.experts())
        rec["expert_pages"] = F.expert_pages(model)
    return model, logits


def transformers_phase(args, held: dict, kv_logits, tokens, routed, out: dict):
    """Phase 3: transformers on phase 2's tensors, within the suite's fp32 paths bound of kvfold.
    `held["model"]` is the kvfold model, taken out of `held` and dropped once its tensors are `hf`'s."""
    model = held.pop("model")
    n_layers = model.config.num_hidden_layers
    with Phase("transformers", out) as rec:
        t0 = time.perf_counter()
        hf = F.hf_model(model)
        weights, head = F.hf_weights(model)
        F.load_hf_weights(hf, weights)
        del weights, model  # its tensors live on in `hf`, shared: the kvfold model is gone
        rec["build_seconds"] = round(time.perf_counter() - t0, 2)
        rec["experts_implementation"] = hf.config._experts_implementation
        hf_routed = F.HfRouted(hf)
        t0 = time.perf_counter()
        logits = F.hf_logits(hf, tokens, head)
        rec["run_seconds"] = round(time.perf_counter() - t0, 2)
        hf_routed.close()
        diff = (kv_logits - logits).abs()
        bound = fp32_paths_bound(logits, n_layers)
        rec.update(max_abs_diff=diff.max().item(), row_max_abs_diff=diff.amax(-1).tolist(), bound=bound,
                   ratio_to_bound=diff.max().item() / bound, max_abs_logit=logits.abs().max().item(),
                   bound_formula="2 * 8 * L * eps * max|logit| (tests/helpers.py fp32_paths_bound)",
                   layers=n_layers, argmax_kvfold=kv_logits.argmax(-1).tolist(),
                   argmax_transformers=logits.argmax(-1).tolist(),
                   routing=F.routing_report(routed.rows(), hf_routed.ids, routed.experts()),
                   expert_pages=F.expert_pages(hf))
        rec["argmax_agree"] = sum(a == b for a, b in zip(rec["argmax_kvfold"], rec["argmax_transformers"]))
    del hf


def _routing_ok(routing: dict) -> bool:
    return bool(routing) and all(r["same"] and not r["unwritten"] for r in routing.values())


def checks(out: dict) -> dict[str, bool]:
    q, d, h = out["quantized"], out["dequantized"], out.get("transformers", {})
    return {
        "dequantized_equal_to_quantized": d["equal_to_quantized"],
        "dequantized_routing_same": _routing_ok(d["routing"]),
        "transformers_within_bound": h.get("max_abs_diff", float("inf")) < h.get("bound", 0.0),
        "transformers_routing_same": _routing_ok(h.get("routing", {})),
        "no_unwritten_expert_page_read": d["expert_pages"]["read_unwritten"] == 0
        and h.get("expert_pages", {}).get("read_unwritten", 1) == 0,
        "batch_invariant": q["batch_invariant"],
    }


def _gb(b: int) -> str:
    return f"{b / GB:.1f} GB"


def report(out: dict) -> str:
    q, d, h = out["quantized"], out["dequantized"], out["transformers"]
    head = (f"{out['config']}: {out['layers']} layers, prompt {out['tokens']} tokens + {out['decode']} decode "
            f"steps, fp32 activations, {out['threads']} threads ({out['checkpoint']})")
    one = (f"1 quantized:    load {q['load_seconds']} s, run {q['run_seconds']} s, peak RSS "
           f"{_gb(q['peak_rss_bytes'])}; routed experts per MoE layer: "
           f"{[len(v) for v in q['routed_experts'].values()]}")
    two = (f"2 dequantized:  load {d['load_seconds']} s, convert {d['convert_seconds']} s, run "
           f"{d['run_seconds']} s, peak RSS {_gb(d['peak_rss_bytes'])}; torch.equal to 1: "
           f"{d['equal_to_quantized']} (max |diff| {d['max_abs_diff']:.3g}); expert bytes written "
           f"{_gb(d['expert_pages']['written'])}, read unwritten {d['expert_pages']['read_unwritten']}")
    three = (f"3 transformers: build {h['build_seconds']} s, run {h['run_seconds']} s, peak RSS "
             f"{_gb(h['peak_rss_bytes'])}; max |diff| vs 2 {h['max_abs_diff']:.3g}, bound {h['bound']:.3g} "
             f"(ratio {h['ratio_to_bound']:.3f}, L={h['layers']}, max|logit| {h['max_abs_logit']:.3g}); "
             f"argmax agree {h['argmax_agree']}/{len(h['argmax_kvfold'])}; expert pages read unwritten "
             f"{h['expert_pages']['read_unwritten']}")
    return "\n".join([head, one, two, three, "checks: " + ", ".join(f"{k}={v}" for k, v in out["checks"].items())])


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(R.RELEASES), required=True)
    p.add_argument("--tokens", type=int, default=4, help="prompt length (default 4)")
    p.add_argument("--decode", type=int, default=2, help="greedy decode steps after the prefill (default 2)")
    p.add_argument("--layers", type=int, default=None, help="the checkpoint's layers (default the bench's, 4)")
    p.add_argument("--seed", type=int, default=0, help="the prompt's seed")
    p.add_argument("--cache-dir", default=None, help="where the bench checkpoints are (default ~/.cache/kvfold)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--sparse-embedding", action="store_true",
                   help="in the fp32 models, write only the fed tokens' embedding rows (saves ~2 GB)")
    p.add_argument("--wait", type=float, default=1800, help="seconds to wait for free memory before giving up")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = R.ensure_real_checkpoint(args.config, args.layers, args.cache_dir, log=log)
    vocab = R.real_config(args.config, args.layers).vocab_size
    prompt = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    out = {"config": args.config, "checkpoint": str(ckpt), "layers": R.real_config(args.config, args.layers)
           .num_hidden_layers, "tokens": args.tokens, "decode": args.decode, "prompt": prompt,
           "threads": torch.get_num_threads(), "sparse_embedding": args.sparse_embedding}
    stored = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    wait_for_memory(stored + (2 << 30), "the quantized model", args.wait)
    q_logits, tokens, routed, sparse, need = quantized_phase(args, ckpt, prompt, out)
    out["fed_tokens"], out["fp32_model_bytes"] = tokens, need
    wait_for_memory(max(need, stored) + (2 << 30), "the fp32 model", args.wait)
    model, kv_logits = dequantized_phase(args, ckpt, q_logits, tokens, routed, sparse, out)
    held = {"model": model}
    del model
    transformers_phase(args, held, kv_logits, tokens, routed, out)
    out["checks"] = checks(out)
    print(report(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token with a shared prefix: cold, a hit in memory, and a hit from the prefix
cache's disk tier after a restart (kvfold/engine/disk_cache.py).

    .venv/bin/python bench/disk_cache.py --model tiny --prefix 8192,32768 --repeats 3

For each prefix length P: prompt A = P random tokens + 64 more, prompt B = the same P + 64 others.
  cold    a fresh engine without a prefix cache runs B;
  memory  an engine that ran A runs B (its memory tier holds A's block at P);
  disk    an engine that ran A writes its cache to disk (`flush_prefix_cache`, what a clean
          shutdown does) and a new engine over the same directory, memory empty, runs B.
TTFT is from add_request to the step that returns B's first token; the model object is loaded
once (a restart's load time is not in it). The three run alternately, `--repeats` times each;
the report gives min / median / max and the ratios of the medians.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

import kvfold
from kvfold import Engine, SamplingParams

SP = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    rid = engine.add_request(prompt, SP)
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                cached = out.cached_tokens
                took = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return took, cached
    raise RuntimeError("no token")


def one_round(model, a: list[int], b: list[int], max_seq_len: int) -> dict[str, tuple[float, int]]:
    kw = dict(max_seq_len=max_seq_len, max_running=1, prefix_cache_bytes=4 << 30)
    out = {"cold": ttft(Engine(model, max_seq_len=max_seq_len, max_running=1, prefix_cache_bytes=0), b)}
    warm = Engine(model, **kw)
    ttft(warm, a)
    out["memory"] = ttft(warm, b)
    with tempfile.TemporaryDirectory() as d:
        first = Engine(model, cache_dir=d, cache_disk_bytes=8 << 30, **kw)
        ttft(first, a)
        start = time.perf_counter()
        first.flush_prefix_cache()
        flush_s = time.perf_counter() - start
        del first
        out["disk"] = ttft(Engine(model, cache_dir=d, cache_disk_bytes=8 << 30, **kw), b)
        out["flush"] = (flush_s, 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefix", default="8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = kvfold.load_model(args.model)
    ttft(Engine(model, max_seq_len=512, prefix_cache_bytes=0), list(range(3, 300)))  # builds and loads the kernels
    g = torch.Generator().manual_seed(0)
    report = {"model": args.model, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "state_bytes_per_token": model.state_bytes_per_token(), "cells": {}}
    for p in (int(x) for x in args.prefix.split(",")):
        vocab = model.config.vocab_size
        prefix = torch.randint(3, vocab, (p,), generator=g).tolist()
        a = prefix + torch.randint(3, vocab, (64,), generator=g).tolist()
        b = prefix + torch.randint(3, vocab, (64,), generator=g).tolist()
        runs = [one_round(model, a, b, p + 128) for _ in range(args.repeats)]
        cell = {}
        for kind in ("cold", "memory", "disk", "flush"):
            times = [r[kind][0] for r in runs]
            cell[kind] = {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times),
                          "cached_tokens": runs[0][kind][1]}
        cell["cold_over_memory"] = cell["cold"]["median_s"] / cell["memory"]["median_s"]
        cell["cold_over_disk"] = cell["cold"]["median_s"] / cell["disk"]["median_s"]
        report["cells"][p] = cell
        print(f"prefix {p}: " + ", ".join(f"{k} {cell[k]['median_s'] * 1000:.0f} ms "
                                          f"({cell[k]['min_s'] * 1000:.0f}-{cell[k]['max_s'] * 1000:.0f}; "
                                          f"cached {cell[k]['cached_tokens']})" for k in ("cold", "memory", "disk"))
              + f"; flush {cell['flush']['median_s'] * 1000:.0f} ms; cold/memory {cell['cold_over_memory']:.1f}x, "
                f"cold/disk {cell['cold_over_disk']:.1f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

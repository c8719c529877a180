"""Decode speed of DeepSeek-V4 sharded over tensor-parallel ranks (kvfold/parallel), CPU, gloo,
one thread per rank, against one process, in one run:

    .venv/bin/python bench/tensor_parallel.py [--config medium] [--steps 64] [--reps 3]

Each setting runs in freshly spawned processes: load the config's random checkpoint (the bench's
cache, `kvfold bench` builds it), prefill 64 tokens, 8 warm-up decode steps, then `--steps` timed
decode steps; a rep's figure is the median step. Settings alternate within each repetition; the
table gives the median over reps of tok/s, the spread (min-max) and the ratio to TP = 1 with one
thread. Also printed: the bytes each rank contributes to the all-reduces per decoded token.
"""
import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _rank(rank, size, threads, ckpt, out, steps):
    import torch
    import torch.distributed as dist
    import kvfold
    torch.set_num_threads(threads)
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/rdv", rank=rank, world_size=size,
                                timeout=timedelta(seconds=120))
    model = kvfold.load_model(ckpt, tp=size)
    ids = torch.randint(0, model.config.vocab_size, (64 + 8 + steps,), generator=torch.Generator().manual_seed(0))
    st = model.new_state(capacity=ids.numel() + 1)
    model.forward(ids[:64], st, last_only=True)
    for i in range(8):
        model.forward(ids[64 + i:65 + i], st)
    before = model.tp.reduced_bytes if model.tp is not None else 0
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        model.forward(ids[72 + i:73 + i], st)
        times.append(time.perf_counter() - t0)
    reduced = (model.tp.reduced_bytes - before) / steps if model.tp is not None else 0
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(dict(step=statistics.median(times), reduced=reduced)))
    if size > 1:
        dist.destroy_process_group()


def run(size, threads, ckpt, steps):
    with tempfile.TemporaryDirectory() as out:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, size, threads, ckpt, out, steps)) for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return json.loads(Path(out, "result.json").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="medium")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from kvfold.bench.configs import ensure_checkpoint
    ckpt = str(ensure_checkpoint(args.config))
    settings = [("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread per rank", 2, 1)]
    res = {name: [] for name, _, _ in settings}
    reduced = 0
    for _ in range(args.reps):
        for name, size, threads in settings:
            r = run(size, threads, ckpt, args.steps)
            res[name].append(1.0 / r["step"])
            reduced = max(reduced, r["reduced"])
    base = statistics.median(res[settings[0][0]])
    print(f"config {args.config}, {args.steps} decode steps after 64 prompt tokens, {args.reps} reps")
    print("| setting | decode tok/s (median) | spread | vs TP=1, 1 thread |")
    print("|---|---|---|---|")
    for name, _, _ in settings:
        v = res[name]
        print(f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} | {statistics.median(v) / base:.2f}x |")
    print(f"all-reduced per decoded token, per rank: {reduced:.0f} B")


if __name__ == "__main__":
    main()

"""What batch invariance costs: the same model, prompt and decode, with the mode on and off, side by
side in one process, interleaved repetitions, the same threads.

    .venv/bin/python bench/invariance.py [--config bench] [--context 512] [--decode 64] [--reps 5] [--threads 1,2]

Prints, per thread count, the median and the min-max of prefill and decode tok/s in each mode and
the invariant / default ratio of the medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvfold
from kvfold.bench.configs import ensure_checkpoint


def one_run(model, ids: torch.Tensor, decode: int) -> tuple[float, float]:
    state = model.new_state(capacity=ids.numel() + decode + 1)
    t0 = time.perf_counter()
    logits = model.forward(ids, state, last_only=True)
    prefill = ids.numel() / (time.perf_counter() - t0)
    steps = []
    tok = int(logits.argmax())
    for _ in range(decode):
        t0 = time.perf_counter()
        logits = model.forward([tok], state, last_only=True)
        steps.append(time.perf_counter() - t0)
        tok = int(logits.argmax())
    state.free()
    return prefill, 1.0 / statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="bench")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    model = kvfold.load_model(str(ensure_checkpoint(args.config)))
    ids = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    print(f"config {args.config}, context {args.context}, decode {args.decode} steps, {args.reps} interleaved "
          f"repetitions after one warm-up each; torch {torch.__version__}")
    for n in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(n)
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for rep in range(args.reps + 1):
            for on in (False, True):
                model.set_batch_invariant(on)
                r = one_run(model, ids, args.decode)
                if rep:  # the first round warms both modes up
                    runs[on].append(r)
        med = {on: [statistics.median(r[i] for r in runs[on]) for i in (0, 1)] for on in runs}
        for i, what in enumerate(("prefill", "decode")):
            cells = []
            for on in (False, True):
                vals = [r[i] for r in runs[on]]
                cells.append(f"{'invariant' if on else 'default':>9} {med[on][i]:8.1f} tok/s "
                             f"[{min(vals):.1f}-{max(vals):.1f}]")
            print(f"threads {n} {what:>7}: {cells[0]} | {cells[1]} | invariant/default {med[True][i] / med[False][i]:.2f}")


if __name__ == "__main__":
    main()

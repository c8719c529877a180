"""Where a decode step's time goes: `python -m kvfold.bench.profile --config bench --context 512`.

Builds the named bench config with its cached random checkpoint (as `kvfold bench` does), prefills
`--context` tokens, then decodes `--steps` greedy tokens three times:

1. plain, timed with `perf_counter` (the wall time per token a user sees);
2. with exclusive-time wrappers around the model's pieces (monkeypatched here, for this run
   only; the library is not changed): attention core (`Attention._attend`), indexer
   (`Indexer.queries` + `select`), compressors (`Compressor.project` + `fold`, the indexer's own
   compressor included),
   attention projections (the rest of `Attention.forward`: q/kv projections, rope, window ring,
   output projections), MoE (`MoE.forward`), mHC (collapse / expand / head), norms (`Norm`),
   lm_head / embedding. A piece's time excludes the wrapped pieces it calls, so the categories
   never overlap; "other" is the wrapped run's wall time minus their sum (Python glue in
   `Block` / `forward`, argmax, wrapper overhead);
3. under `torch.profiler`, counting aten ops per token (all, and those called directly from
   Python, i.e. not from inside another aten op), overall, by category and by name.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter, defaultdict
from typing import Callable

CATEGORIES = ("attention core", "indexer select", "compressors", "attention projections", "moe", "mhc",
              "norms", "lm_head/embedding")
OTHER = "other"


class _Timer:
    """Exclusive time per category over nested wrapped calls."""

    def __init__(self, record_functions: bool = False):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.stack: list[list[float]] = []  # per open call: [children's time]
        self.record_functions = record_functions

    def wrap(self, fn: Callable, category: str) -> Callable:
        import torch

        def wrapped(*args, **kwargs):
            rf = torch.profiler.record_function("kvfold::" + category) if self.record_functions \
                else contextlib.nullcontext()
            self.stack.append([0.0])
            t0 = time.perf_counter()
            try:
                with rf:
                    return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                child = self.stack.pop()[0]
                self.totals[category] += dt - child
                self.calls[category] += 1
                if self.stack:
                    self.stack[-1][0] += dt
        return wrapped


@contextlib.contextmanager
def instrumented(model, timer: _Timer):
    """Wrap the model's pieces (classes for the per-layer modules, the instances for lm_head and the
    embedding); restores everything on exit."""
    from ..models.deepseek_v4.attention import Attention
    from ..layers.basic import Norm
    from ..models.deepseek_v4.compressor import Compressor
    from ..models.deepseek_v4.indexer import Indexer
    from ..layers.mhc import HyperConnection, HyperHead
    from ..layers.moe import MoE

    patches = []  # (owner, name, original value in owner.__dict__ or None)

    def patch(owner, name: str, category: str, static: bool = False) -> None:
        had = name in vars(owner)
        orig = vars(owner)[name] if had else None
        fn = getattr(owner, name)
        new = timer.wrap(fn, category)
        setattr(owner, name, staticmethod(new) if static else new)
        patches.append((owner, name, had, orig))

    patch(Attention, "_attend", "attention core")
    patch(Attention, "forward", "attention projections")
    patch(Indexer, "queries", "indexer select")
    patch(Indexer, "select", "indexer select")
    patch(Compressor, "project", "compressors")
    patch(Compressor, "fold", "compressors")
    patch(MoE, "forward", "moe")
    patch(HyperConnection, "collapse", "mhc")
    patch(HyperConnection, "expand", "mhc", static=True)
    patch(HyperHead, "forward", "mhc")
    patch(Norm, "forward", "norms")
    patch(model.lm_head, "forward", "lm_head/embedding")
    patch(model.model.embed_tokens, "forward", "lm_head/embedding")
    try:
        yield timer
    finally:
        for owner, name, had, orig in reversed(patches):
            if had:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)


def _decode(model, state, tok: int, steps: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(model.forward([tok], state)[-1].argmax())
    return tok, time.perf_counter() - t0


def profile_decode(model, context: int, steps: int = 32, warmup: int = 4, seed: int = 0,
                   aten: bool = True) -> dict:
    """Prefill `context` random tokens into a fresh state, then profile decode (see module doc).
    Returns {"wall_ms", "instrumented_wall_ms", "categories": {name: ms/token}, "calls": {name:
    calls/token}, "aten_ops", "aten_top_level_ops", "aten_by_category", "aten_by_name"}."""
    import torch
    from .cell import input_ids

    ids = input_ids(context, model.config.vocab_size, seed)
    state = model.new_state(capacity=context + warmup + 3 * steps + 8)
    tok = int(model.forward(ids, state, last_only=True)[-1].argmax())
    tok, _ = _decode(model, state, tok, warmup)

    tok, wall = _decode(model, state, tok, steps)
    timer = _Timer()
    with instrumented(model, timer):
        tok, wall_i = _decode(model, state, tok, steps)
    cats = {c: timer.totals.get(c, 0.0) / steps * 1e3 for c in CATEGORIES}
    cats[OTHER] = max(0.0, wall_i / steps * 1e3 - sum(cats.values()))
    res = {"context": context, "steps": steps, "threads": torch.get_num_threads(),
           "wall_ms": wall / steps * 1e3, "instrumented_wall_ms": wall_i / steps * 1e3,
           "categories": cats, "calls": {c: timer.calls.get(c, 0) / steps for c in CATEGORIES}}
    if aten:
        res.update(_count_aten(model, state, tok, steps))
    state.free()
    return res


def _count_aten(model, state, tok: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    timer = _Timer(record_functions=True)
    with instrumented(model, timer), profile(activities=[ProfilerActivity.CPU]) as prof:
        _decode(model, state, tok, steps)
    label = {"kvfold::" + c: c for c in CATEGORIES}
    total = top = 0
    by_cat: Counter = Counter()
    by_name: Counter = Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        total += 1
        parent, cat, nested = ev.cpu_parent, OTHER, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
            elif parent.name in label:
                cat = label[parent.name]
                break
            parent = parent.cpu_parent
        if not nested:
            top += 1
            by_cat[cat] += 1
            by_name[ev.name] += 1
    return {"aten_ops": total / steps, "aten_top_level_ops": top / steps,
            "aten_by_category": {c: by_cat.get(c, 0) / steps for c in (*CATEGORIES, OTHER)},
            "aten_by_name": {n: c / steps for n, c in by_name.most_common()}}


def format_profile(res: dict, top_ops: int = 15) -> str:
    wall_i = res["instrumented_wall_ms"]
    lines = [f"decode at context {res['context']}, {res['steps']} steps, {res['threads']} thread(s): "
             f"{res['wall_ms']:.2f} ms/token plain ({1e3 / res['wall_ms']:.1f} tok/s), "
             f"{wall_i:.2f} ms/token instrumented",
             f"{'category':<24}{'ms/token':>10}{'%':>8}{'calls/tok':>11}"
             + (f"{'aten ops/tok':>14}" if "aten_by_category" in res else "")]
    for c in (*CATEGORIES, OTHER):
        ms = res["categories"][c]
        row = f"{c:<24}{ms:>10.3f}{100 * ms / wall_i:>7.1f}%{res['calls'].get(c, 0):>11.1f}"
        if "aten_by_category" in res:
            row += f"{res['aten_by_category'][c]:>14.1f}"
        lines.append(row)
    lines.append(f"{'total (instrumented)':<24}{wall_i:>10.3f}{100.0:>7.1f}%")
    if "aten_ops" in res:
        lines.append(f"aten ops per token: {res['aten_top_level_ops']:.1f} called from Python, "
                     f"{res['aten_ops']:.1f} including nested")
        top = list(res["aten_by_name"].items())[:top_ops]
        lines.append("  " + ", ".join(f"{n[6:]} {c:.0f}" for n, c in top))
    return "\n".join(lines)


def main(argv=None) -> int:
    from .configs import config_names
    p = argparse.ArgumentParser(prog="python -m kvfold.bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=config_names(include_test=True), default="bench")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="random checkpoint cache (default as `kvfold bench`)")
    p.add_argument("--no-aten", action="store_true", help="skip the torch.profiler op count")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    from .. import load_model
    from .configs import ensure_checkpoint
    model = load_model(str(ensure_checkpoint(args.config, args.cache_dir, args.seed)))
    res = profile_decode(model, args.context, args.steps, args.warmup, args.seed, aten=not args.no_aten)
    res["config"] = args.config
    print(format_profile(res))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decode step's time goes: `python -m kvfold.bench.profile --config bench --context 512`.

Builds the named bench config with its cached random checkpoint (as `kvfold bench` does), prefills
`--context` tokens, then decodes `--steps` greedy tokens three times:

1. plain, timed with `perf_counter` (the wall time per token a user sees);
2. with exclusive-time probes on the model's pieces (the categories below). While probes are on,
   a decode row runs op by op instead of as one native call (`probes` turns the model's fused
   decode off, `set_fused_decode(False)`, so that every probed module's forward runs), so the
   categories split the per-op path, whose wall time is the instrumented one; the plain run is
   the fused call. A piece's time
   excludes the probed pieces it calls, so the categories never overlap; "other" is the probed
   run's wall time minus their sum (Python glue in `forward` outside the blocks, argmax, probe
   overhead);
3. under `torch.profiler`, counting aten ops per token (all, and those called directly from
   Python, i.e. not from inside another aten op), overall, by category and by name (each probe
   opens a `torch.profiler.record_function("kvfold::<category>")` range in this run).

How the probes attach (`probes(model, timer)`; everything is removed when the run ends, and no
class of the library is changed):

* nn.Module units, through torch's public hook API on the profiled model's own instances:
  `Module.register_forward_pre_hook` opens the unit, `Module.register_forward_hook(...,
  prepend=True, always_call=True)` closes it (also when the forward raises); the handles'
  `remove()` detaches them. The units (`MODULE_UNITS`, found by the model's attribute names,
  which mirror the checkpoint's tensor names, not by import paths):
    attention projections  each layer's `self_attn` (what of its forward is in no other unit:
                           q/kv projections, rope, window ring, output projections; where
                           they run fused in one native call (native_attention.py), the
                           compressors' and the indexer's projections too);
    moe                    each layer's `mlp` (router, routed and shared experts);
    mhc                    each layer (`Block`: its own time is the mHC collapses / expands, the
                           block's few lines of glue and the dispatch of its four sub-units; its
                           norms, attention and MoE are their own units) and `model.hc_head`;
    norms                  every module of `model.norm`'s class (`Norm`: the layers', the
                           attention's q/kv norms, the compressors' entry norms);
    lm_head/embedding      `lm_head` and `model.embed_tokens`.
  A hooked call takes torch's slower `Module.__call__` path (a few microseconds); the part of
  that outside the unit's own hooks counts in the unit that called it.
* steps inside a module's forward, through the scopes the model marks them with
  (`kvfold.profiling.scope(name)`, a no-op while no profiler listens; `probes` listens with
  `profiling.listening(timer)`): attention core (each sequence's attention; a decode row that
  runs in one native call, native_attention.py's `sequence_row`, counts its folds and top-k here
  too), compressors (the compressors' and the indexer's folds, and their projections, where
  those run per op), indexer select (top-k, and the index queries, where they run per op).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter, defaultdict
from typing import Any, Iterator

from .. import profiling

CATEGORIES = ("attention core", "indexer select", "compressors", "attention projections", "moe", "mhc",
              "norms", "lm_head/embedding")
OTHER = "other"

# nn.Module units, probed with forward hooks: (path, category). "[i]" = every element of a
# ModuleList; "class of P" = every module of the model whose class is that of the module at P.
MODULE_UNITS = (("model.layers[i]", "mhc"), ("model.hc_head", "mhc"),
                ("model.layers[i].self_attn", "attention projections"), ("model.layers[i].mlp", "moe"),
                ("class of model.norm", "norms"),
                ("lm_head", "lm_head/embedding"), ("model.embed_tokens", "lm_head/embedding"))
def _resolve(model, path: str) -> list:
    """The modules at `path` ("model.layers[i].self_attn": one per layer; absent ones skipped)."""
    found = [model]
    for part in path.split("."):
        each = part.endswith("[i]")
        name = part[:-3] if each else part
        nxt = []
        for m in found:
            v = getattr(m, name, None)
            if v is not None:
                nxt += list(v) if each else [v]
        found = nxt
    return found


class _Timer:
    """Exclusive time per category over nested units: `enter(category)` ... `exit()`."""

    def __init__(self, record_functions: bool = False):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.open: list[list[Any]] = []  # per open unit: [category, record_function | None, children's time, t0]
        self.record_functions = record_functions

    def enter(self, category: str) -> None:
        rf = None
        if self.record_functions:
            import torch
            rf = torch.profiler.record_function("kvfold::" + category)
            rf.__enter__()
        self.open.append([category, rf, 0.0, time.perf_counter()])

    def exit(self) -> None:
        t1 = time.perf_counter()
        category, rf, child, t0 = self.open.pop()
        if rf is not None:
            rf.__exit__(None, None, None)
        dt = t1 - t0
        self.totals[category] += dt - child
        self.calls[category] += 1
        if self.open:
            self.open[-1][2] += dt


def _module_units(model) -> list[tuple[Any, str]]:
    """(module, category) for the modules MODULE_UNITS names, each once."""
    units: dict[int, tuple[Any, str]] = {}
    for path, category in MODULE_UNITS:
        if path.startswith("class of "):
            classes = {type(m) for m in _resolve(model, path[len("class of "):])}
            found = [m for m in model.modules() if type(m) in classes]
        else:
            found = _resolve(model, path)
        for m in found:
            units.setdefault(id(m), (m, category))
    return list(units.values())


def _hook(module, category: str, timer: _Timer) -> list:
    """Forward pre-hook + forward hook that bracket `module`'s forward as one `category` unit."""
    def opened(mod, args) -> None:
        timer.enter(category)

    def closed(mod, args, output) -> None:
        timer.exit()

    return [module.register_forward_pre_hook(opened),  # the last pre-hook: nearest the forward
            module.register_forward_hook(closed, prepend=True, always_call=True)]


@contextlib.contextmanager
def probes(model, timer: _Timer) -> Iterator[_Timer]:
    """Attach the probes of the module doc to `model` for the duration of the block, its fused
    decode off (a fused call would skip the probed modules' forwards, and their hooks)."""
    handles: list = []
    fused = model.fused_decode
    try:
        model.set_fused_decode(False)
        for module, category in _module_units(model):
            handles += _hook(module, category, timer)
        with profiling.listening(timer):
            yield timer
    finally:
        for h in handles:
            h.remove()
        model.set_fused_decode(fused)


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
    with probes(model, timer):
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
    with probes(model, timer), profile(activities=[ProfilerActivity.CPU]) as prof:
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
    p.add_argument("--weights", choices=("dequant", "quantized"), default="dequant",
                   help="quantized: the checkpoint converted to the official FP8 / FP4 layout, kept as stored")
    p.add_argument("--no-aten", action="store_true", help="skip the torch.profiler op count")
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    from .. import load_model
    from .configs import ensure_checkpoint, ensure_official_checkpoint
    ckpt = ensure_checkpoint(args.config, args.cache_dir, args.seed)
    if args.weights == "quantized":
        ckpt = ensure_official_checkpoint(ckpt)
    model = load_model(str(ckpt), weights=args.weights)
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

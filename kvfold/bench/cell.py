"""One benchmark cell, run in a fresh process: `python -m kvfold.bench.cell --mode kvfold ...`.

Modes: `kvfold` / `transformers` (load, warm up, prefill `--context` tokens, decode
`--decode-tokens` greedy tokens), `sanity` (load both engines, check transformers loads every
tensor and that both give the same logits on a short prompt and a few decode steps),
`bandwidth` (memory copy and streaming-read bandwidth) and `loadtime` (the time to read the
checkpoint's files, or to load the model, from a cold or a warm page cache; measure.py).

The process reports by printing lines `@@kvfold-bench {json}` to stdout: one per finished phase
(`loaded`, `prefill`, ...) and a final one with `"phase": "done"` or `"phase": "error"`, so a
parent that kills it on a time limit still has the phases that finished. Its private data (heap
and anonymous mappings) is capped with RLIMIT_DATA (`--mem-limit-bytes`) so a too-large
allocation fails here as an "out of memory" instead of taking the machine down. The cap leaves
out file mappings: a memory-mapped checkpoint of 16 GB plus the weights it loads would exceed an
address-space cap (RLIMIT_AS) on a 24 GB machine while using 17 GB.
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import traceback

from .measure import measure_copy_bandwidth  # noqa: F401 - its old home; tests import it from here
from .protocol import MARK
_KIB = 1024


def emit(phase: str, **data) -> None:
    data["phase"] = phase
    sys.stdout.write(MARK + json.dumps(data) + "\n")
    sys.stdout.flush()


# ---- memory accounting ---------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * _KIB


def max_rss() -> int:
    """Peak resident bytes of this process so far (since the last `reset_peak_rss`)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * _KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB  # Linux: KiB


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0, /proc/self/clear_refs).
    Returns False where that is not possible; peaks then include everything since start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "can't allocate memory", "cannot allocate memory", "not enough memory", "out of memory", "bad_alloc"))


# ---- inputs ------------------------------------------------------------------------------------
def input_ids(length: int, vocab_size: int, seed: int = 0):
    """Deterministic random token ids in [2, vocab) (0 and 1 are bos/eos of the bench configs)."""
    import torch
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(2, vocab_size, (length,), generator=g)


# ---- engines ------------------------------------------------------------------------------------
class KvfoldEngine:
    name = "kvfold"

    def __init__(self, directory: str, dtype: str = "float32", weights: str = "dequant", dot: str = "fp32"):
        import torch

        import kvfold
        self.model = kvfold.load_model(directory, dtype=getattr(torch, dtype), weights=weights, dot=dot)
        self.vocab_size = self.model.config.vocab_size
        self.state = None

    def start(self, capacity: int) -> None:
        self.state = self.model.new_state(capacity=capacity)

    def prefill(self, ids, last_only: bool = False) -> "torch.Tensor":  # noqa: F821 - the last row of logits
        if last_only:  # forward(last_only=True): no T x vocab logits
            logits = self.model.forward(ids, self.state, last_only=True)
        else:
            logits = self.model.forward(ids, self.state)
        last = logits[-1].clone()
        del logits
        return last

    def step(self, token: int):
        return self.model.forward([token], self.state)[-1]

    def finish(self) -> None:
        if self.state is not None:
            self.state.free()
        self.state = None

    def state_bytes(self) -> int | None:
        return None if self.state is None else int(self.state.nbytes)


class TransformersEngine:
    name = "transformers"

    def __init__(self, directory: str, loading_info: bool = False):
        import torch
        from transformers import DeepseekV4ForCausalLM
        kw = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        if loading_info:
            self.model, self.info = DeepseekV4ForCausalLM.from_pretrained(directory, output_loading_info=True, **kw)
        else:
            self.model, self.info = DeepseekV4ForCausalLM.from_pretrained(directory, **kw), None
        self.model.eval()
        self.vocab_size = self.model.config.vocab_size
        self.cache = None

    def start(self, capacity: int) -> None:
        from transformers import DynamicCache
        self.cache = DynamicCache(config=self.model.config)

    def prefill(self, ids, last_only: bool = False):
        import torch
        kw = {"logits_to_keep": 1} if last_only else {}
        with torch.no_grad():
            out = self.model(input_ids=ids[None], past_key_values=self.cache, use_cache=True, **kw)
        self.cache = out.past_key_values
        last = out.logits[0, -1].clone()
        del out
        return last

    def step(self, token: int):
        import torch
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0, -1]

    def finish(self) -> None:
        self.cache = None

    def state_bytes(self) -> int | None:
        import torch
        if self.cache is None:
            return None
        seen, total = set(), 0
        for layer in getattr(self.cache, "layers", []):
            for v in vars(layer).values():
                for t in (v.values() if isinstance(v, dict) else [v]):
                    if isinstance(t, torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        total += t.numel() * t.element_size()
        return total


def _engine(mode: str, directory: str, dtype: str = "float32", weights: str = "dequant", dot: str = "fp32"):
    return KvfoldEngine(directory, dtype, weights, dot) if mode == "kvfold" else TransformersEngine(directory)


# ---- modes ---------------------------------------------------------------------------------------
def run_cell(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.mode == "kvfold":  # imports are not part of the model load time
        import kvfold  # noqa: F401
    else:
        from transformers import DeepseekV4ForCausalLM, DynamicCache  # noqa: F401
    t1 = time.perf_counter()
    eng = _engine(args.mode, args.checkpoint, args.dtype, args.weights, args.dot)
    load_s = time.perf_counter() - t1
    gc.collect()
    load_peak = max_rss()
    resident = {}
    if args.mode == "kvfold":  # bytes the weights occupy per (logical) parameter
        resident = dict(weight_bytes=eng.model.weight_bytes(), parameters=eng.model.num_parameters())
    emit("loaded", import_s=t1 - t0, load_s=load_s, load_peak_rss=load_peak, rss_after_load=current_rss(), **resident)

    ids = input_ids(args.context, eng.vocab_size, args.seed)
    if args.warmup > 0:  # one short prefill + 2 steps: lazy inits, allocator, first-call costs
        w = min(args.warmup, args.context)
        eng.start(w + 4)
        tok = int(eng.prefill(ids[:w], last_only=args.prefill_logits == "last").argmax())
        for _ in range(2):
            tok = int(eng.step(tok).argmax())
        eng.finish()
        gc.collect()

    rss_before = current_rss()
    peak_reset = reset_peak_rss()
    samples = []  # seconds of each timed prefill, each on a fresh state; decode goes on from the last
    if args.context_fill == "synthetic":  # decode timing only: the state at `context` with random rows
        from .synthetic_context import fill
        eng.start(args.context + args.decode_tokens + 8)
        fill(eng.state, args.context, args.seed)
        last = eng.step(int(ids[-1]))
    else:
        for run in range(max(1, args.prefill_runs)):
            if run:
                eng.finish()
            eng.start(args.context + args.decode_tokens + 8)
            t2 = time.perf_counter()
            last = eng.prefill(ids, last_only=args.prefill_logits == "last")
            samples.append(time.perf_counter() - t2)
    # the median run, as the peers' cells report theirs (llama-bench's -r, flyweight's repetitions)
    prefill_s = sorted(samples)[len(samples) // 2] if samples else None
    prefill_peak = max_rss()
    tok = int(last.argmax())
    emit("prefill", context=args.context, prefill_s=prefill_s, prefill_samples_s=samples,
         prefill_tok_s=args.context / prefill_s if prefill_s else None, context_fill=args.context_fill,
         rss_before_prefill=rss_before, prefill_peak_rss=prefill_peak, peak_reset=peak_reset,
         state_bytes_after_prefill=eng.state_bytes(), first_token=tok)

    reset_peak_rss()
    tokens, steps = [tok], []
    t3 = time.perf_counter()
    for _ in range(args.decode_tokens):
        s0 = time.perf_counter()
        tok = int(eng.step(tok).argmax())
        steps.append(time.perf_counter() - s0)
        tokens.append(tok)
    decode_s = time.perf_counter() - t3
    steps_sorted = sorted(steps)
    median = steps_sorted[len(steps) // 2] if steps else None
    # the spread of the steps: the 10th and 90th percentile step times
    p10, p90 = (steps_sorted[len(steps) // 10], steps_sorted[(9 * len(steps)) // 10]) if steps else (None, None)
    emit("done", decode_tokens=args.decode_tokens, decode_s=decode_s,
         decode_tok_s=(args.decode_tokens / decode_s) if steps else None,
         decode_step_median_s=median, decode_step_min_s=steps_sorted[0] if steps else None,
         decode_step_p10_s=p10, decode_step_p90_s=p90,
         decode_tok_s_median=(1.0 / median) if median else None,
         decode_peak_rss=max_rss(), state_bytes_after_decode=eng.state_bytes(),
         tokens=tokens, ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB)


def run_sanity(args) -> None:
    """transformers loads the checkpoint with no missing/unexpected/mismatched tensors, and its
    logits match kvfold's on a short prompt and on a few greedy decode steps."""
    import torch
    torch.set_num_threads(args.threads)
    kv = KvfoldEngine(args.checkpoint, args.dtype)
    hf = TransformersEngine(args.checkpoint, loading_info=True)
    info = {k: sorted(str(x) for x in v) for k, v in (hf.info or {}).items() if k != "error_msgs"}
    info["error_msgs"] = [str(x) for x in (hf.info or {}).get("error_msgs", [])]
    ids = input_ids(args.context, kv.vocab_size, args.seed)
    kv.start(args.context + args.decode_tokens + 8)
    hf.start(0)
    kv_logits = kv.model.forward(ids, kv.state)
    with torch.no_grad():
        out = hf.model(input_ids=ids[None], past_key_values=hf.cache, use_cache=True)
    hf.cache = out.past_key_values
    hf_logits = out.logits[0]
    prefill_diff = float((kv_logits - hf_logits).abs().max())
    tok = int(kv_logits[-1].argmax())
    step_diffs, same_argmax = [], int(tok == int(hf_logits[-1].argmax()))
    for _ in range(args.decode_tokens):
        a, b = kv.step(tok), hf.step(tok)  # both fed kvfold's greedy token
        step_diffs.append(float((a - b).abs().max()))
        same_argmax += int(int(a.argmax()) == int(b.argmax()))
        tok = int(a.argmax())
    emit("done", tokens=args.context, decode_steps=args.decode_tokens, max_abs_diff_prefill=prefill_diff,
         max_abs_diff_decode=max(step_diffs) if step_diffs else None, logits_scale=float(hf_logits.abs().max()),
         same_argmax=same_argmax, compared_argmax=args.decode_tokens + 1, loading_info=info)


def run_bandwidth(args) -> None:
    from .measure import measure_bandwidth
    emit("done", **measure_bandwidth(args.bandwidth_mib, args.read_mib, args.bandwidth_repeats, args.threads))


def run_loadtime(args) -> None:
    """The time to read the checkpoint's safetensors files (`--what read`) or to load the model
    from them (`--what load`: kvfold.load_model, imports excluded, as the cells' load_s), from a
    cold page cache (every file of the checkpoint evicted first) or a warm one (read once first)."""
    import torch

    from . import measure as M
    torch.set_num_threads(args.threads)
    if args.what == "load":
        import kvfold
    files = M.checkpoint_files(args.checkpoint)
    resident = M.prepare_page_cache(args.checkpoint, args.cache)
    model = None
    t0 = time.perf_counter()
    if args.what == "read":
        nbytes, _ = M.read_files(files)
    else:
        model = kvfold.load_model(args.checkpoint, dtype=getattr(torch, args.dtype), weights=args.weights)
        nbytes = sum(p.stat().st_size for p in files)
    seconds = time.perf_counter() - t0  # before the model is freed: a 16 GB one takes a while to unmap
    emit("done", what=args.what, cache=args.cache, seconds=seconds, bytes=nbytes, files=len(files),
         resident_before=resident, peak_rss=max_rss(),
         weight_bytes=model.weight_bytes() if args.what == "load" else None)


def _set_mem_limit(limit: int) -> None:
    if limit and limit > 0:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfold.bench.cell")
    p.add_argument("--mode", choices=("kvfold", "transformers", "sanity", "bandwidth", "loadtime"), required=True)
    p.add_argument("--checkpoint")
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--decode-tokens", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--mem-limit-bytes", type=int, default=0)
    p.add_argument("--prefill-logits", choices=("all", "last"), default="all")
    p.add_argument("--prefill-runs", type=int, default=1, help="timed prefills, each on a fresh state (the median counts)")
    p.add_argument("--context-fill", choices=("prefill", "synthetic"), default="prefill",
                   help="synthetic (kvfold only): start decode at --context with random state rows, no prefill")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--weights", choices=("dequant", "quantized"), default="dequant")
    p.add_argument("--dot", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--bandwidth-repeats", type=int, default=5)
    p.add_argument("--read-mib", type=int, default=0, help="read-bandwidth buffer (0: 8x the L3, >= 1 GiB)")
    p.add_argument("--what", choices=("read", "load"), default="read")
    p.add_argument("--cache", choices=("cold", "warm"), default="warm")
    args = p.parse_args(argv)
    _set_mem_limit(args.mem_limit_bytes)
    try:
        {"sanity": run_sanity, "bandwidth": run_bandwidth, "loadtime": run_loadtime}.get(args.mode, run_cell)(args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        if isinstance(exc, KeyboardInterrupt):
            raise
        oom = _is_oom(exc)
        emit("error", oom=oom, error=f"{type(exc).__name__}: {exc}"[:2000],
             traceback=traceback.format_exc()[-4000:])
        return 3 if oom else 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

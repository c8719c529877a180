"""`kvfold bench`: prefill / decode throughput and prefill memory of kvfold, optionally against
transformers, on a random checkpoint, over a list of context lengths.

Every cell (engine x context) runs in a fresh `python -m kvfold.bench.cell` process, so its peak
RSS is its own; a cell is killed at `--time-limit` seconds and its private data (not its file
mappings) is capped at `--mem-limit-gib`. Engines alternate per context (kvfold, then
transformers). An engine that ran out of time or memory at one context is not run at longer ones.

Importing this module is cheap (no torch); `add_bench_parser` / `run_bench` are the CLI hooks.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from . import configs as C
from . import llamacpp as LL
from . import vs as VS
from .decode_bytes import per_context
from .deps import require
from .measure import run_load_times
from .protocol import OOM, SKIP_TIME
from .real_shapes import ensure_real_checkpoint, real_config
from .report import _GIB, format_report, summarize
from .spawn import _cell_message, _cell_record, _mem_available, run_subprocess_cell
from ..argtypes import nonneg_int as _nonneg_int, pos_float as _pos_float, pos_int as _pos_int
from ..errors import ConfigError, KvfoldError


# ---- argument parsing ------------------------------------------------------------------------------
def _contexts(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"contexts must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"contexts must be >= 1, got {text!r}")
    return vals


VS_ENGINES = ("transformers",) + VS.PEER_NAMES


def _vs(text: str) -> list[str]:
    """`--vs`: one or more of VS_ENGINES, comma-separated, in a fixed order (transformers first)."""
    names = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in names if x not in VS_ENGINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--vs takes {' and/or '.join(VS_ENGINES)} (comma-separated), got {text!r}")
    return [e for e in VS_ENGINES if e in names]


def _config_name(text: str) -> str:
    if text not in C.config_names(include_test=True):
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(C.PUBLIC_CONFIGS + C.REAL_CONFIGS)}")
    return text


def _add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The peers a run compares with, and where their programs are."""
    p.add_argument("--vs", type=_vs, default=[], metavar="{transformers,llama.cpp,flyweight}",
                   help="also run transformers' DeepseekV4ForCausalLM (eager), llama.cpp (llama-bench, on a GGUF "
                        "converted from the same checkpoint) and/or flyweight-llm (flyweight serve --backend cpu, "
                        "on llama.cpp's GGUF) on the same contexts, comma-separated, e.g. "
                        "--vs llama.cpp,flyweight; a peer that cannot run says why in its cells")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp checkout and/or build directory for --vs llama.cpp: llama-bench is looked for "
                        "in DIR, DIR/bin, DIR/build/bin, convert_hf_to_gguf.py in DIR, its parent or the CMake "
                        "source dir (default $KVFOLD_LLAMA_CPP). bench/get_llama_cpp.sh DIR builds the llama.cpp "
                        "the bench was checked with (the one in the llama-cpp-python 0.3.36 sdist)")
    p.add_argument("--llama-outtype", type=VS.llama_outtypes, default=[LL.GGUF_OUTTYPE], metavar="bf16[,q8_0]",
                   help="the GGUF(s) llama.cpp runs, one llama.cpp engine each: bf16 (engine llama.cpp: every "
                        "matrix but the MXFP4 experts BF16) and/or q8_0 (engine llama.cpp-q8_0: the converter's "
                        "--outtype q8_0, FP8 matrices Q8_0, bf16 ones BF16); flyweight runs on the first "
                        "(default bf16)")
    p.add_argument("--flyweight", default=None, metavar="PATH",
                   help="the flyweight CLI (or a directory holding it) for --vs flyweight (default "
                        "$KVFOLD_FLYWEIGHT, then next to this Python, then PATH)")
    p.add_argument("--llama-bench-args", default="", metavar="ARGS",
                   help="extra llama-bench arguments for every llama.cpp cell, one string, e.g. "
                        "\"--poll 0\" or \"-r 3\" (then the median repetition is reported)")


def add_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", type=_config_name, default="bench", metavar="{bench,medium,v4-flash,glm53-flash}",
                   help="model configuration (random weights): bench = small, every layer kind; "
                        "medium = ~0.9 GB, weight-dominated, adds the memory-bandwidth comparison; v4-flash = "
                        "DeepSeek-V4-Flash's release widths cut to --layers layers, written in the release's "
                        "formats (4 layers: 16 GB; needs --weights quantized); glm53-flash = GLM-5.3-Flash's, "
                        "likewise (4 layers: 11 GB) (default bench)")
    p.add_argument("--layers", type=_pos_int, default=None,
                   help="layers of a real-shape config (default 4: v4-flash every attention and MoE kind, "
                        "glm53-flash 3 KDA + 1 DSA layers, dense and MoE MLPs)")
    p.add_argument("--contexts", type=_contexts, default=[512, 4096, 16384, 32768],
                   help="comma-separated context lengths (default 512,4096,16384,32768)")
    _add_peer_arguments(p)
    p.add_argument("--decode-tokens", type=_nonneg_int, default=128,
                   help="greedy decode steps after each context; kvfold's decode speed is the median step "
                        "(default 128)")
    p.add_argument("--time-limit", type=_pos_float, default=300.0,
                   help="seconds per cell (load + prefill + decode) before it is killed (default 300)")
    p.add_argument("--mem-limit-gib", type=_pos_float, default=20.0,
                   help="private-data cap per cell (RLIMIT_DATA: heap and anonymous mappings, not mapped "
                        "files), GiB; lowered to 90%% of the memory available "
                        "when a cell starts (default 20)")
    p.add_argument("--threads", type=_pos_int, default=2, help="torch threads in every cell (default 2)")
    p.add_argument("--out", default=None, help="JSON results file (default kvfold-bench-<config>.json)")
    p.add_argument("--cache-dir", default=None,
                   help="where the random checkpoint is written and reused (default ~/.cache/kvfold)")
    p.add_argument("--seed", type=int, default=0, help="weights and input seed (default 0)")
    p.add_argument("--warmup", type=_nonneg_int, default=64,
                   help="tokens of an untimed warm-up prefill (+2 decode steps) in each cell (default 64; 0 = none)")
    p.add_argument("--prefill-runs", type=_pos_int, default=3,
                   help="timed prefills in each kvfold and transformers cell, each on a fresh state after the "
                        "warm-up; the median counts, as in the peers' cells (llama-bench -r 3, flyweight's 3 "
                        "repetitions) (default 3)")
    p.add_argument("--context-fill", choices=("prefill", "synthetic"), default="prefill",
                   help="synthetic: kvfold's decode starts at each context from a state filled with random rows "
                        "instead of a prefill (decode's work depends on the position, not the values: long "
                        "contexts in minutes); prefill is then not timed and no peer runs")
    p.add_argument("--prefill-logits", choices=("all", "last"), default="all",
                   help="all = the prefill returns logits for every prompt position (kvfold forward(ids, state), "
                        "transformers default); last = only the last one (kvfold forward(..., last_only=True), "
                        "transformers logits_to_keep=1), as generation needs (default all)")
    p.add_argument("--bandwidth", choices=("auto", "on", "off"), default="auto",
                   help="measure the memory copy and streaming-read bandwidth (same threads) and decode's achieved "
                        "bytes/s as a share of them (auto = medium only)")
    p.add_argument("--load-times", choices=("on", "off"), default="off",
                   help="time reading kvfold's checkpoint files and loading the model from them, with a cold "
                        "(evicted) and a warm page cache, each in a fresh process; target: load <= 1.5x read "
                        "(default off)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="kvfold's weights and activations (transformers stays float32, the reference); "
                        "bfloat16 reports its logits drift in the sanity check (default float32)")
    p.add_argument("--weights", choices=("dequant", "quantized"), default="dequant",
                   help="kvfold's weight residency. quantized: the checkpoint is converted once with `kvfold "
                        "convert --to official --floats bfloat16` (FP8 attention and shared experts, FP4 routed "
                        "experts, bf16 embedding, lm_head and compressors, as the release stores them) and "
                        "loaded with weights='quantized'; llama.cpp's GGUF has the same FP4 experts and bf16 "
                        "matrices either way (default dequant)")
    p.add_argument("--dot", choices=("fp32", "bf16"), default="fp32",
                   help="kvfold's dot product on weights held as stored (with --weights quantized): bf16 rounds "
                        "activations and weights to bf16 and multiplies them in VDPBF16PS's order, as llama.cpp's "
                        "bf16 GGUF path does (load_model's dot=; default fp32)")
    p.add_argument("--no-sanity", action="store_true",
                   help="skip the kvfold-vs-transformers logits check (run once when --vs transformers)")
    return p


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on a `parser.add_subparsers()` object."""
    p = subparsers.add_parser("bench", help="benchmark prefill/decode speed and memory (optionally vs transformers)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return _add_modes(add_bench_arguments(p))


def _add_modes(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The optional mode after `bench`: none = the model benchmark above; `serve` = load the HTTP server."""
    from .serve import __doc__ as serve_doc, add_serve_bench_arguments
    modes = p.add_subparsers(dest="mode", metavar="{serve}", title="modes (optional)")
    s = modes.add_parser("serve", help="load-test the OpenAI-compatible server (kvfold serve), loopback only",
                         description=serve_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_bench_arguments(s)
    return p


def build_parser(prog: str = "python -m kvfold.bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return _add_modes(add_bench_arguments(p))


# ---- main --------------------------------------------------------------------------------------------
def _machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "processor": None,
                            "platform": platform.platform(), "python": platform.python_version(),
                            "loadavg_start": None, "mem_total_gib": 0.0}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["processor"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    import torch
    info["torch"] = torch.__version__
    from ..numerics import native
    from ..numerics.backend import KernelSet
    # the cells' processes build/load the same kernels, and read KVFOLD_NATIVE as this one does
    info["kvfold_native"] = KernelSet.from_env().native and native.available()
    try:
        from importlib.metadata import version
        info["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001
        info["transformers"] = None
    return info


def _command_line(argv: list[str] | None = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    p = Path(argv[0]) if argv else Path("kvfold")
    if p.name == "__main__.py":
        prog = "python -m " + (".".join(p.parent.parts[-2:]) if p.parent.name == "bench" else p.parent.name)
    else:
        prog = p.name
    return " ".join([prog] + [shlex.quote(a) for a in argv[1:]])


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace, log: Callable[[str], None] | None = _log) -> int:
    """Run the benchmark described by parsed `args`; print the report; write the JSON. Returns 0,
    or 1 when a kvfold cell failed or the logits check did not pass. `bench serve` goes to
    `kvfold.bench.serve.run_bench_serve`. Raises MissingPackageError (a KvfoldError) before any
    work when `--vs transformers` is asked for without the transformers package."""
    log = log or (lambda m: None)
    if getattr(args, "mode", None) == "serve":
        from .serve import run_bench_serve
        return run_bench_serve(args, log=log)
    engines = _engines(args)
    if getattr(args, "context_fill", "prefill") == "synthetic" and engines != ["kvfold"]:
        raise ConfigError("--context-fill synthetic times kvfold's decode from a filled state; a peer would be "
                          "timed after a real prefill, so leave out --vs for it")
    if "transformers" in engines:
        require("transformers", "kvfold bench --vs transformers")
    started = _dt.datetime.now(_dt.timezone.utc)
    quantized = args.weights == "quantized"
    if args.dot != "fp32" and not quantized:
        raise ConfigError("--dot bf16 is the dot of weights held as stored: add --weights quantized")
    if args.config in C.REAL_CONFIGS:
        if not quantized:
            raise ConfigError(f"--config {args.config} runs with --weights quantized: its checkpoint is in the "
                              "release's FP8 / FP4 formats, and dequantized it would not fit in memory")
        ckpt = args.kvfold_checkpoint = ensure_real_checkpoint(args.config, getattr(args, "layers", None),
                                                               args.cache_dir, args.seed, log=log)
    else:
        ckpt = C.ensure_checkpoint(args.config, args.cache_dir, args.seed, log=log)
        args.kvfold_checkpoint = C.ensure_official_checkpoint(ckpt, log=log) if quantized else ckpt
    result = _new_result(args, ckpt, engines, started)
    mem_limit = _CellMemLimit(int(args.mem_limit_gib * _GIB))
    if quantized and "transformers" in engines:
        result["sanity"] = {"status": "not run: FP8 / FP4 weights differ from the float reference by design",
                            "passed": None}
    elif "transformers" in engines and not args.no_sanity:
        result["sanity"] = _run_sanity(args, ckpt, mem_limit, log)
    # the GGUFs are made from the checkpoint kvfold's cells load (release layout when quantized)
    peers, peer_info = VS.prepare_peers(args, args.kvfold_checkpoint if quantized else ckpt, engines, log)
    result.update(peer_info)
    if args.bandwidth == "on" or (args.bandwidth == "auto" and args.config == "medium"):
        result["bandwidth"] = _run_bandwidth(args, mem_limit, log)
    if getattr(args, "load_times", "off") == "on":
        result["load_times"] = run_load_times(args.kvfold_checkpoint, weights=args.weights, dtype=args.dtype,
                                              threads=args.threads, time_limit=max(args.time_limit, 120.0),
                                              mem_limit=mem_limit, log=log)
    result["cells"] = _run_cells(args, ckpt, engines, peers, mem_limit, log)
    return _finish(args, result)


def _engines(args: argparse.Namespace) -> list[str]:
    vs = args.vs or []
    vs = _vs(vs) if isinstance(vs, str) else list(vs)
    outtypes = getattr(args, "llama_outtype", None) or [LL.GGUF_OUTTYPE]
    return ["kvfold"] + [e for e in vs if e == "transformers"] + VS.peer_engines(vs, outtypes)


def _prefill_calls(prefill_logits: str) -> dict[str, str]:
    """What each engine's timed prefill call is, for the JSON's settings."""
    last = prefill_logits == "last"
    return {"kvfold": "model.forward(ids, state" + (", last_only=True)" if last else ")  # all T rows of logits"),
            "transformers": "model(input_ids, past_key_values=DynamicCache, use_cache=True"
                            + (", logits_to_keep=1)" if last else ")"),
            "llama.cpp": "llama-bench -p CONTEXT -n 0 -r 3 -t THREADS  # logits of the last token "
                         "only, whatever --prefill-logits (every llama.cpp-<outtype> engine alike)",
            "flyweight": "flyweight serve: a streamed chat request of CONTEXT tokens, timed from its prefill "
                         "admission frame to its last-token frame, median of 3  # logits of the last token only"}


def _new_result(args: argparse.Namespace, ckpt: Path, engines: list[str],
                started: _dt.datetime) -> dict[str, Any]:
    """The JSON result before any cell ran: command, machine, settings, model and its bytes/token."""
    contexts = list(args.contexts)
    if args.config in C.REAL_CONFIGS:
        cfg = real_config(args.config, getattr(args, "layers", None))
    else:
        cfg = C.build_config(args.config)
    kv_ckpt = args.kvfold_checkpoint
    tensors = C.checkpoint_tensor_sizes(ckpt)
    kv_tensors = C.checkpoint_tensor_sizes(kv_ckpt)
    # what kvfold's decode reads: from the checkpoint it loads (FP8 / FP4 bytes and their scales,
    # quantized), its state in the model dtype; term by term with formulas in "decode_bytes"
    per_token, decode_bytes = per_context(cfg, kv_tensors, contexts, 2 if args.dtype == "bfloat16" else 4)
    return {
        "command": getattr(args, "command_line", None) or _command_line(),
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": _machine_info(),
        "settings": {"config": args.config, "contexts": contexts, "engines": engines,
                     "decode_tokens": args.decode_tokens, "time_limit_s": args.time_limit,
                     "mem_limit_gib": args.mem_limit_gib, "threads": args.threads, "seed": args.seed,
                     "warmup_tokens": args.warmup, "prefill_runs": getattr(args, "prefill_runs", 1),
                     "prefill_logits": args.prefill_logits, "kvfold_dtype": args.dtype,
                     "context_fill": getattr(args, "context_fill", "prefill"),
                     "kvfold_weights": args.weights, "kvfold_dot": args.dot,
                     "prefill_call": _prefill_calls(args.prefill_logits)},
        "checkpoint": str(ckpt),
        "kvfold_checkpoint": str(kv_ckpt),
        "model": {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_hf_dict().items()},
                  "parameters": sum(_numel(s) for s, _ in tensors.values()),
                  "weight_bytes": sum(n for _, n in tensors.values()),
                  "kvfold_weight_bytes": sum(n for _, n in kv_tensors.values())},
        "decode_bytes_per_token": per_token,
        "decode_bytes": decode_bytes,
        "cells": [],
    }


class _CellMemLimit:
    """The private-data cap of a cell about to start: --mem-limit-gib, lowered to 90% of the
    memory available at that moment."""

    def __init__(self, cap: int):
        self.cap = cap

    def __call__(self) -> int:
        avail = _mem_available()
        return min(self.cap, int(0.9 * avail)) if avail else self.cap


def _run_sanity(args: argparse.Namespace, ckpt: Path, mem_limit: Callable[[], int],
                log: Callable[[str], None]) -> dict[str, Any]:
    """The transformers-vs-kvfold logits check (one cell running both engines)."""
    n = C.SANITY_TOKENS.get(args.config, 256)
    log(f"sanity check: transformers vs kvfold logits on {n} tokens + 4 decode steps")
    raw = run_subprocess_cell("sanity", checkpoint=str(ckpt), context=n, decode_tokens=4, threads=args.threads,
                              seed=args.seed, time_limit=max(args.time_limit, 120.0),
                              mem_limit_bytes=mem_limit(), extra=["--dtype", args.dtype])
    san = _sanity_record(raw, args.dtype)
    log(f"sanity: {san['status']}" + (f", max diff {san['max_abs_diff']:.2e}" if "max_abs_diff" in san else ""))
    return san


def _sanity_record(raw: dict[str, Any], dtype: str) -> dict[str, Any]:
    # kvfold in bf16 (~3 significant digits per op) cannot match fp32: the check becomes a
    # measurement of its drift, reported but not judged (tolerance None)
    san: dict[str, Any] = {"status": raw["status"], "dtype": dtype,
                           "tolerance": 1e-3 if dtype == "float32" else None}
    d = raw["phases"].get("done")
    if raw["status"] != "ok" or not d:
        san["passed"] = False
        san["detail"] = raw.get("stderr_tail", "")[-2000:]
        return san
    li = d["loading_info"]
    san.update(tokens=d["tokens"], decode_steps=d["decode_steps"],
               max_abs_diff_prefill=d["max_abs_diff_prefill"], max_abs_diff_decode=d["max_abs_diff_decode"],
               logits_scale=d["logits_scale"], same_argmax=d["same_argmax"],
               compared_argmax=d["compared_argmax"],
               missing=len(li.get("missing_keys", [])), unexpected=len(li.get("unexpected_keys", [])),
               mismatched=len(li.get("mismatched_keys", [])), loading_info=li)
    worst = max(d["max_abs_diff_prefill"], d["max_abs_diff_decode"] or 0.0)
    san["max_abs_diff"] = worst
    close = san["tolerance"] is None or worst <= san["tolerance"]
    san["passed"] = close and not (san["missing"] or san["unexpected"] or san["mismatched"])
    return san


def _run_bandwidth(args: argparse.Namespace, mem_limit: Callable[[], int],
                   log: Callable[[str], None]) -> dict[str, Any]:
    log("measuring the copy (512 MiB fp32) and streaming-read (>= 8x the L3, >= 1 GiB) bandwidth")
    raw = run_subprocess_cell("bandwidth", threads=args.threads, time_limit=120.0, mem_limit_bytes=mem_limit(),
                              extra=getattr(args, "bandwidth_extra", None))
    return dict(raw["phases"].get("done") or {}, status=raw["status"])


def _run_cells(args: argparse.Namespace, ckpt: Path, engines: list[str], peers: dict[str, VS.Peer],
               mem_limit: Callable[[], int], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every (context, engine) cell, engines alternating per context. An engine that ran out of
    time or memory at one context is not run at longer ones (they only get worse)."""
    cells: list[dict[str, Any]] = []
    failed_at: dict[str, str] = {}
    for ctx in list(args.contexts):
        for eng in engines:
            if eng in failed_at:
                rec = {"engine": eng, "context": ctx, "status": failed_at[eng], "prefill_status": failed_at[eng],
                       "decode_status": failed_at[eng], "not_run": True}
                log(f"{eng} @ {ctx}: {failed_at[eng]}")
            else:
                rec, hit = (peers[eng].run(args, ctx, mem_limit(), log) if eng in peers
                            else _engine_cell(args, ckpt, eng, ctx, mem_limit, log))
                if not rec.get("not_run"):
                    log(_cell_message(rec))
                if hit:
                    failed_at[eng] = f"{hit} (not run: hit at context {ctx})"
            cells.append(rec)
    return cells


def _engine_cell(args: argparse.Namespace, ckpt: Path, eng: str, ctx: int, mem_limit: Callable[[], int],
                 log: Callable[[str], None]) -> tuple[dict[str, Any], str | None]:
    """One kvfold or transformers cell (a `python -m kvfold.bench.cell` process): (its JSON record,
    SKIP_TIME / OOM if it hit a limit, else None)."""
    log(f"{eng} @ {ctx}: running (limit {args.time_limit:g} s)")
    kvfold = eng == "kvfold"
    raw = run_subprocess_cell(eng, checkpoint=str(args.kvfold_checkpoint if kvfold else ckpt),
                              context=ctx, decode_tokens=args.decode_tokens,
                              threads=args.threads, seed=args.seed, warmup=args.warmup,
                              time_limit=args.time_limit, mem_limit_bytes=mem_limit(),
                              prefill_logits=args.prefill_logits,
                              extra=["--prefill-runs", str(args.prefill_runs)]
                              + (["--dtype", args.dtype, "--weights", args.weights, "--dot", args.dot,
                                  "--context-fill", args.context_fill] if kvfold else []))
    return _cell_record(eng, ctx, raw), (raw["status"] if raw["status"] in (SKIP_TIME, OOM) else None)


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """Summarize, print the report, write the JSON (atomically); the exit status."""
    result["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if hasattr(os, "getloadavg"):
        result["machine"]["loadavg_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    summarize(result)
    report = format_report(result)
    result["report"] = report
    print(report, flush=True)
    out = Path(args.out) if args.out else Path(f"kvfold-bench-{args.config}.json")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out)
    print(f"results written to {out}", flush=True)
    bad = [c for c in result["cells"] if c["engine"] == "kvfold" and "error" in c["status"]]
    if bad or (result.get("sanity") and result["sanity"].get("passed") is False):
        return 1
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    """`python -m kvfold.bench`: as `kvfold bench`, KvfoldError included (message, exit status 2)."""
    args = build_parser().parse_args(argv)
    try:
        return run_bench(args)
    except KvfoldError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

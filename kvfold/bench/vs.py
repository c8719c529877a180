"""The `--vs` peers that are not transformers: llama.cpp (one engine per `--llama-outtype`: `llama.cpp`
for bf16, `llama.cpp-q8_0`, ...) and flyweight, made ready once per run and run cell by cell.

Each peer is either runnable or says why not (`why`): no build / CLI found, a failed conversion, a
model the GGUF path does not know (the peers run DeepSeek-V4 only). A peer that is not runnable
gets an `unavailable: <why>` cell at every context; nothing about a peer stops the run.
Importing this module is cheap (no torch).
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import flyweight as FW
from . import llamacpp as LL
from . import peers as P
from .protocol import OOM, SKIP_TIME
from .spawn import _cpu_pressure_us, child_env

FLYWEIGHT = FW.ENGINE
PEER_NAMES = (LL.ENGINE, FLYWEIGHT)  # what --vs takes besides transformers, in the order they run


def llama_outtypes(text: str) -> list[str]:
    """`--llama-outtype`: one or more of LL.OUTTYPES, comma-separated, in the order given."""
    names = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in names if x not in LL.OUTTYPES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--llama-outtype takes {' and/or '.join(LL.OUTTYPES)} "
                                         f"(comma-separated, each once), got {text!r}")
    return names


def peer_engines(vs: list[str], outtypes: list[str]) -> list[str]:
    """The engines `--vs` names after kvfold and transformers: a llama.cpp engine per output type, then flyweight."""
    out = [LL.engine_name(o) for o in outtypes] if LL.ENGINE in vs else []
    return out + ([FLYWEIGHT] if FLYWEIGHT in vs else [])


def is_peer(engine: str) -> bool:
    return engine == FLYWEIGHT or engine == LL.ENGINE or engine.startswith(LL.ENGINE + "-")


@dataclass
class Peer:
    """One peer engine: `why` it cannot run (None when it can) and how one of its cells runs."""
    engine: str
    why: str | None
    cell: Callable[[argparse.Namespace, int, int, Callable[[str], None]], dict[str, Any]] | None = None

    def run(self, args: argparse.Namespace, ctx: int, mem_limit: int,
            log: Callable[[str], None]) -> tuple[dict[str, Any], str | None]:
        """(its record, SKIP_TIME / OOM if the cell hit a limit, else None); an unavailable record
        when it cannot run."""
        if self.why or self.cell is None:
            rec = P.unavailable_record(self.engine, ctx, self.why or "not prepared")
            log(f"{self.engine} @ {ctx}: {rec['status']}")
            return rec, None
        rec = self.cell(args, ctx, mem_limit, log)
        hit = next((s for s in (rec.get("prefill_status"), rec.get("decode_status"), rec.get("stopped_by"))
                    if s in (SKIP_TIME, OOM)), None)
        return rec, hit


def _llama_cell(found: LL.LlamaCpp, gguf: Path, engine: str, extra: list[str]):
    def cell(args, ctx, mem_limit, log):
        log(f"{engine} @ {ctx}: running llama-bench (limit {args.time_limit:g} s)")
        return LL.run_cell(found, gguf, ctx, decode_tokens=args.decode_tokens, threads=args.threads,
                           time_limit=args.time_limit, mem_limit_bytes=mem_limit, env=child_env(args.threads),
                           pressure=_cpu_pressure_us, extra=extra, engine=engine)
    return cell


def _flyweight_cell(fw: FW.Flyweight, gguf: Path):
    def cell(args, ctx, mem_limit, log):
        log(f"{FLYWEIGHT} @ {ctx}: running flyweight serve (limit {args.time_limit:g} s)")
        return FW.run_cell(fw, gguf, ctx, decode_tokens=args.decode_tokens, threads=args.threads,
                           warmup=args.warmup, time_limit=args.time_limit, mem_limit_bytes=mem_limit,
                           env=child_env(args.threads), pressure=_cpu_pressure_us, seed=args.seed)
    return cell


def _prepare_llama(args: argparse.Namespace, checkpoint: Path, outtypes: list[str], model_problem: str | None,
                   log: Callable[[str], None]) -> tuple[LL.LlamaCpp, dict[str, LL.Gguf], dict[str, Any]]:
    """Locate llama.cpp and convert (or reuse) a GGUF per output type: (the build, the GGUFs, the JSON's
    "llama_cpp" entry). Never raises."""
    found = LL.locate(getattr(args, "llama_cpp", None))
    info: dict[str, Any] = found.describe()
    info["llama_bench_args"] = shlex.split(getattr(args, "llama_bench_args", "") or "")
    info["outtypes"] = list(outtypes)
    ggufs: dict[str, LL.Gguf] = {}
    for o in outtypes:
        why = model_problem or found.problem
        g = LL.Gguf(None, problem=why, outtype=o) if why else LL.ensure_gguf(
            checkpoint, found, outtype=o, time_limit=max(args.time_limit, 3600.0), log=log)
        ggufs[o] = g
        if g.problem:
            log(f"{LL.engine_name(o)}: {g.problem}")
    first = ggufs[outtypes[0]]
    info.update(gguf=str(first.path) if first.path else None, gguf_cached=first.cached, convert_s=first.convert_s,
                pre_tokenizer=LL.PRE_TOKENIZER, problem=model_problem or found.problem or first.problem,
                ggufs={o: g.describe() for o, g in ggufs.items()})
    if first.problem and not (model_problem or found.problem):
        info["conversion_detail"] = first.detail
    return found, ggufs, info


def prepare_peers(args: argparse.Namespace, checkpoint: Path, engines: list[str],
                  log: Callable[[str], None]) -> tuple[dict[str, Peer], dict[str, Any]]:
    """The peer engines among `engines`, ready to run, and their JSON entries ("llama_cpp", "flyweight").
    `checkpoint` is the one the GGUFs are made from (release layout or kvfold's). Never raises."""
    wanted = [e for e in engines if is_peer(e)]
    if not wanted:
        return {}, {}
    outtypes = list(getattr(args, "llama_outtype", None) or [LL.GGUF_OUTTYPE])
    model_problem = P.dsv4_problem(checkpoint)
    found, ggufs, llama_info = _prepare_llama(args, checkpoint, outtypes, model_problem, log)
    peers: dict[str, Peer] = {}
    info: dict[str, Any] = {}
    extra = llama_info["llama_bench_args"]
    for o in outtypes:
        e, g = LL.engine_name(o), ggufs[o]
        if e in wanted:
            why = g.problem or found.problem
            peers[e] = Peer(e, why, None if why else _llama_cell(found, g.path, e, extra))
    if any(e != FLYWEIGHT for e in wanted):
        info["llama_cpp"] = llama_info
    if FLYWEIGHT in wanted:
        peers[FLYWEIGHT], info["flyweight"] = _prepare_flyweight(args, ggufs[outtypes[0]], model_problem, log)
    return peers, info


def _prepare_flyweight(args: argparse.Namespace, gguf: LL.Gguf, model_problem: str | None,
                       log: Callable[[str], None]) -> tuple[Peer, dict[str, Any]]:
    fw = FW.locate(getattr(args, "flyweight", None))
    info = dict(fw.describe(), gguf=str(gguf.path) if gguf.path else None, gguf_outtype=gguf.outtype,
                gguf_detail=gguf.describe())
    why = model_problem or fw.problem
    if why is None and gguf.problem:
        why = f"needs the GGUF llama.cpp's converter writes (--llama-cpp): {gguf.problem}"
    info["problem"] = why
    if why:
        log(f"{FLYWEIGHT}: {why}")
    return Peer(FLYWEIGHT, why, None if why else _flyweight_cell(fw, gguf.path)), info

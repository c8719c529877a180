"""`kvfold doctor`: what this machine can run, and what to fix.

`gather_facts` looks once at the CPU, the native kernels (native.py builds and loads them, as a
model would), torch and CUDA, free memory, the released models' sizes (`kvfold plan` on the configs
shipped in kvfold/assets/configs), the optional extras, and a forward of the built-in tiny model.
Everything after that is pure: `find_problems` judges the facts, `render_text` and `report_json`
print them, so that tests can hand in any facts (a missing compiler, say) without touching the
process's cached native library.

The exit status is 0 when kvfold can serve here as shipped: the tiny model loads and runs a forward
on the CPU, and the native kernels are built and loaded (without them serving falls back to the
slower torch path and gives up batch invariance, the CPU default). Problems of severity "error"
make it 1; "warning" and "note" do not.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "assets" / "configs"
# (name, config in SHIPPED_CONFIGS, `kvfold plan --weights` format the release stores)
RELEASED_MODELS = (("DeepSeek-V4-Flash", "deepseek_v4_flash.json", "fp4"),
                   ("GLM-5.3-Flash", "glm5_3_flash.json", "fp8"))
SEQUENCE_TOKENS = 4096  # one sequence at `kvfold serve`'s default --max-seq-len
# pyproject.toml's optional dependencies (dev aside) and what each extra enables
EXTRAS = {"structured": ("xgrammar",), "bench": ("transformers", "openai", "pyyaml", "tqdm", "flyweight-llm"),
          "gpu": ("triton",)}
EXTRA_USES = {"structured": "structured output (response_format, structured_outputs)",
              "bench": "kvfold bench --vs transformers / llama.cpp / flyweight and kvfold bench serve",
              "gpu": "the Triton kernels on CUDA"}
# /proc/cpuinfo flags shown, and the names they are shown under
_CPU_FLAGS = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512F", "avx512dq": "AVX-512DQ",
              "avx512vl": "AVX-512VL", "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX", "amx_bf16": "AMX-BF16"}
_GIB = 1 << 30
_FORMATS = {"bf16": "bf16", "fp8": "fp8", "fp4": "fp4 experts, fp8 elsewhere"}  # kvfold plan's --weights


@dataclass
class Problem:
    severity: str  # "error" (exit status 1), "warning" or "note"
    problem: str
    fix: str


# ---- facts (the only part that looks at the machine) -------------------------------------------

def gather_facts() -> dict[str, Any]:
    """Every fact the report needs, as plain JSON-able values."""
    import kvfold
    memory = _memory_facts()
    return {"kvfold": kvfold.__version__, "cpu": _cpu_facts(), "native": _native_facts(),
            "torch": _torch_facts(), "memory": memory, "models": _model_facts(memory["available_bytes"]),
            "extras": {extra: {pkg: _version(pkg) for pkg in pkgs} for extra, pkgs in EXTRAS.items()},
            "tiny": _tiny_facts()}


def _cpu_facts() -> dict[str, Any]:
    import torch

    from .server import serving_threads
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first CPU's lines speak for all
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "torch_threads": torch.get_num_threads(), "serve_threads": serving_threads(),
            "flags": {flag: flag in flags for flag in _CPU_FLAGS}}


def _native_facts() -> dict[str, Any]:
    """The kernels as native.py builds them: its ISA setting, compiler and flags; then a load."""
    from .errors import NativeAbiError
    from .numerics import native
    from .numerics.backend import KernelSet
    setting = os.environ.get("KVFOLD_NATIVE_ISA", "native")
    facts: dict[str, Any] = {"enabled": KernelSet.from_env().native, "isa_setting": setting, "isa_error": None,
                             "compiler": None, "compiler_found": False, "build": None, "loaded": False,
                             "library": None, "error": None}
    try:
        isa = native._isa_flags()
    except ValueError as e:
        facts["isa_error"], isa = str(e), []
    # the compiler native._load picks
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    facts["compiler"] = compiler
    facts["compiler_found"] = compiler is not None and shutil.which(compiler) is not None
    if facts["compiler_found"]:
        facts["build"] = _build_isa(compiler, [extra + isa for extra in native._VARIANTS[:-1]] + [[]])
    if not facts["enabled"]:
        return facts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            lib = native.library()
        except (NativeAbiError, ValueError) as e:
            lib, facts["error"] = None, str(e)
    facts["loaded"], facts["library"] = lib is not None, getattr(lib, "_name", None)
    if lib is None and facts["error"] is None:
        facts["error"] = str(caught[-1].message) if caught else "unavailable (reported earlier in this process)"
    return facts


def _build_isa(compiler: str, flag_sets: list[list[str]]) -> dict[str, Any] | None:
    """The instruction sets the kernels are compiled for: the predefined macros of the first of
    native.py's flag variants the compiler accepts, read as the kernels' #if tests read them."""
    for flags in flag_sets:
        try:
            out = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                                 text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        macros = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
        has = lambda *names: all(f"__{n}__" in macros for n in names)  # noqa: E731
        avx512, avx2 = has("AVX512F", "AVX512DQ"), has("AVX2", "FMA")
        return {"flags": flags, "avx2": avx2, "avx512": avx512, "avx512_bf16": has("AVX512BF16"),
                "amx": has("AMX_TILE"), "path": "AVX-512" if avx512 else "AVX2" if avx2 else "portable C"}
    return None


def _torch_facts() -> dict[str, Any]:
    import torch
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU only"
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"})
    return {"version": torch.__version__, "build": build, "cuda_available": torch.cuda.is_available(),
            "devices": devices, "triton": _version("triton"), "nvidia_smi": shutil.which("nvidia-smi")}


def _memory_facts() -> dict[str, Any]:
    """MemAvailable and MemTotal of /proc/meminfo in bytes (None where there is none)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(value.split()[0]) * 1024  # listed in kB
    except (OSError, ValueError, IndexError):
        pass
    return {"available_bytes": found.get("MemAvailable"), "total_bytes": found.get("MemTotal")}


def _model_facts(available: int | None) -> list[dict[str, Any]]:
    """`kvfold plan` of each released model at TP 1 in its release format, against `available`."""
    from .plan import plan
    out = []
    for name, file, fmt in RELEASED_MODELS:
        config = json.loads((SHIPPED_CONFIGS / file).read_text())
        family, parameters, ranks = plan(config, weights=fmt, max_seq_len=SEQUENCE_TOKENS,
                                         device_memory_bytes=available or 0)
        out.append({"name": name, "family": family, "weights_format": fmt, "parameters": parameters,
                    "weight_bytes": ranks[0].weight_bytes, "state_bytes_per_sequence": ranks[0].state_bytes,
                    "sequence_tokens": SEQUENCE_TOKENS, "fits": None if available is None else ranks[0].fits > 0})
    return out


def _tiny_facts() -> dict[str, Any]:
    """Load the built-in tiny model and run one forward (a one-token generation) on the CPU."""
    import torch

    import kvfold
    from .decoding.generate import generate
    from .progress import quieted
    started = time.monotonic()
    try:
        with quieted():
            model = kvfold.load_model("tiny", device="cpu", dtype=torch.float32)
            tok = model.tokenizer
            generate(model, ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("def"), 1)
    except Exception as e:  # whatever stops it is the finding
        return {"ok": False, "seconds": round(time.monotonic() - started, 2), "error": f"{type(e).__name__}: {e}",
                "batch_invariant": None}
    return {"ok": True, "seconds": round(time.monotonic() - started, 2), "error": None,
            "batch_invariant": bool(model.batch_invariant)}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- judgement (pure) --------------------------------------------------------------------------

def find_problems(facts: dict[str, Any]) -> list[Problem]:
    """What is wrong or missing, each with its fix; errors first."""
    found = _serving_problems(facts) + _native_problems(facts["native"]) + _gpu_problems(facts["torch"])
    found += _extra_problems(facts["extras"]) + _model_problems(facts["models"], facts["memory"])
    order = {"error": 0, "warning": 1, "note": 2}
    return sorted(found, key=lambda p: order[p.severity])


def _serving_problems(facts: dict[str, Any]) -> list[Problem]:
    tiny = facts["tiny"]
    if tiny["ok"]:
        return []
    return [Problem("error", f"the built-in tiny model does not load or run on the CPU: {tiny['error']}",
                    "reinstall kvfold (pip install --force-reinstall kvfold) with its dependencies; if the "
                    "error stays, report it with this output (kvfold doctor --json)")]


def _native_problems(native: dict[str, Any]) -> list[Problem]:
    if not native["enabled"]:
        return [Problem("warning", "the native CPU kernels are turned off (KVFOLD_NATIVE=0): the slower torch "
                        "path runs, without batch invariance", "unset KVFOLD_NATIVE")]
    if native["isa_error"]:
        return [Problem("error", native["isa_error"], "set KVFOLD_NATIVE_ISA to native or avx2, or unset it")]
    compiler = native["compiler"]
    if compiler is None:
        return [Problem("error", "no C compiler for the native CPU kernels (cc, gcc or $CC)",
                        "apt-get install gcc (or dnf install gcc; or set CC to a C compiler)")]
    if not native["compiler_found"]:
        return [Problem("error", f"the C compiler CC={compiler} is not an executable",
                        "point CC at a C compiler, or unset it and apt-get install gcc")]
    if not native["loaded"]:
        return [Problem("error", f"the native CPU kernels did not build or load: {native['error']}",
                        f"check that {compiler} builds C with OpenMP (apt-get install gcc libgomp1); "
                        "KVFOLD_NATIVE=0 runs the torch path instead")]
    return []


def _gpu_problems(torch_facts: dict[str, Any]) -> list[Problem]:
    if torch_facts["build"] == "CPU only" and torch_facts["nvidia_smi"]:
        return [Problem("warning", "this machine has nvidia-smi (an NVIDIA GPU?) but torch is a CPU-only build",
                        "install a CUDA build of torch: https://pytorch.org/get-started/locally/")]
    if torch_facts["build"] != "CPU only" and not torch_facts["cuda_available"]:
        return [Problem("warning", f"torch is built for {torch_facts['build']} but sees no GPU",
                        "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")]
    if torch_facts["cuda_available"] and torch_facts["triton"] is None:
        return [Problem("warning", "CUDA is available but Triton is not installed (kvfold's CUDA kernels)",
                        "pip install 'kvfold[gpu]'")]
    return []


def _extra_problems(extras: dict[str, dict[str, str | None]]) -> list[Problem]:
    return [Problem("note", f"{EXTRA_USES[extra]} needs {', '.join(p for p, v in pkgs.items() if v is None)}",
                    f"pip install 'kvfold[{extra}]'")
            for extra, pkgs in extras.items() if any(v is None for v in pkgs.values())]


def _model_problems(models: list[dict[str, Any]], memory: dict[str, Any]) -> list[Problem]:
    if memory["available_bytes"] is None:
        return [Problem("note", "free memory is unknown (no /proc/meminfo): the released models were not sized "
                        "against it", "kvfold plan --config CONFIG sizes a model by hand")]
    return [Problem("note", f"{m['name']} does not fit in this machine's {_gib(memory['available_bytes'])} "
                    f"available ({_gib(m['weight_bytes'])} of weights)",
                    f"shard it over N ranks with --tp (docs/parallelism.md); size N with kvfold plan --config "
                    f"{SHIPPED_CONFIGS / _config_file(m['name'])} --tp N --weights {m['weights_format']}")
            for m in models if m["fits"] is False]


def _config_file(name: str) -> str:
    return next(file for n, file, _ in RELEASED_MODELS if n == name)


def exit_status(problems: list[Problem]) -> int:
    return 1 if any(p.severity == "error" for p in problems) else 0


# ---- rendering (pure) --------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def render_text(facts: dict[str, Any], problems: list[Problem]) -> str:
    """The human-readable report: one section a line (continuations indented), then the problems."""
    lines = [f"kvfold {facts['kvfold']} doctor"]
    lines += _cpu_lines(facts["cpu"]) + _native_lines(facts["native"]) + _torch_lines(facts["torch"])
    lines += _memory_and_model_lines(facts) + _extra_lines(facts["extras"])
    if problems:
        lines.append("problems:")
        for p in problems:
            lines += [f"  {p.severity}: {p.problem}", f"    fix: {p.fix}"]
    status = exit_status(problems)
    lines.append("ready to serve (exit 0)" if status == 0 else "cannot serve as shipped: fix the errors above (exit 1)")
    return "\n".join(lines) + "\n"


def _cpu_lines(cpu: dict[str, Any]) -> list[str]:
    flags = ", ".join(f"{shown} {_yes(cpu['flags'][flag])}" for flag, shown in _CPU_FLAGS.items())
    return [f"cpu:     {cpu['model']}; {cpu['usable_cpus']} of {cpu['logical_cpus']} CPUs usable, torch threads "
            f"{cpu['torch_threads']}, serve threads {cpu['serve_threads']}",
            f"         {flags}"]


def _native_lines(native: dict[str, Any]) -> list[str]:
    state = ("off (KVFOLD_NATIVE=0)" if not native["enabled"] else "loaded" if native["loaded"]
             else "NOT loaded: the torch path runs")
    lines = [f"native:  kernels {state}; KVFOLD_NATIVE_ISA={native['isa_setting']}; compiler "
             f"{native['compiler'] or 'none'}{'' if native['compiler_found'] or not native['compiler'] else ' (not found)'}"]
    build = native["build"]
    if build is not None:
        lines.append(f"         build: {build['path']} paths ({' '.join(build['flags']) or 'no -march'}); compiled with "
                     f"AVX2 {_yes(build['avx2'])}, AVX-512 {_yes(build['avx512'])}, AVX512-BF16 "
                     f"{_yes(build['avx512_bf16'])}, AMX {_yes(build['amx'])}")
    if native["library"]:
        lines.append(f"         library: {native['library']}")
    return lines


def _torch_lines(t: dict[str, Any]) -> list[str]:
    devices = "; ".join(f"cuda:{i} {d['name']} ({_gib(d['memory_bytes'])}, sm {d['capability']})"
                        for i, d in enumerate(t["devices"])) or "none"
    return [f"torch:   {t['version']} ({t['build']}); CUDA devices: {devices}; Triton {t['triton'] or 'not installed'}"]


def _memory_and_model_lines(facts: dict[str, Any]) -> list[str]:
    mem, tiny = facts["memory"], facts["tiny"]
    avail, total = mem["available_bytes"], mem["total_bytes"]
    of_total = f" of {_gib(total)}" if total else ""
    lines = [f"memory:  {_gib(avail) if avail is not None else 'unknown'} available{of_total}"]
    for i, m in enumerate(facts["models"]):
        fit = "unknown" if m["fits"] is None else "fits" if m["fits"] else "does not fit"
        lines.append(f"{'models:' if i == 0 else '':<9}{m['name']} ({m['family']}, {m['parameters'] / 1e9:.1f}B "
                     f"parameters) needs {_gib(m['weight_bytes'])} of weights (as released: "
                     f"{_FORMATS[m['weights_format']]}; --weights quantized keeps them so) + "
                     f"{_gib(m['state_bytes_per_sequence'])} per {m['sequence_tokens']}-token sequence: {fit}")
    lines.append(f"tiny:    loads and runs a forward on the CPU in {tiny['seconds']:.1f} s"
                 f"{' (batch-invariant)' if tiny['batch_invariant'] else ''}" if tiny["ok"]
                 else f"tiny:    FAILED: {tiny['error']}")
    return lines


def _extra_lines(extras: dict[str, dict[str, str | None]]) -> list[str]:
    parts = [f"{extra} (" + ", ".join(f"{p} {v or 'missing'}" for p, v in pkgs.items()) + ")"
             for extra, pkgs in extras.items()]
    return ["extras:  " + "; ".join(parts)]


def report_json(facts: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """The facts, the problems with their fixes, and the verdict, for machines."""
    status = exit_status(problems)
    return {**facts, "problems": [asdict(p) for p in problems], "can_serve": status == 0, "exit_status": status}


# ---- command -----------------------------------------------------------------------------------

def add_doctor_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="check what this machine can run (CPU, native kernels, torch, memory, extras)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run_doctor(args: argparse.Namespace) -> int:
    facts = gather_facts()
    problems = find_problems(facts)
    if args.json:
        print(json.dumps(report_json(facts, problems), indent=2))
    else:
        print(render_text(facts, problems), end="")
    return exit_status(problems)

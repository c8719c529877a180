"""Decode speed of a whole released model on another machine, projected from the real-shape bench
stacks measured here (issue 42 item 4): `python -m kvfold.bench.projection --config v4-flash
--bench-json run-1t.json --bench-json run-2t.json --machine 460:32 ...`.

The model. A decode token reads, per weight format f (bf16, FP8, FP4, fp32), bytes_f: every
layer's weights whole except the embedding (one row) and the routed experts (top-k of E), from
the checkpoint's own tensor sizes. One core streams format f at r_f bytes/s when the kernel, not
the memory, is the limit (measured here: native.c's decode-row kernel on a matrix far larger
than the L3, 1 thread); C cores share a memory of B bytes/s, of which the kernels reach a
fraction eta. Then

    t(token) = sum_f bytes_f / min(C * r_f, eta * B)  +  L * o

where L is the number of layers and o the per-layer time that is not weight streaming (attention
over the state, routing, norms, the Python of a step), fitted from a measured stack:
o = (t_measured - sum_f ...) / L_stack at the thread count of that run. A second run at another
thread count is predicted, not fitted, so the model's error is shown before anything is
projected. Assumptions, stated with every figure: cores scale linearly up to the memory bound
(no NUMA, no SMT), eta is the fraction of the read bandwidth the kernels reach (`--eta`), and o
is given two ways, as measured (it did not shrink from 1 to 2 threads here) and divided over
the cores as the weights are: the range between them is the projection.

The whole model's bytes come from the stack's layers: each layer's attention and MLP bytes by
kind (V4: the attention type and compress ratio, hash or scored MoE; GLM: KDA or DSA with its
indexer, dense or MoE), summed over the release config's layer list. The 4-layer stacks hold
every kind both releases use.
"""
from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import time
from pathlib import Path

_LAYER = re.compile(r"^(?:model\.(?:language_model\.)?)?layers\.(\d+)\.")
_FORMATS = ("bf16", "fp8", "fp4", "f32")


def tensor_headers(directory: str | Path) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """{key: (shape, safetensors dtype, nbytes)} of a checkpoint, from its headers."""
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (tuple(v["shape"]), v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
    return out


def _scale_owner(key: str, headers) -> str | None:
    """The weight a scale tensor belongs to (V4 release `X.scale`, GLM `X.weight_scale_inv`)."""
    for suffix, weight in ((".weight_scale_inv", ".weight"), (".scale", ".weight")):
        if key.endswith(suffix) and key[: -len(suffix)] + weight in headers:
            return key[: -len(suffix)] + weight
    return None


def _format(key: str, dtype: str, headers) -> str:
    if dtype == "F8_E4M3":
        return "fp8"
    if dtype == "I8":  # packed e2m1 pairs with a 1x32 scale beside them
        return "fp4"
    return "bf16" if dtype == "BF16" else "f32"


def _read_fraction(key: str, shape, cfg) -> float:
    """How much of a tensor one decode token reads: the embedding one row, a routed expert top-k of E."""
    if key.endswith(("embed.weight", "embed_tokens.weight")):
        return 1 / shape[0]
    if ".experts." in key:
        return cfg.num_experts_per_tok / cfg.n_routed_experts
    if key.endswith("tid2eid"):
        return 1 / shape[0]
    return 1.0


def _part(key: str) -> str:
    """"mlp" (experts, router, dense MLP and their norm) or "attn" for a layer tensor."""
    return "mlp" if (".ffn." in key or ".mlp." in key or "ffn_norm" in key or "post_attention_layernorm" in key
                     or "hc_ffn" in key or "ffn_hc" in key) else "attn"


def token_bytes(cfg, headers) -> dict:
    """{"top": {fmt: bytes}, layer index: {"attn": {fmt: bytes}, "mlp": {fmt: bytes}}} that one decode
    token reads; a scale counts with its weight's format; a router is held (and read) in fp32."""
    out: dict = {"top": dict.fromkeys(_FORMATS, 0.0)}
    for key, (shape, dtype, nbytes) in headers.items():
        owner = _scale_owner(key, headers)
        base = owner or key
        fmt = _format(base, headers[base][1], headers)
        read = nbytes * _read_fraction(base, headers[base][0], cfg)
        if base.endswith(("ffn.gate.weight", "mlp.gate.weight")) and owner is None:
            fmt, read = "f32", 4 * nbytes / (2 if dtype == "BF16" else 4)
        m = _LAYER.match(key)
        if key.startswith("mtp.") or (m and int(m.group(1)) >= cfg.num_hidden_layers):
            continue
        slot = out["top"] if m is None else out.setdefault(int(m.group(1)), {
            "attn": dict.fromkeys(_FORMATS, 0.0), "mlp": dict.fromkeys(_FORMATS, 0.0)})[_part(key)]
        slot[fmt] += read
    return out


def layer_kinds(cfg, i: int) -> tuple[tuple, tuple]:
    """(attention kind, MLP kind) of layer i."""
    if hasattr(cfg, "compress_ratios") and hasattr(cfg, "sliding_window"):  # DeepSeek-V4
        return (cfg.layer_types[i], cfg.compress_ratios[i]), (cfg.mlp_layer_types[i],)
    return (cfg.layer_types[i], cfg.indexer_types[i]), (cfg.mlp_layer_types[i],)


def whole_model_bytes(full_cfg, cut_cfg, per: dict) -> dict[str, float]:
    """{fmt: bytes per token} of `full_cfg` from the cut stack's per-layer bytes by kind."""
    attn, mlp = {}, {}
    for i in range(cut_cfg.num_hidden_layers):
        a, m = layer_kinds(cut_cfg, i)
        attn.setdefault(a, per[i]["attn"])
        mlp.setdefault(m, per[i]["mlp"])
    total = dict(per["top"])
    for i in range(full_cfg.num_hidden_layers):
        a, m = layer_kinds(full_cfg, i)
        if a not in attn or m not in mlp:
            raise ValueError(f"layer {i}'s kinds {a}, {m} are not in the measured stack")
        for f in _FORMATS:
            total[f] += attn[a][f] + mlp[m][f]
    return total


def streaming_seconds(fmt_bytes: dict[str, float], rates: dict[str, float], cores: int, bw: float) -> float:
    """sum_f bytes_f / min(cores * r_f, bw): each format's weights at its kernel's or the memory's pace."""
    return sum(b / min(cores * rates[f], bw) for f, b in fmt_bytes.items() if b)


def measure_rates(repeats: int = 3) -> dict[str, float]:
    """Bytes/s one core streams per format through native.c's decode-row kernel (x [1, 4096] against a
    matrix of 256-512 MiB, far larger than any L3), best of `repeats`; fp32 rows through the same
    fixed-order dot."""
    import torch

    from ..numerics.backend import KernelSet, build_backend
    from ..numerics.weights_mm import describe, native_mm
    torch.set_num_threads(1)
    lib = build_backend("cpu", torch.float32, "hf", True, KernelSet.from_env()).weight_mm.native
    if lib is None:
        raise RuntimeError("native.c is not available on this machine: no kernel rates to measure")
    g, k = torch.Generator().manual_seed(0), 4096
    mats = {"bf16": describe(torch.randn(65536, k, generator=g).to(torch.bfloat16)),
            # |w| >= 2^-6 * 1.3: no subnormal codes, which a real block holds rarely (about 1% of a
            # GLM-5.3 kv_b_proj's row blocks) and which take a slower decode (weights_mm.scan_fp8_codes)
            "fp8": describe(_normal_codes(torch.randn(65536, k, generator=g)).to(torch.float8_e4m3fn),
                            torch.full((512, k // 128), 127, dtype=torch.uint8), (128, 128), lib=lib),
            "fp4": describe(torch.randint(0, 256, (131072, k // 2), generator=g, dtype=torch.uint8).view(torch.int8),
                            torch.full((131072, k // 32), 120, dtype=torch.uint8), (1, 32), packed_fp4=True),
            "f32": describe(torch.randn(32768, k, generator=g))}
    x, rates = torch.randn(1, k, generator=g), {}
    for f, found in mats.items():
        if found is None:
            continue
        desc, n, kk = found
        nbytes = desc.tensors[0].numel() * desc.tensors[0].element_size()
        native_mm(lib, x, desc, n, kk)
        best = min(_timed(lambda: native_mm(lib, x, desc, n, kk)) for _ in range(repeats))
        rates[f] = nbytes / best
    rates.setdefault("f32", rates["bf16"])
    return rates


def _normal_codes(x):
    return x.sign() * (x.abs() + 0.02)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def full_config(name: str):
    """The release config of a real-shape bench name, all its layers, without MTP."""
    from .real_shapes import real_config
    from ..models.glm5.config import glm5_config_from_dict
    from ..models.deepseek_v4.config import config_from_dict
    from .real_shapes import RELEASES
    path = Path(__file__).resolve().parents[1] / "assets" / "configs" / RELEASES[name]
    d = json.loads(path.read_text())
    n = (glm5_config_from_dict(d) if name == "glm53-flash" else config_from_dict(d)).num_hidden_layers
    return real_config(name, n)


def measured_runs(paths: list[str]) -> list[dict]:
    """(threads, decode seconds per token, read bandwidth) of `kvfold bench` JSON results."""
    runs = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        cell = next(c for c in r["cells"] if c["engine"] == "kvfold" and c.get("decode_tok_s"))
        tok_s = cell.get("decode_tok_s_median") or cell["decode_tok_s"]
        bw = (r.get("bandwidth") or {}).get("read_bytes_per_s")
        runs.append({"threads": r["settings"]["threads"], "seconds": 1 / tok_s, "tok_s": tok_s, "read_bw": bw,
                     "context": cell["context"], "path": p})
    return runs


def fit_overhead(stack: dict[str, float], layers: int, run: dict, rates, bw_here: float) -> float:
    """Seconds per layer of a step that are not weight streaming, from one measured run."""
    return max(0.0, (run["seconds"] - streaming_seconds(stack, rates, run["threads"], bw_here)) / layers)


def project(args) -> dict:
    from .real_shapes import checkpoint_dir, real_config
    cut = real_config(args.config, args.layers)
    headers = tensor_headers(checkpoint_dir(args.config, cut.num_hidden_layers, args.cache_dir))
    per = token_bytes(cut, headers)
    stack = whole_model_bytes(cut, cut, per)
    full = whole_model_bytes(full_config(args.config), cut, per)
    rates = json.loads(Path(args.rates).read_text()) if args.rates else measure_rates()
    runs = sorted(measured_runs(args.bench_json), key=lambda r: -r["threads"])
    bw_here = args.read_bw * 1e9 if args.read_bw else next(r["read_bw"] for r in runs if r["read_bw"])
    o = fit_overhead(stack, cut.num_hidden_layers, runs[0], rates, args.eta * bw_here)
    checks = [{"threads": r["threads"], "measured_tok_s": r["tok_s"],
               "predicted_tok_s": 1 / (streaming_seconds(stack, rates, r["threads"], args.eta * bw_here)
                                       + cut.num_hidden_layers * o)} for r in runs]
    layers = full_config(args.config).num_hidden_layers
    machines = []
    for spec in args.machine:
        b, c = (float(x) for x in spec.split(":"))
        weights = streaming_seconds(full, rates, int(c), args.eta * b * 1e9)
        parallel_o = o * runs[0]["threads"] / c  # the other bound: o spreads over the cores as well
        machines.append({"read_gb_s": b, "cores": int(c), "tok_s": 1 / (weights + layers * o), "streaming_s": weights,
                         "tok_s_overhead_parallel": 1 / (weights + layers * parallel_o)})
    return {"config": args.config, "stack_layers": cut.num_hidden_layers, "full_layers": layers,
            "stack_bytes": stack, "full_bytes": full, "rates_bytes_per_s_per_core": rates, "eta": args.eta,
            "read_bw_here": bw_here, "overhead_s_per_layer": o, "fitted_on": runs[0], "checks": checks,
            "machines": machines}


def report(p: dict) -> str:
    gb = lambda d: ", ".join(f"{f} {v / 1e9:.3f}" for f, v in d.items() if v)  # noqa: E731
    lines = [f"{p['config']}: bytes a decode token reads (GB), {p['stack_layers']}-layer stack: {gb(p['stack_bytes'])}",
             f"  whole model ({p['full_layers']} layers): {gb(p['full_bytes'])}",
             "  kernel rates per core (GB/s): " + ", ".join(f"{f} {r / 1e9:.1f}" for f, r in
                                                          p["rates_bytes_per_s_per_core"].items()),
             f"  eta {p['eta']:.2f} of the read bandwidth ({p['read_bw_here'] / 1e9:.1f} GB/s here); "
             f"o = {p['overhead_s_per_layer'] * 1e3:.2f} ms a layer, fitted at {p['fitted_on']['threads']} threads"]
    for c in p["checks"]:
        lines.append(f"  check, {c['threads']} threads: measured {c['measured_tok_s']:.2f} tok/s, "
                     f"model {c['predicted_tok_s']:.2f} ({c['predicted_tok_s'] / c['measured_tok_s']:.2f}x)")
    for m in p["machines"]:
        lines.append(f"  {m['read_gb_s']:g} GB/s, {m['cores']} cores: {m['tok_s']:.1f} to "
                     f"{m['tok_s_overhead_parallel']:.1f} tok/s (weights {m['streaming_s'] * 1e3:.1f} ms + "
                     f"{p['full_layers']} x o: {(1 / m['tok_s'] - m['streaming_s']) * 1e3:.1f} ms with o as measured, "
                     f"or o / {m['cores']} x {p['fitted_on']['threads']} where it parallelises)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfold.bench.projection", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=("v4-flash", "glm53-flash"), required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--bench-json", action="append", required=True, help="a `kvfold bench` result of this config "
                   "(one per thread count; the most threads fits o, the others check the model)")
    p.add_argument("--machine", action="append", default=[], metavar="GB_S:CORES",
                   help="a machine to project to: read bandwidth in GB/s and cores, e.g. 460:32")
    p.add_argument("--eta", type=float, default=0.85, help="fraction of the read bandwidth the kernels reach")
    p.add_argument("--read-bw", type=float, default=None, help="this machine's read bandwidth in GB/s "
                   "(default: from the bench JSON's --bandwidth on measurement)")
    p.add_argument("--rates", default=None, help="a JSON of per-core bytes/s by format (default: measure now)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = project(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

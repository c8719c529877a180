"""The `--vs` peers' part of the `kvfold bench` report (llama.cpp's engines, flyweight): kvfold / peer
ratios per context, the peers' table (a row per context and engine, kvfold's first) and the lines
saying what each peer ran. Importing this module is cheap (no torch)."""
from __future__ import annotations

from typing import Any

from .flyweight import FLYWEIGHT_REPETITIONS
from .llamacpp import LLAMA_REPETITIONS
from .report_cells import _decode_cell, _f, _prefill_cell, _rss_cell
from .vs import is_peer

LLAMA = "llama.cpp"


def _ratio(a, b):
    return (a / b) if (isinstance(a, (int, float)) and isinstance(b, (int, float)) and b) else None


def peer_engines(result: dict[str, Any]) -> list[str]:
    return [e for e in result["settings"]["engines"] if is_peer(e)]


def peer_ratios(cells: list[dict], kv: dict | None, ctx: int) -> dict[str, Any]:
    """The row entries of one context: {"peers": {engine: kvfold / engine ratios}}, plus the
    `llama_*` ratios of engine llama.cpp under their earlier names."""
    if kv is None:
        return {}
    out: dict[str, Any] = {}
    for c in cells:
        if c["context"] != ctx or not is_peer(c["engine"]):
            continue
        r = {"prefill_ratio": _ratio(kv.get("prefill_tok_s"), c.get("prefill_tok_s")),
             "decode_ratio": _ratio(kv.get("decode_tok_s"), c.get("decode_tok_s")),
             "prefill_peak_rss_ratio": _ratio(kv.get("prefill_peak_rss_bytes"), c.get("prefill_peak_rss_bytes"))}
        out.setdefault("peers", {})[c["engine"]] = r
        if c["engine"] == LLAMA:
            out.update({f"llama_{k}": v for k, v in r.items()})
    return out


def format_peer_table(result: dict[str, Any]) -> str:
    """kvfold and each peer per context: prefill tok/s, peak RSS, decode tok/s, and kv/peer = kvfold / peer."""
    engines = ["kvfold"] + peer_engines(result)
    head = ["context", "engine", "prefill tok/s", "kv/peer", "prefill peak RSS MiB", "kv/peer", "decode tok/s",
            "kv/peer"]
    lines = []
    for row in result["rows"]:
        ratios = row.get("peers", {})
        for e in engines:
            c = next((c for c in result["cells"] if c["engine"] == e and c["context"] == row["context"]), None)
            r = ratios.get(e, {})
            lines.append([str(row["context"]), e, _prefill_cell(c), _f(r.get("prefill_ratio"), "{:.2f}"),
                          _rss_cell(c), _f(r.get("prefill_peak_rss_ratio"), "{:.2f}"), _decode_cell(c),
                          _f(r.get("decode_ratio"), "{:.2f}")])
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.rjust(w) for h, w in zip(head, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines]
    return "\n".join(out)


def _types(g: dict[str, Any]) -> str:
    t = g.get("tensor_types")
    if not t:
        return ""
    return ", tensors " + " ".join(f"{k} {n}" for k, (n, _) in sorted(t.items(), key=lambda kv: -kv[1][1]))


def _gguf_text(g: dict[str, Any]) -> str:
    rss = g.get("convert_peak_rss_bytes")
    return (f"{g['outtype']}: {g.get('gguf')}{' (cached)' if g.get('cached') else ''}{_types(g)}"
            + (f", converter peak RSS {rss / 2 ** 30:.1f} GiB" if rss else ""))


def _llama_line(result: dict[str, Any], lc: dict[str, Any]) -> str:
    if lc.get("problem") and not any(g.get("gguf") for g in (lc.get("ggufs") or {}).values()):
        return f"llama.cpp: {lc['problem']}"
    build = next((c.get("llama_bench") for c in result["cells"] if c.get("llama_bench")), None) or {}
    ggufs = lc.get("ggufs") or {"bf16": {"outtype": "bf16", "gguf": lc.get("gguf"), "cached": lc.get("gguf_cached")}}
    line = (f"llama.cpp: {lc.get('llama_bench')} (build {build.get('build_commit') or '?'}"
            f"{', ' + build['backends'] if build.get('backends') else ''}); GGUFs converted by {lc.get('converter')} "
            f"(routed experts MXFP4, norms and vectors F32): "
            + "; ".join(_gguf_text(g) if g.get("gguf") else f"{o}: {g.get('problem')}" for o, g in ggufs.items())
            + f"; llama-bench -r {LLAMA_REPETITIONS} (median)"
            f"{' ' + ' '.join(lc['llama_bench_args']) if lc.get('llama_bench_args') else ''}, "
            f"KV cache {build.get('type_k') or '?'}/{build.get('type_v') or '?'}, its own warm-up "
            f"(the prompt once, 1 decode step); prefill = -p CONTEXT -n 0, decode = -p 0 -n N -d CONTEXT")
    return line


def _flyweight_line(fw: dict[str, Any]) -> str:
    if fw.get("problem"):
        return f"flyweight: {fw['problem']}"
    return (f"flyweight: {fw.get('cli')} {fw.get('version') or ''} on the {fw.get('gguf_outtype')} GGUF "
            f"({fw.get('gguf')}); flyweight serve --backend cpu, one slot, f16 KV cache, OMP/FLYWEIGHT_CPU_THREADS "
            f"= --threads; a warm-up request, then {FLYWEIGHT_REPETITIONS} streamed requests of CONTEXT tokens "
            f"(median): prefill from its admission to its last-token progress frame, decode from its own "
            f"generated_tokens / decode_elapsed_seconds")


def peer_header_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    if result.get("llama_cpp") is not None:
        lines.append(_llama_line(result, result["llama_cpp"]))
    if result.get("flyweight") is not None:
        lines.append(_flyweight_line(result["flyweight"]))
    if lines and result["settings"].get("prefill_logits") != "last":
        lines.append("note: the peers' prefill makes logits for the last token only, kvfold's here for every "
                     "position (--prefill-logits last compares like with like)")
    return lines


def peer_table_lines(result: dict[str, Any]) -> list[str]:
    engines = peer_engines(result)
    if not engines:
        return []
    legend = ("kv/peer = kvfold / that engine. A peer's peak RSS: llama.cpp's is its prefill process's ru_maxrss "
              "(load, warm-up and prefill); flyweight's its server's VmHWM when the first timed prefill ended "
              "(load, warm-up and that prefill); mmap'd weights they touched count.")
    return ["", "kvfold vs " + ", ".join(engines) + ":", format_peer_table(result), legend]

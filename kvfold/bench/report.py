"""`kvfold bench` results: the derived numbers (ratios, flatness, bandwidth share) and the text report."""
from __future__ import annotations

from typing import Any

from .report_cells import _decode_cell, _f, _prefill_cell, _rss_cell, _short_status
from .report_peers import is_peer, peer_header_lines, peer_ratios, peer_table_lines
from .report_measure import bandwidth_lines, decode_bytes_lines, decode_shares, load_time_lines

LLAMA = "llama.cpp"
_MIB = 1024 * 1024
_GIB = 1024 * _MIB


# ---- derived numbers ----------------------------------------------------------------------------------
def _ratio(a, b):
    return (a / b) if (isinstance(a, (int, float)) and isinstance(b, (int, float)) and b) else None


def _flatness(cells: list[dict], engine: str) -> dict[str, Any] | None:
    """Decode tok/s at the longest decoded context / at the shortest (ideally 512), from the
    total decode time, and the same from the fastest single step (less sensitive to other load)."""
    ok = sorted((c["context"], c["decode_tok_s"], c.get("decode_step_min_s")) for c in cells
                if c["engine"] == engine and c.get("decode_status") == "ok" and c.get("decode_tok_s"))
    if len(ok) < 2:
        return None
    (c0, v0, m0), (c1, v1, m1) = ok[0], ok[-1]
    return {"short_context": c0, "long_context": c1, "decode_tok_s_short": v0, "decode_tok_s_long": v1,
            "flatness": v1 / v0, "flatness_best_step": (m0 / m1) if m0 and m1 else None}


def summarize(result: dict[str, Any]) -> None:
    """Fill result["rows"], ["flatness"] and the bandwidth fractions from result["cells"]."""
    cells = result["cells"]
    rows = []
    for ctx in result["settings"]["contexts"]:
        kv = next((c for c in cells if c["engine"] == "kvfold" and c["context"] == ctx), None)
        hf = next((c for c in cells if c["engine"] == "transformers" and c["context"] == ctx), None)
        row: dict[str, Any] = {"context": ctx, **peer_ratios(cells, kv, ctx)}  # kvfold / each --vs peer
        if hf is not None and kv is not None:
            row["prefill_ratio"] = _ratio(kv.get("prefill_tok_s"), hf.get("prefill_tok_s"))
            row["decode_ratio"] = _ratio(kv.get("decode_tok_s"), hf.get("decode_tok_s"))
            row["prefill_peak_rss_ratio"] = _ratio(kv.get("prefill_peak_rss_bytes"), hf.get("prefill_peak_rss_bytes"))
            kt, ht = kv.get("tokens"), hf.get("tokens")
            if kt and ht:
                same = 0
                for a, b in zip(kt, ht):
                    if a != b:
                        break
                    same += 1
                row["greedy_tokens_agree"] = same
                row["greedy_tokens_compared"] = min(len(kt), len(ht))
        rows.append(row)
    result["rows"] = rows
    result["flatness"] = {e: _flatness(cells, e) for e in result["settings"]["engines"]}
    bw = result.get("bandwidth")
    if bw and (bw.get("read_bytes_per_s") or bw.get("copy_bytes_per_s")):
        for c in cells:
            if is_peer(c["engine"]):  # their experts are MXFP4: not the bytes counted for the checkpoint
                continue
            if c["engine"] != "kvfold" and result["settings"].get("kvfold_weights") == "quantized":
                continue  # the bytes counted are kvfold's FP8 / FP4 checkpoint's
            per_tok = result["decode_bytes_per_token"].get(str(c["context"]), {}).get("total")
            if c.get("decode_tok_s") and per_tok:
                c.update(decode_shares(per_tok * c["decode_tok_s"], bw))


# ---- formatting ---------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    cells = result["cells"]
    vs = "transformers" in result["settings"]["engines"]
    head = ["context", "kvfold prefill tok/s"]
    if vs:
        head += ["hf prefill tok/s", "ratio"]
    head += ["kvfold prefill peak RSS MiB"]
    if vs:
        head += ["hf prefill peak RSS MiB"]
    head += ["kvfold decode tok/s"]
    if vs:
        head += ["hf decode tok/s", "ratio", "greedy agree"]
    lines = []
    for row in result["rows"]:
        ctx = row["context"]
        kv = next((c for c in cells if c["engine"] == "kvfold" and c["context"] == ctx), None)
        hf = next((c for c in cells if c["engine"] == "transformers" and c["context"] == ctx), None)
        r = [str(ctx), _prefill_cell(kv)]
        if vs:
            r += [_prefill_cell(hf), _f(row.get("prefill_ratio"), "{:.2f}")]
        r += [_rss_cell(kv)]
        if vs:
            r += [_rss_cell(hf)]
        r += [_decode_cell(kv)]
        if vs:
            agree = (f"{row['greedy_tokens_agree']}/{row['greedy_tokens_compared']}"
                     if "greedy_tokens_agree" in row else "-")
            r += [_decode_cell(hf), _f(row.get("decode_ratio"), "{:.2f}"), agree]
        lines.append(r)
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.rjust(w) for h, w in zip(head, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines]
    return "\n".join(out)


def _prefill_range_s(c: dict[str, Any]) -> str:
    """The fastest and slowest of a cell's timed prefills, in seconds ('-' for one or none): kvfold's
    runs, llama-bench's samples, flyweight's repetitions (tokens a second each)."""
    runs = c.get("prefill_samples_s") or [x / 1e9 for x in c.get("prefill_samples_ns") or []]
    if not runs and c.get("prefill_samples_tok_s") and c.get("prompt_tokens"):
        runs = [c["prompt_tokens"] / r for r in c["prefill_samples_tok_s"] if r]
    return f"{min(runs):.2f}-{max(runs):.2f}" if len(runs) > 1 else "-"


def format_noise_table(result: dict[str, Any]) -> str:
    """Per cell: how contended the CPUs were, the spread of the timed prefills, and decode speed from
    the median / fastest step."""
    head = ["context", "engine", "status", "cpu pressure", "load s", "prefill s", "prefill runs s", "decode median tok/s",
            "decode best-step tok/s", "decode p90-p10 tok/s", "cell wall s"]
    rows = []
    for c in result["cells"]:
        med, best = c.get("decode_step_median_s"), c.get("decode_step_min_s")
        slow, fast = c.get("decode_step_p90_s"), c.get("decode_step_p10_s")
        spread = f"{1 / slow:.1f}-{1 / fast:.1f}" if slow and fast else "-"
        rows.append([str(c["context"]), c["engine"], _short_status(c["status"]) if c["status"] != "ok" else "ok",
                     _f(c.get("cpu_pressure_some") * 100, "{:.0f}%") if c.get("cpu_pressure_some") is not None else "-",
                     _f(c.get("load_s")), _f(c.get("prefill_s"), "{:.2f}"), _prefill_range_s(c),
                     _f(1 / med if med else None),
                     _f(1 / best if best else None), spread, _f(c.get("wall_s"))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [" | ".join(h.rjust(w) for h, w in zip(head, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _header_lines(result: dict[str, Any]) -> list[str]:
    """Settings, command, machine and checkpoint."""
    s = result["settings"]
    m = result["machine"]
    return [f"kvfold bench: config {s['config']} ({result['model']['parameters']:,} parameters, "
            f"{result['model']['weight_bytes'] / _MIB:.1f} MiB fp32), decode {s['decode_tokens']} tokens, "
            f"{s['threads']} threads, time limit {s['time_limit_s']:g} s/cell, "
            f"memory cap {s['mem_limit_gib']:g} GiB/cell, "
            f"prefill returns {'the last row of' if s.get('prefill_logits') == 'last' else 'all'} logits"
            + (f", kvfold in {s['kvfold_dtype']}" if s.get("kvfold_dtype", "float32") != "float32" else "")
            + (f", kvfold weights {s['kvfold_weights']}" if s.get("kvfold_weights", "dequant") != "dequant" else ""),
            *(["context: synthetic (each decode starts from a state filled with random rows at that position, "
               "kvfold/bench/synthetic_context.py; no prefill was timed and the tokens mean nothing)"]
              if s.get("context_fill") == "synthetic" else []),
            *_resident_lines(result),
            f"command: {result['command']}",
            f"machine: {m['cpu_count']} CPUs ({m['processor'] or m['machine']}), {m['mem_total_gib']:.1f} GiB RAM, "
            f"torch {m['torch']}, transformers {m.get('transformers') or '-'}, python {m['python']}, "
            f"load avg at start {m['loadavg_start']}"
            + (f", kvfold native CPU kernels {'on' if m['kvfold_native'] else 'off'}" if "kvfold_native" in m else ""),
            f"checkpoint: {result['checkpoint']}"]


def _resident_lines(result: dict[str, Any]) -> list[str]:
    """kvfold's resident weight bytes per parameter, as its first cell measured them at load."""
    cell = next((c for c in result.get("cells", []) if c["engine"] == "kvfold" and c.get("weight_bytes")), None)
    if cell is None:
        return []
    return [f"kvfold resident weights: {cell['weight_bytes'] / _MIB:.1f} MiB for {cell['parameters']:,} "
            f"parameters = {cell['weight_bytes'] / cell['parameters']:.3f} bytes/parameter"]


def _sanity_line(san: dict[str, Any]) -> str:
    if san.get("status") != "ok":
        return f"sanity: {san.get('status')}"
    return (f"sanity (transformers float32 vs kvfold {san.get('dtype', 'float32')}, {san['tokens']} tokens + "
            f"{san['decode_steps']} decode steps): "
            f"max |logit diff| prefill {san['max_abs_diff_prefill']:.2e}, decode {san['max_abs_diff_decode']:.2e} "
            f"of logits up to {san['logits_scale']:.2f}, greedy argmax agree {san['same_argmax']}/"
            f"{san['compared_argmax']} "
            + (f"(tolerance {san['tolerance']:g}: {'PASS' if san['passed'] else 'FAIL'}); "
               if san["tolerance"] is not None else "(drift of a lower precision, not judged); ")
            + f"missing/unexpected/mismatched tensors: {san['missing']}/{san['unexpected']}/{san['mismatched']}")


def _legend_line(engines: list[str]) -> str:
    return ("peak RSS = max resident set of the cell process during the prefill (model loaded, state/cache "
            "and logits included); (+N) = growth over the loaded model."
            + (" ratio = kvfold / transformers." if "transformers" in engines else ""))


def _flatness_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for e, fl in result["flatness"].items():
        if fl:
            best = fl.get("flatness_best_step")
            lines.append(f"decode flatness {e}: {fl['flatness']:.2f} (decode tok/s at {fl['long_context']} / at "
                         f"{fl['short_context']}: {fl['decode_tok_s_long']:.1f} / {fl['decode_tok_s_short']:.1f}); "
                         f"from the fastest step: {_f(best, '{:.2f}')}")
        else:
            lines.append(f"decode flatness {e}: - (fewer than two contexts decoded)")
    held = sorted((c["context"], c["state_bytes_after_prefill"]) for c in result["cells"]
                  if c["engine"] == "kvfold" and c.get("state_bytes_after_prefill"))
    if len(held) > 1:  # what a sequence's state grows by per token of context (the pools)
        (c0, b0), (c1, b1) = held[0], held[-1]
        lines.append(f"state held by kvfold: {b0 / 1e6:.2f} MB at {c0}, {b1 / 1e6:.2f} MB at {c1}: "
                     f"{(b1 - b0) / (c1 - c0):,.0f} B per further token of context")
    return lines


def _note_lines(result: dict[str, Any]) -> list[str]:
    return [f"note: {c['engine']} @ {c['context']}: {c['status']}"
            + (f" (after {c['wall_s']:.0f} s)" if c.get("wall_s") else "")
            for c in result["cells"] if c["status"] != "ok"]


def format_report(result: dict[str, Any]) -> str:
    lines = _header_lines(result)
    if result.get("sanity"):
        lines.append(_sanity_line(result["sanity"]))
    lines += peer_header_lines(result)
    lines += ["", format_table(result), ""]
    lines.append(_legend_line(result["settings"]["engines"]))
    lines += peer_table_lines(result)
    lines += _flatness_lines(result)
    lines += decode_bytes_lines(result)
    lines += bandwidth_lines(result)
    lines += load_time_lines(result)
    lines += ["", "per cell (cpu pressure = share of the cell's wall time in which some task waited for a CPU, "
                  "from /proc/pressure/cpu; high = other work competed):", format_noise_table(result)]
    lines += _note_lines(result)
    return "\n".join(lines)

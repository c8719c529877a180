"""Report lines of the bench's machine measurements (issue 42 item 3): decode bytes per token
term by term with their formula, the copy and read bandwidth and each decode's share of them,
and the model's load time against the time to read its files. report.py calls these.

Importing this module is cheap (no torch).
"""
from __future__ import annotations

from typing import Any

_MB = 1e6
_GB = 1e9


def decode_shares(achieved: float, bw: dict[str, Any]) -> dict[str, float]:
    """A decode's achieved bytes/s and its share of the read (and of the copy) bandwidth."""
    out = {"decode_achieved_bytes_per_s": achieved}
    if bw.get("read_bytes_per_s"):
        out["decode_fraction_of_read_bandwidth"] = achieved / bw["read_bytes_per_s"]
    if bw.get("copy_bytes_per_s"):
        out["decode_fraction_of_copy_bandwidth"] = achieved / bw["copy_bytes_per_s"]
    return out


# ---- decode bytes per token --------------------------------------------------------------------------
def _term_line(t: dict[str, Any], width: int) -> str:
    return f"  {t['label']:<{width}} {t['bytes'] / _MB:10.3f} MB = {t['formula']}"


def decode_bytes_lines(result: dict[str, Any]) -> list[str]:
    """The weights a decode token reads, term by term (the same at every context), then per context
    the state terms and the total, and the formula they add up by."""
    db = result.get("decode_bytes") or {}
    terms = db.get("terms") or {}
    if not terms:
        return [f"decode bytes per token: {db['missing']}"] if db.get("missing") else []
    first = next(iter(terms.values()))
    weights = [t for t in first if t["group"] == "weights" and not (t["key"] == "other" and not t["bytes"])]
    width = max(len(t["label"]) for ctx_terms in terms.values() for t in ctx_terms)
    lines = [f"decode bytes per token ({db.get('family')}; weights as the loaded checkpoint stores them, "
             f"quantized ones with their scales, except what kvfold holds wider (routers: fp32); state in "
             f"{db.get('state_elem_bytes')}-byte values; MB = 10^6 bytes):"]
    lines += [_term_line(t, width) for t in weights]
    wsum = sum(t["bytes"] for t in first if t["group"] == "weights")
    lines.append(f"  {'weights':<{width}} {wsum / _MB:10.3f} MB = the sum of the above, at any context")
    for ctx, ctx_terms in terms.items():
        state = [t for t in ctx_terms if t["group"] == "state"]
        ssum = sum(t["bytes"] for t in state)
        lines.append(f"  at context {ctx}:")
        lines += ["  " + _term_line(t, width - 2) for t in state]
        lines.append(f"    {'total':<{width - 2}} {(wsum + ssum) / _MB:10.3f} MB = weights {wsum / _MB:.3f} MB "
                     f"+ state {ssum / _MB:.3f} MB")
    lines.append("  formula: total = " + " + ".join(t["key"] for t in first)
                 + " (the JSON's decode_bytes.terms, in exact bytes)")
    return lines


# ---- bandwidth ------------------------------------------------------------------------------------------
def _read_text(read: dict[str, Any]) -> str:
    others = ", ".join(f"{k} {v['bytes_per_s'] / _GB:.2f}" for k, v in read.get("methods", {}).items()
                       if k != read.get("method"))
    l3 = read.get("l3_bytes")
    return (f"read {read['bytes_per_s'] / _GB:.2f} GB/s ({read['method']} over a {read['buffer_mib']} MiB fp32 "
            f"buffer" + (f", {read['buffer_mib'] * 2 ** 20 / l3:.0f}x the {l3 / 2 ** 20:.0f} MiB L3" if l3 else "")
            + f", best of {read['repeats']} after a warm-up"
            + (f"; other reads: {others} GB/s" if others else "") + ")")


def bandwidth_lines(result: dict[str, Any]) -> list[str]:
    """The read and the copy bandwidth, and each decode's achieved bytes/s as a share of them."""
    bw = result.get("bandwidth")
    if not bw:
        return []
    read, copy = bw.get("read") or {}, bw.get("copy") or {}
    if not (read.get("bytes_per_s") or copy.get("bytes_per_s")):
        return [f"memory bandwidth: {bw.get('status')}"]
    parts = [_read_text(read)] if read.get("bytes_per_s") else []
    if copy.get("bytes_per_s"):
        parts.append(f"copy {copy['bytes_per_s'] / _GB:.2f} GB/s read+write (dst.copy_(src), {copy['tensor_mib']} MiB "
                     f"fp32, best of {copy['repeats']})")
    lines = [f"memory bandwidth, threads={bw.get('threads')}: " + "; ".join(parts)]
    per_ctx = result.get("decode_bytes_per_token") or {}
    for c in result["cells"]:
        if not c.get("decode_achieved_bytes_per_s"):
            continue
        per = per_ctx[str(c["context"])]
        share = " = " + ", ".join(
            f"{100 * c[k]:.1f}% of the {name} bandwidth" for k, name in
            (("decode_fraction_of_read_bandwidth", "read"), ("decode_fraction_of_copy_bandwidth", "copy")) if k in c)
        lines.append(
            f"  decode {c['engine']} @ {c['context']}: {per['total'] / _MB:.2f} MB/token (weights "
            f"{per['weights_total'] / _MB:.2f} MB incl. {per.get('routed_experts_active', 0) / _MB:.2f} MB selected "
            f"experts, state {per['state'] / _MB:.2f} MB) x {c['decode_tok_s']:.1f} tok/s = "
            f"{c['decode_achieved_bytes_per_s'] / _GB:.2f} GB/s{share}")
    return lines


# ---- load time against read time --------------------------------------------------------------------------
def ratio_text(ratio: float | None, target: float) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x ({'within' if ratio <= target else 'over'} the {target:g}x target)"


def _run_text(run: dict[str, Any], what: str) -> str:
    if run.get("status") != "ok":
        return f"{what} {run.get('status')}"
    rate = f" ({run['bytes'] / run['seconds'] / _MB:.0f} MB/s)" if what == "read" and run.get("seconds") else ""
    return f"{what} {run['seconds']:.2f} s{rate}"


def load_time_lines(result: dict[str, Any]) -> list[str]:
    """Per page-cache state: the time to read the checkpoint's files, the model's load time, their ratio."""
    lt = result.get("load_times")
    if not lt:
        return []
    target = lt.get("target_ratio", 1.5)
    row0 = lt.get("cold") or lt.get("warm") or {}
    run0 = row0.get("read") or {}
    n = run0.get("files", "?")
    size = f"{row0['bytes'] / _MB:.1f} MB in {n} file{'' if n == 1 else 's'}, " if row0.get("bytes") else ""
    lines = [f"load time vs reading the files ({size}{lt['checkpoint']}; target: load <= {target:g}x read):"]
    for cache in ("cold", "warm"):
        row = lt.get(cache)
        if not row:
            continue
        res = ", ".join(f"{what} {100 * row[what]['resident_before']:.1f}%" for what in ("read", "load")
                        if row[what].get("resident_before") is not None)
        note = ""
        if cache == "cold" and row.get("cold_reached") is False:
            note = " - NOT cold: eviction left pages cached (mapped by another process?)"
        lines.append(f"  {cache} page cache: {_run_text(row['read'], 'read')}, {_run_text(row['load'], 'load')}: "
                     f"load/read {ratio_text(row.get('ratio'), target)}"
                     + (f"; resident before: {res}" if res else "") + note)
    return lines

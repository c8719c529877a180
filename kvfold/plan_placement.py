"""`kvfold plan --gpu-memory-gib G --host-memory-gib H`: a model placed on one accelerator plus host
memory (placement.py) and the decode rate that placement should reach, from a config.json alone.

The byte counts are `kvfold plan`'s (plan.weight_tensors at tp=1, the state the model's own
`new_state` reserves on the meta device), grouped by what can be placed: the embedding, each
layer's dense part and its routed experts one by one, each layer's state, the head.

The decode rate, for one sequence, from the bytes each side reads per token:

    t(token) = acc_bytes / acc_bw  +  sum_f host_bytes_f / min(cores * r_f, host_bw)  +  hops * hop

A token reads every dense part whole, one embedding row and top_k of each MoE layer's E experts.
Routing is taken as uniform over the k-subsets of the E experts: a card layer holding K of them
reads k*K/E experts on the card and the rest on the host, and sends its hidden row to the host and
back (two hops) with chance 1 - C(K, k)/C(E, k); real routing is skewed, so a set calibrated on
routing counts (`kvfold calibrate-experts`) does better than the first K by index
(bench/RESULTS.md: on the trained tiny, K = 4 of 8 serves 56% of routed pairs on the card
against 45% for experts 0..3). Hops also count each
change of device along embedding, layers and head (the end of the layer prefix among them). r_f is
one host core's rate for format f through kvfold's decode-row kernels (bench/RESULTS.md: one Zen 4
core from DRAM); the accelerator is taken to read at its stated bandwidth whatever the format. The
terms add, as if card and host never worked at once (pessimistic where they could overlap); not
counted are state reads, attention and routing arithmetic and Python (optimistic): a weight-bytes
estimate, not a measurement.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, PlacementError
from .placement import (DEFAULT_RESERVE_GIB, GIB, HOST, Budget, LayerSizes, ModelSizes, PartSizes, Placement,
                        host_pick_chance, max_sequences, split)

# GB/s one host core streams per format through native.c's decode row, matrices far larger than
# the L3 (bench/RESULTS.md, one Zen 4 EPYC core): a host's cores, not its memory, can be the limit.
HOST_CORE_GB_S = {"bf16": 18.0, "fp8": 11.6, "fp4": 5.0, "f32": 26.0}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _format(tensor, bytes_per_value: float) -> str:
    from .plan import _FP4, _FP8
    if bytes_per_value == _FP4:
        return "fp4"
    if bytes_per_value == _FP8:
        return "fp8"
    return "bf16" if tensor.is_floating_point() and bytes_per_value == 2 else "f32"


def _part(items) -> PartSizes:
    """PartSizes of [(tensor, bytes per value, fraction a token reads)]."""
    reads = dict.fromkeys(HOST_CORE_GB_S, 0.0)
    held = 0.0
    for t, bpv, read in items:
        held += t.numel() * bpv
        reads[_format(t, bpv)] += t.numel() * bpv * read
    return PartSizes(held, reads)


def _read_fraction(name: str, tensor) -> float:
    """A token reads one row of a lookup table (the embedding, V4's hash routing table), all of the rest."""
    return 1 / tensor.shape[0] if name.endswith(("embed_tokens.weight", "tid2eid")) else 1.0


def model_sizes(config: dict, weights: str = "bf16", kv_dtype: str | None = None, max_seq_len: int = 65536,
                max_rewind: int = 0) -> ModelSizes:
    """The byte counts placement.py places, from a config.json on the meta device."""
    from .plan import weight_tensors
    family, model, tensors = weight_tensors(config, weights)
    cfg = model.config
    n_layers, n_experts = cfg.num_hidden_layers, cfg.n_routed_experts
    dense: list[list] = [[] for _ in range(n_layers)]
    experts: list[list] = [[] for _ in range(n_layers)]
    embed, head, head_modules = [], [], []
    for name, t, bpv in tensors:
        m = _LAYER.match(name)
        if m is None:
            module = name.rsplit(".", 1)[0]
            if module == "model.embed_tokens":
                embed.append((t, bpv, _read_fraction(name, t)))
                continue
            head.append((t, bpv, 1.0))
            head_modules += [] if module in head_modules else [module]
        elif ".mlp.experts." in name:  # [E, ...]: one expert's share, an exact count of values
            one = t[0]
            experts[int(m.group(1))].append((one, bpv, 1.0))
        else:
            dense[int(m.group(1))].append((t, bpv, _read_fraction(name, t)))
    state = model.new_state(capacity=max_seq_len, max_rewind=max_rewind, kv_dtype=kv_dtype)
    per_layer_state = [layer.nbytes for layer in state.layers]
    state.free()
    layers = tuple(LayerSizes(_part(dense[i]), _part(experts[i]) if experts[i] else None, per_layer_state[i])
                   for i in range(n_layers))
    settings = f"weights {weights}, kv {kv_dtype or 'model dtype'}"
    return ModelSizes(family, sum(p.numel() for p in model.parameters()), layers, n_experts, cfg.num_experts_per_tok,
                      _part(embed), _part(head), tuple(head_modules), settings, max_seq_len)


@dataclass(frozen=True)
class Rates:
    """The stated bandwidths a decode estimate assumes."""
    gpu_read_gb_s: float = 3000.0
    host_read_gb_s: float = 200.0
    host_cores: int = 32
    hop_us: float = 20.0  # one crossing: a few KB over PCIe and a synchronisation

    def describe(self) -> str:
        per_core = ", ".join(f"{f} {r:g}" for f, r in HOST_CORE_GB_S.items())
        return (f"accelerator reads {self.gpu_read_gb_s:g} GB/s; host reads min({self.host_cores} cores x "
                f"per-core rate, {self.host_read_gb_s:g} GB/s) per format (per-core GB/s: {per_core}; one Zen 4 "
                f"core, bench/RESULTS.md); {self.hop_us:g} us per crossing")


def decode_seconds(placement: Placement, sizes: ModelSizes, rates: Rates) -> dict[str, float]:
    """Seconds per decode token of one sequence: accelerator reads, host reads, crossings (module docstring)."""
    from .bench.projection import streaming_seconds
    acc, host = split(placement, sizes)
    core_rates = {f: r * 1e9 for f, r in HOST_CORE_GB_S.items()}
    hops = placement.crossings(sizes.top_k)
    out = {"accelerator": acc.read_bytes / (rates.gpu_read_gb_s * 1e9),
           "host": streaming_seconds(host.reads, core_rates, rates.host_cores, rates.host_read_gb_s * 1e9),
           "crossings": hops * rates.hop_us * 1e-6, "hops": hops}
    out["tok_s"] = 1 / (out["accelerator"] + out["host"] + out["crossings"])
    return out


def _span(first: int, last: int) -> str:
    """Layers first..last-1, as "a..b (n)"."""
    if last <= first:
        return "none"
    return f"{first}..{last - 1} ({last - first})" if last - first > 1 else f"{first} (1)"


def _expert_cells(p: Placement, sizes: ModelSizes) -> tuple[str, str]:
    """(accelerator, host) cells of the routed-experts row: the card layers' packs, what runs on the host."""
    e, n = sizes.n_experts, p.gpu_layers
    card_counts = Counter(len(s) for s in p.device_experts[:n] if s is not None)
    host_layers = sum(s is not None for s in p.device_experts[n:])
    card = [f"{'all ' + str(e) if k == e else f'{k} of {e}'} in each of {m} layers"
            for k, m in sorted(card_counts.items(), reverse=True) if k]
    host = [f"{'all ' + str(e) if k == 0 else f'{e - k} of {e}'} in each of {m} card layers"
            for k, m in sorted(card_counts.items(), reverse=True) if k < e]
    host += [f"all {e} in each of {host_layers} host layers"] if host_layers else []
    return "; ".join(card) or "none", "; ".join(host) or "none"


def _assumptions(p: Placement, sizes: ModelSizes, rates: Rates) -> str:
    """The decode estimate's assumptions, with this placement's expert set and crossing chances."""
    e, k = sizes.n_experts, sizes.top_k
    partial = p.partial_layers
    trips = sorted({len(p.device_experts[i]) for i in partial})
    chance = "; ".join(f"with {c} of {e} on the card, 1 - C({c}, {k})/C({e}, {k}) = "
                       f"{host_pick_chance(c, e, k):.6f}" for c in trips)
    trip_text = (f"{len(partial)} card layers with experts on the host send the hidden row there and back "
                 f"when any of a token's {k} experts is there ({chance})" if partial
                 else "no card layer has experts on the host")
    boundaries = p.crossings(k) - sum(2 * host_pick_chance(len(p.device_experts[i]), e, k) for i in partial)
    return (f"assumptions: {rates.describe()}; the card's experts are experts 0..K-1 of each card layer, "
            f"chosen without calibration; routing uniform over the {k}-subsets of {e} experts, so the card "
            f"serves K/E of the expert reads and {trip_text}; {boundaries:.0f} crossings at device "
            f"boundaries along embedding, layers and head; card and host terms add (no overlap); weights only: "
            f"state reads, attention and routing arithmetic and Python not counted. An estimate: no split model "
            f"has run on a GPU yet.")


def _header(p: Placement, sizes: ModelSizes, budget: Budget) -> str:
    seq = budget.sequences
    return (f"{sizes.family}: {sizes.parameters / 1e9:.1f}B parameters, {sizes.settings}, {seq} sequence"
            f"{'s' if seq > 1 else ''} of {sizes.max_seq_len} tokens; accelerator {p.accelerator} "
            f"{budget.gpu_memory_gib:g} GiB ({budget.reserve / GIB:g} GiB kept back for activations and the CUDA "
            f"context), host {budget.host_memory_gib:g} GiB")


def report(p: Placement, sizes: ModelSizes, budget: Budget, rates: Rates) -> str:
    """The placement as a table, the flags that give it, the expected decode rate and its assumptions."""
    acc, host = split(p, sizes)
    n, seq = p.gpu_layers, budget.sequences
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    ends = (("embedding", p.embed_device), ("head", p.head_device))
    acc_ends = ", ".join(x for x, d in ends if d != HOST) or "none"
    host_ends = ", ".join(x for x, d in ends if d == HOST) or "none"
    expert_acc, expert_host = _expert_cells(p, sizes)
    d = decode_seconds(p, sizes, rates)
    lines = [
        _header(p, sizes, budget), f"| | accelerator ({p.accelerator}) | host ({HOST}) |", "|---|---|---|",
        f"| layers (attention, state, router, shared or dense MLP) | {_span(0, n)} | {_span(n, len(sizes.layers))} |",
        f"| routed experts | {expert_acc} | {expert_host} |",
        f"| embedding, head | {acc_ends} | {host_ends} |",
        f"| weights | {gib(acc.weights)} | {gib(host.weights)} |",
        f"| state per sequence | {gib(acc.state)} | {gib(host.state)} |",
        f"| left (after the reserve) | {gib(budget.accelerator - acc.need(seq))} | "
        f"{gib(budget.host - host.need(seq))} |",
        f"| read per decode token | {acc.read_bytes / 1e9:.3f} GB | {host.read_bytes / 1e9:.3f} GB |",
        f"flags: {p.flags()}; sequences of {sizes.max_seq_len} tokens that fit: {max_sequences(p, sizes, budget)}",
        f"expected decode: {d['tok_s']:.1f} tok/s = 1 / (accelerator {d['accelerator'] * 1e3:.2f} ms + host "
        f"{d['host'] * 1e3:.2f} ms + {d['hops']:.2f} crossings {d['crossings'] * 1e3:.2f} ms)",
        _assumptions(p, sizes, rates)]
    return "\n".join(lines)


def add_placement_arguments(p) -> None:
    from .argtypes import count_or, nonneg_float, pos_float, pos_int
    g = p.add_argument_group("one accelerator plus host memory (the placement `kvfold generate|serve` run with "
                             "the same flags)")
    g.add_argument("--gpu-memory-gib", type=nonneg_float, default=None, help="accelerator memory: print a placement")
    g.add_argument("--host-memory-gib", type=nonneg_float, default=None, help="host memory for the rest")
    g.add_argument("--gpu-layers", type=count_or("auto"), default="auto",
                   help="layers 0..N-1 keep attention, state, router and shared or dense MLP on the accelerator, "
                        "N.. run wholly on the host; auto: the most whose non-expert parts fit (default)")
    g.add_argument("--gpu-experts", type=count_or("all", "auto"), default="auto",
                   help="routed experts 0..K-1 of each accelerator layer held there, the rest on the host; all: "
                        "every one; auto: the most that fit after the layers and the head (default)")
    g.add_argument("--gpu-reserve-gib", type=nonneg_float, default=DEFAULT_RESERVE_GIB,
                   help="accelerator memory kept back for activations and the CUDA context "
                        f"(default {DEFAULT_RESERVE_GIB:g})")
    g.add_argument("--gpu-read-gb-s", type=pos_float, default=Rates.gpu_read_gb_s,
                   help="accelerator read bandwidth for the decode estimate, GB/s (default 3000)")
    g.add_argument("--host-read-gb-s", type=pos_float, default=Rates.host_read_gb_s,
                   help="host read bandwidth, GB/s (default 200)")
    g.add_argument("--host-cores", type=pos_int, default=Rates.host_cores,
                   help="host cores running the host layers (default 32)")
    g.add_argument("--hop-us", type=nonneg_float, default=Rates.hop_us,
                   help="microseconds a crossing between the devices costs (default 20)")


def run_placement(args) -> int:
    if args.host_memory_gib is None:
        raise ConfigError("--gpu-memory-gib needs --host-memory-gib: the host holds what the accelerator does not")
    if args.tp != 1:
        raise ConfigError(f"a placement plans one accelerator plus host memory: use --tp 1, got {args.tp}")
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    sizes = model_sizes(config, args.weights, args.kv_dtype, args.max_seq_len, args.max_rewind)
    sequences = args.max_running or 1
    placement = Placement.from_flags(sizes, args.gpu_layers, args.gpu_experts, args.gpu_memory_gib,
                                     args.host_memory_gib, sequences=sequences, reserve_gib=args.gpu_reserve_gib)
    budget = Budget.of(args.gpu_memory_gib, args.host_memory_gib, sequences, args.gpu_reserve_gib)
    print(report(placement, sizes, budget, Rates(args.gpu_read_gb_s, args.host_read_gb_s, args.host_cores,
                                                  args.hop_us)))
    return 0


__all__ = ["HOST_CORE_GB_S", "PlacementError", "Rates", "add_placement_arguments", "decode_seconds",
           "model_sizes", "report", "run_placement"]


def add_plan_command(sub) -> None:
    """`kvfold plan`: the per-rank table's arguments (plan.py) and the placement's."""
    from .plan import add_plan_parser
    add_placement_arguments(add_plan_parser(sub))


def run_plan_command(args) -> int:
    """A placement with --gpu-memory-gib (and --host-memory-gib), else plan.py's per-rank table."""
    placing = [f for f in ("gpu_memory_gib", "host_memory_gib") if getattr(args, f, None) is not None]
    if not placing:
        from .plan import run_plan
        return run_plan(args)
    if "gpu_memory_gib" not in placing:
        raise ConfigError("--host-memory-gib goes with --gpu-memory-gib: a placement needs both budgets")
    return run_placement(args)


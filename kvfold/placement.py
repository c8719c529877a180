"""Where each part of a model lives with one accelerator plus host memory: the plan that
`kvfold plan` prints and `load_model(..., placement=...)` runs (models/placed.py).

The rules a `Placement` follows, the seed engine's (`Dsv4State`: a device prefix of layers, `dev_set`,
and `partial_set`, the layers that run their MoE on the card from a partial expert pack) and the
peers' (llama.cpp `-ngl 99 --n-cpu-moe`, ktransformers' and flyweight's expert offload):
* Card layers are a prefix (`--gpu-layers N`): layers 0..N-1 keep their attention, their
  per-sequence state, their router, their shared expert or dense MLP and their norms on the card;
  layers N..L-1 run wholly on the host, routed experts included. The prefix is the seed's: one
  boundary per step, and a layer's caches never change side.
* Routed experts are the bytes a card holds worst: a token reads top_k of a layer's E (V4-Flash 6
  of 256), everything else in the layer whole. So a card layer holds experts 0..K-1 of its E on
  the card (`--gpu-experts K`, the same K for every card layer; `all` = E) and runs the other E-K
  on the host: the seed's partial pack. The set is the first K by index, or the K that routing
  counts over a calibration text rank highest (`ranked`, models/expert_counts.py), or the K used
  most recently (models/split_experts.py, "lru").
  The k picked experts' outputs are combined in ascending expert order whichever side ran each
  (numerics/rows.py `combine_experts`), so the split changes no addition order.
* The head (final norm, mHC head, lm_head) goes on the card whenever it fits: a token reads all of
  it, where it reads a byte of routed expert with chance top_k/E, so a card byte of head saves
  E/top_k times (V4-Flash: 43x) the host reads a card byte of expert does. The embedding stays on
  the host (a token reads one row of it) unless the whole model fits on the card.

`auto` picks, within G GiB of accelerator memory less a stated reserve and after the state of the
requested sequences: first the most layers whose non-expert parts fit (small: V4-Flash's 43 hold
6.35 GiB in its release formats, plus 0.29 GiB of FP8 state per 65536-token sequence), then the
head, then the largest K that fits what is left (K = all when everything does); the host must
hold the rest in H GiB. Byte counts come from `kvfold plan`'s accounting
(plan_placement.model_sizes). Refusals raise PlacementError and say what fits.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from .errors import PlacementError

ACCELERATOR = "cuda:0"
HOST = "cpu"
GIB = 2 ** 30
DEFAULT_RESERVE_GIB = 2.0  # activations, a prefill chunk's workspace, the CUDA context and allocator slack
_FORMATS = ("bf16", "fp8", "fp4", "f32")
EXPERTS_MODULE = "mlp.experts"  # a layer's routed experts, as a device map names them under the layer


def _zero_reads() -> dict[str, float]:
    return dict.fromkeys(_FORMATS, 0.0)


@dataclass(frozen=True)
class PartSizes:
    """One placeable part: bytes held, and bytes a decode token reads by format."""
    weights: float
    reads: dict[str, float] = field(default_factory=_zero_reads)


@dataclass(frozen=True)
class LayerSizes:
    """One layer. `dense`: everything but the routed experts (attention, router, shared experts,
    norms, mHC); `expert`: one routed expert (None for a dense MLP); `state`: bytes per sequence."""
    dense: PartSizes
    expert: PartSizes | None
    state: int


@dataclass(frozen=True)
class ModelSizes:
    """A model's byte counts by placeable part (plan_placement.model_sizes builds it from a config)."""
    family: str
    parameters: int
    layers: tuple[LayerSizes, ...]
    n_experts: int  # routed experts per MoE layer (n_routed_experts)
    top_k: int  # experts a token reads per MoE layer
    embed: PartSizes
    head: PartSizes
    head_modules: tuple[str, ...]  # the head's top-level modules, as a device map names them
    settings: str  # the weight format and kv dtype these bytes are for
    max_seq_len: int
    embed_module: str = "model.embed_tokens"
    layer_prefix: str = "model.layers."


def host_pick_chance(card_experts: int, n_experts: int, top_k: int) -> float:
    """The chance that a token's top_k experts of a layer are not all among the card's
    `card_experts`: 1 - C(K, k) / C(E, k), for routing uniform over the k-subsets of the E experts."""
    return 1 - math.comb(card_experts, top_k) / math.comb(n_experts, top_k)


@dataclass(frozen=True)
class Placement:
    """Per layer the device of its attention, state, router, shared expert or dense MLP and norms
    (`layer_devices`, a prefix on the card) and the routed experts held on the card
    (`device_experts`: None for a dense layer, empty for a host layer; the rest run on the host);
    where the embedding and the head live."""
    layer_devices: tuple[str, ...]
    device_experts: tuple[frozenset[int] | None, ...]
    n_experts: int
    embed_device: str
    head_device: str
    accelerator: str = ACCELERATOR

    def __post_init__(self):
        if len(self.device_experts) != len(self.layer_devices):
            raise PlacementError("a placement needs one expert set per layer")
        if bad := sorted({d for d in (*self.layer_devices, self.embed_device, self.head_device)}
                         - {self.accelerator, HOST}):
            raise PlacementError(f"devices {bad} are neither the accelerator {self.accelerator} nor {HOST}")
        n = self.gpu_layers
        if any(d != HOST for d in self.layer_devices[n:]):
            raise PlacementError(f"the layers on {self.accelerator} must be a prefix 0..N-1; fits: --gpu-layers {n}")
        if any(s is not None and not all(0 <= e < self.n_experts for e in s) for s in self.device_experts):
            raise PlacementError(f"expert ids must be in 0..{self.n_experts - 1}")
        if stray := [i for i, s in enumerate(self.device_experts) if i >= n and s]:
            raise PlacementError(f"layers {stray} run on {HOST} but hold routed experts on {self.accelerator}: a "
                                 f"partial expert pack belongs to a layer whose attention is on the card; fits: "
                                 f"--gpu-layers {n} with those layers' experts all on {HOST}")

    @property
    def gpu_layers(self) -> int:
        """N: layers 0..N-1 have their attention, state and shared or dense MLP on the card."""
        return next((i for i, d in enumerate(self.layer_devices) if d == HOST), len(self.layer_devices))

    @property
    def gpu_experts(self) -> int | None:
        """K when every card MoE layer holds experts 0..K-1 on the card (0 when no card layer is a
        MoE layer); None when the card layers hold different sets (a device map can say so)."""
        sets = {s for i, s in enumerate(self.device_experts[:self.gpu_layers]) if s is not None}
        if not sets:
            return 0
        only = sets.pop()
        return len(only) if not sets and only == frozenset(range(len(only))) else None

    @property
    def partial_layers(self) -> tuple[int, ...]:
        """Card MoE layers with some routed experts on the host (the seed's `partial_set`, K = 0 included)."""
        return tuple(i for i, s in enumerate(self.device_experts[:self.gpu_layers])
                     if s is not None and len(s) < self.n_experts)

    def flags(self) -> str:
        """The command-line flags that give this placement's layers and packs."""
        k = self.gpu_experts
        if k is None:
            return (f"--gpu-layers {self.gpu_layers} with routed experts per layer as a device map gave them "
                    f"(no one --gpu-experts says it)")
        return f"--gpu-layers {self.gpu_layers} --gpu-experts {'all' if k == self.n_experts else k}"

    def crossings(self, top_k: int) -> float:
        """Expected times the hidden stream (or the sampled token) crosses between the devices in
        one decode step: each change of device along embedding, layers, head and back to the
        embedding (the end of the prefix among them), plus, per card layer whose pack is partial,
        a trip to the host and back when any of the token's top_k experts is there (chance
        `host_pick_chance`, uniform routing)."""
        sites = [self.embed_device, *self.layer_devices, self.head_device, self.embed_device]
        hops = float(sum(a != b for a, b in zip(sites, sites[1:])))
        for i in self.partial_layers:
            hops += 2 * host_pick_chance(len(self.device_experts[i]), self.n_experts, top_k)
        return hops

    def ranked(self, counts: list[list[int] | None]) -> "Placement":
        """The same packs, each partial one holding the experts `counts` (per layer, how often a
        calibration text picked each: models/expert_counts.py) ranks highest, ties to the lower id."""
        if len(counts) != len(self.device_experts):
            raise PlacementError(f"expert counts for {len(counts)} layers, the placement has {len(self.device_experts)}")
        sets = []
        for i, s in enumerate(self.device_experts):
            if i in self.partial_layers and counts[i] is not None:
                c = counts[i]
                s = frozenset(sorted(range(len(c)), key=lambda e: (-c[e], e))[:len(s)])
            sets.append(s)
        return replace(self, device_experts=tuple(sets))

    @classmethod
    def prefix(cls, sizes: ModelSizes, gpu_layers: int, gpu_experts: int, head_on_accelerator: bool,
               embed_on_accelerator: bool = False, accelerator: str = ACCELERATOR) -> "Placement":
        """Layers 0..gpu_layers-1 on the card with experts 0..gpu_experts-1 of each there; the rest on the host."""
        n_layers = len(sizes.layers)
        devices = tuple(accelerator if i < gpu_layers else HOST for i in range(n_layers))
        experts = tuple(None if layer.expert is None else frozenset(range(gpu_experts if i < gpu_layers else 0))
                        for i, layer in enumerate(sizes.layers))
        return cls(devices, experts, sizes.n_experts, accelerator if embed_on_accelerator else HOST,
                   accelerator if head_on_accelerator else HOST, accelerator)

    @classmethod
    def from_flags(cls, sizes: ModelSizes, gpu_layers="auto", gpu_experts="auto", gpu_memory_gib: float = 0.0,
                   host_memory_gib: float = 0.0, *, sequences: int = 1, reserve_gib: float = DEFAULT_RESERVE_GIB,
                   head_on_accelerator: bool | None = None) -> "Placement":
        """`--gpu-layers N|auto --gpu-experts K|all|auto` within the budgets, for a model's `sizes`
        (plan_placement.model_sizes). `head_on_accelerator` None: there when it fits."""
        sizes = resolve_sizes(sizes, {})
        budget = Budget.of(gpu_memory_gib, host_memory_gib, sequences, reserve_gib)
        layers = _flag_value(gpu_layers, "--gpu-layers", None)
        experts = _flag_value(gpu_experts, "--gpu-experts", sizes.n_experts)
        if layers is not None and not 0 <= layers <= len(sizes.layers):
            raise PlacementError(f"{sizes.family} has {len(sizes.layers)} layers: --gpu-layers takes "
                                 f"0..{len(sizes.layers)} or auto, got {layers}; {what_fits(sizes, budget)}")
        if experts is not None and not 0 <= experts <= sizes.n_experts:
            raise PlacementError(f"{sizes.family} has {sizes.n_experts} routed experts per MoE layer: --gpu-experts "
                                 f"takes 0..{sizes.n_experts}, all or auto, got {experts}; {what_fits(sizes, budget)}")
        found = solve(sizes, budget, layers, experts, head_on_accelerator)
        if found is None:
            raise PlacementError(_why_not(sizes, budget, layers, experts, head_on_accelerator))
        return found

    @classmethod
    def from_device_map(cls, device_map: dict, sizes: ModelSizes) -> "Placement":
        """An accelerate-style map ({"model.embed_tokens": "cpu", "model.layers.0": 0, ...,
        "lm_head": 0}; an integer n means cuda:n; a key covers the modules under it, the longest
        key wins). A layer key places the layer whole; "model.layers.i.mlp.experts": "cpu" sends a
        card layer's routed experts to the host (a partial pack holding none of them on the card),
        the one part of a layer a map may place apart. Partial packs of K experts: --gpu-experts."""
        sizes = resolve_sizes(sizes, {})
        devices = {key: _map_device(value, key) for key, value in device_map.items()}
        accelerators = sorted({d for d in devices.values() if d != HOST})
        if len(accelerators) > 1:
            raise PlacementError(f"the device map names {', '.join(accelerators)}: kvfold runs one accelerator plus "
                                 f"host memory; put every accelerated module on {accelerators[0]}")
        accelerator = accelerators[0] if accelerators else ACCELERATOR
        placed = _resolve_map(devices, sizes)
        head = {placed[m] for m in sizes.head_modules}
        if len(head) > 1:
            raise PlacementError(f"{', '.join(sizes.head_modules)} run as one head: map them to one device")
        layer_devices = [placed[f"{sizes.layer_prefix}{i}"] for i in range(len(sizes.layers))]
        n = next((i for i, d in enumerate(layer_devices) if d == HOST), len(layer_devices))
        if stray := [i for i, d in enumerate(layer_devices) if i > n and d != HOST]:
            raise PlacementError(f"layers on {accelerator} must be a prefix 0..N-1, but the map puts layer {n} on "
                                 f"{HOST} and layers {stray} on {accelerator}; fits the rule: --gpu-layers {n} "
                                 f"({f'layers 0..{n - 1}' if n else 'none'} on {accelerator}), or map every layer "
                                 f"before {stray[-1] + 1} to {accelerator}")
        experts = tuple(_map_experts(sizes, placed, i, accelerator) for i in range(len(sizes.layers)))
        return cls(tuple(layer_devices), experts, sizes.n_experts, placed[sizes.embed_module], head.pop(), accelerator)


@dataclass(frozen=True)
class Budget:
    """Bytes the placement may use: the accelerator's memory less the reserve, the host's memory."""
    accelerator: float
    host: float
    sequences: int
    reserve: float
    gpu_memory_gib: float
    host_memory_gib: float

    @classmethod
    def of(cls, gpu_memory_gib: float, host_memory_gib: float, sequences: int = 1,
           reserve_gib: float = DEFAULT_RESERVE_GIB) -> "Budget":
        if not (gpu_memory_gib >= 0 and host_memory_gib >= 0 and reserve_gib >= 0):
            raise PlacementError(f"memory budgets must be >= 0 GiB (got accelerator {gpu_memory_gib}, "
                                 f"host {host_memory_gib}, reserve {reserve_gib})")
        if sequences < 1:
            raise PlacementError(f"a placement holds the state of at least one sequence, got {sequences}")
        # a card smaller than the reserve holds nothing (and an unused card needs no reserve)
        return cls(max(0.0, (gpu_memory_gib - reserve_gib) * GIB), host_memory_gib * GIB, sequences, reserve_gib * GIB,
                   gpu_memory_gib, host_memory_gib)

    def unbounded_host(self) -> "Budget":
        """The same card with a host that holds anything: what the card alone allows."""
        return Budget(self.accelerator, math.inf, self.sequences, self.reserve, self.gpu_memory_gib,
                      self.host_memory_gib)


@dataclass
class Side:
    """What one device holds and reads: weight bytes, state bytes per sequence, decode reads by format."""
    weights: float = 0.0
    state: int = 0
    reads: dict[str, float] = field(default_factory=_zero_reads)

    def add(self, part: PartSizes, count: float = 1.0, read_share: float = 1.0) -> None:
        self.weights += part.weights * count
        for f, b in part.reads.items():
            self.reads[f] += b * read_share

    def need(self, sequences: int) -> float:
        return self.weights + sequences * self.state

    @property
    def read_bytes(self) -> float:
        return sum(self.reads.values())


def split(placement: Placement, sizes: ModelSizes) -> tuple[Side, Side]:
    """(accelerator, host): the bytes each side holds and reads per decode token. A token reads every
    dense part whole, one row of the embedding (in `embed.reads`), and top_k of a layer's E experts:
    from each side in proportion to the experts it holds (uniform routing)."""
    acc, host = Side(), Side()
    for where, on_acc, layer in zip(placement.layer_devices, placement.device_experts, sizes.layers):
        side = host if where == HOST else acc
        side.add(layer.dense)
        side.state += layer.state
        if layer.expert is not None:
            k, e = len(on_acc), sizes.n_experts
            acc.add(layer.expert, k, sizes.top_k * k / e)
            host.add(layer.expert, e - k, sizes.top_k * (e - k) / e)
    (host if placement.embed_device == HOST else acc).add(sizes.embed)
    (host if placement.head_device == HOST else acc).add(sizes.head)
    return acc, host


def fits(placement: Placement, sizes: ModelSizes, budget: Budget) -> bool:
    acc, host = split(placement, sizes)
    return acc.need(budget.sequences) <= budget.accelerator and host.need(budget.sequences) <= budget.host


def _card_fits(placement: Placement, sizes: ModelSizes, budget: Budget) -> bool:
    return split(placement, sizes)[0].need(budget.sequences) <= budget.accelerator


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest n in lo..hi with ok(n), for ok true up to some n and false beyond (None: not even lo)."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def solve(sizes: ModelSizes, budget: Budget, gpu_layers: int | None = None, gpu_experts: int | None = None,
          head_on_accelerator: bool | None = None) -> Placement | None:
    """The placement the flags ask for (None: auto), or None when none fits. Auto, in this order:
    the most layers (with the K asked, or none of their experts), then the head when it fits
    beside them, then the largest K. A head the caller requires is placed before the layers."""
    def card_holds(n: int, k: int, head: bool) -> bool:
        return _card_fits(Placement.prefix(sizes, n, k, head), sizes, budget)

    k_asked = gpu_experts or 0
    head_first = head_on_accelerator is True
    if gpu_layers is None:
        n = _largest(0, len(sizes.layers), lambda m: card_holds(m, k_asked, head_first))
    else:
        n = gpu_layers if card_holds(gpu_layers, k_asked, head_first) else None
    if n is None:
        return None
    head = card_holds(n, k_asked, True) if head_on_accelerator is None else head_on_accelerator
    if gpu_experts is not None:
        k = gpu_experts
    elif any(layer.expert is not None for layer in sizes.layers[:n]):
        k = _largest(0, sizes.n_experts, lambda m: card_holds(n, m, head))
    else:
        k = 0  # no card MoE layer: K says nothing
    whole = Placement.prefix(sizes, n, k, head, embed_on_accelerator=True)
    if n == len(sizes.layers) and k == sizes.n_experts and head and fits(whole, sizes, budget):
        return whole
    found = Placement.prefix(sizes, n, k, head)
    return found if fits(found, sizes, budget) else None


def max_sequences(placement: Placement, sizes: ModelSizes, budget: Budget) -> int:
    """How many sequences of max_seq_len tokens the placement's two sides hold beside its weights."""
    counts = []
    for side, room in zip(split(placement, sizes), (budget.accelerator, budget.host)):
        if side.state:
            counts.append(max(0, int((room - side.weights) // side.state)))
        elif side.weights > room:
            counts.append(0)
    return min(counts) if counts else 0


def _head_words(p: Placement) -> str:
    return "the head on the accelerator" if p.head_device != HOST else "the head on the host"


def what_fits(sizes: ModelSizes, budget: Budget) -> str:
    """The most the budgets hold, as flags, or why nothing does."""
    best = solve(sizes, budget)
    seqs = f"{budget.sequences} sequence{'s' if budget.sequences > 1 else ''} of {sizes.max_seq_len} tokens"
    if best is not None:
        return f"what fits {seqs}: {best.flags()} ({_head_words(best)})"
    # an unbounded host always finds one: the accelerator can hold nothing at all
    most = solve(sizes, budget.unbounded_host())
    host_need = split(most, sizes)[1].need(budget.sequences)
    return (f"nothing fits {seqs}: with the most the accelerator holds ({most.flags()}, {_head_words(most)}) "
            f"the host part needs {host_need / GIB:.2f} GiB, {budget.host_memory_gib:g} GiB given")


def _overflow(sizes: ModelSizes, budget: Budget, placement: Placement) -> str:
    """Which side of `placement` does not fit, by how much, and whether even one sequence's state is the problem."""
    acc, host = split(placement, sizes)
    seq = budget.sequences
    for name, side, room, extra in (("accelerator", acc, budget.accelerator, budget.reserve),
                                    ("host", host, budget.host, 0.0)):
        if side.need(seq) <= room:
            continue
        given = budget.gpu_memory_gib if name == "accelerator" else budget.host_memory_gib
        text = (f"{placement.flags()} ({_head_words(placement)}) needs {(side.need(seq) + extra) / GIB:.2f} GiB of "
                f"{name} memory (weights {side.weights / GIB:.2f} + state {side.state / GIB:.2f} x {seq} "
                f"sequence{'s' if seq > 1 else ''}" + (f" + reserve {extra / GIB:.2f}" if extra else "")
                + f"), {given:g} GiB given")
        if side.weights <= room < side.weights + side.state:
            text += f": it cannot hold the state of even one sequence of {sizes.max_seq_len} tokens"
        elif side.weights <= room:
            text += f": its weights leave room for {int((room - side.weights) // side.state)} sequences"
        return text
    return "it fits"


def _why_not(sizes: ModelSizes, budget: Budget, layers: int | None, experts: int | None,
             head: bool | None) -> str:
    """Why no placement answers the flags: the accelerator cannot hold what they ask, or, with the
    most it holds, the host cannot hold the rest; then what fits."""
    asked = solve(sizes, budget.unbounded_host(), layers, experts, head)
    if asked is None:
        asked = Placement.prefix(sizes, layers or 0, experts or 0, bool(head))
    elif asked == solve(sizes, budget.unbounded_host()):
        return what_fits(sizes, budget)  # the flags ask for the most the accelerator holds: one story to tell
    return _overflow(sizes, budget, asked) + "; " + what_fits(sizes, budget)


def check_fits(placement: Placement, sizes: ModelSizes, budget: Budget) -> None:
    """Refuse a placement (from a device map, say) that the budgets cannot hold, saying what fits."""
    if not fits(placement, sizes, budget):
        raise PlacementError(_overflow(sizes, budget, placement) + "; " + what_fits(sizes, budget))


def check_devices_exist(placement: Placement) -> None:
    """At load: refuse a placement naming an accelerator this process cannot use. (Card experts
    belong to card layers, so the layers, embedding and head name every device used.)"""
    used = {d for d in (*placement.layer_devices, placement.embed_device, placement.head_device) if d != HOST}
    if not used:
        return
    import torch
    device = used.pop()
    if not device.startswith("cuda"):
        raise PlacementError(f"{device} is not an accelerator kvfold places layers on; use cuda:N or {HOST}")
    if not torch.cuda.is_available():
        raise PlacementError(f"the placement puts layers or the head on {device}, but torch.cuda.is_available() is "
                             f"False (no CUDA device, or a CPU-only torch); what fits: everything on the host "
                             f"(--gpu-layers 0 --gpu-experts 0 --gpu-memory-gib 0)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise PlacementError(f"the placement names {device}, but this process sees {torch.cuda.device_count()} CUDA "
                             f"device(s): cuda:0..cuda:{torch.cuda.device_count() - 1} (CUDA_VISIBLE_DEVICES?)")


def resolve_sizes(cfg, sizing: dict) -> ModelSizes:
    """The ModelSizes a placement is made for (plan_placement.model_sizes makes them from a config)."""
    if not isinstance(cfg, ModelSizes) or sizing:
        raise TypeError("a placement is made for a ModelSizes, e.g. plan_placement.model_sizes(config, weights=..., "
                        "kv_dtype=..., max_seq_len=...)")
    return cfg


def _flag_value(value, flag: str, all_means: int | None) -> int | None:
    """None for "auto", `all_means` for "all" (where the flag takes it), else the count (an int, or
    a string of one, as the command line gives it)."""
    if value == "auto":
        return None
    if value == "all" and all_means is not None:
        return all_means
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).lstrip("-").isdigit():
        takes = "a count, all or auto" if all_means is not None else "a count or auto"
        raise PlacementError(f"{flag} takes {takes}, got {value!r}")
    return int(value)


def _map_device(value, key: str) -> str:
    text = str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if text == HOST:
        return HOST
    if text == "cuda" or re.fullmatch(r"cuda:\d+", text):
        return text if ":" in text else ACCELERATOR
    raise PlacementError(f"the device map puts {key!r} on {value!r}: kvfold places modules on one CUDA device "
                         f"(an integer n or 'cuda:n') or on 'cpu' (no disk or meta offload)")


def _map_units(sizes: ModelSizes) -> tuple[list[str], list[str]]:
    """(the modules kvfold places as a whole in model order, the MoE layers' routed-expert modules)."""
    layers = [f"{sizes.layer_prefix}{i}" for i in range(len(sizes.layers))]
    experts = [f"{name}.{EXPERTS_MODULE}" for name, layer in zip(layers, sizes.layers) if layer.expert is not None]
    return [sizes.embed_module, *layers, *sizes.head_modules], experts


def _check_map_key(key: str, units: list[str], experts: list[str], n_head: int) -> None:
    """Refuse a key that names no module, or a part of a layer other than its routed experts as a whole."""
    def above(unit: str) -> bool:
        return key == "" or unit == key or unit.startswith(key + ".")
    if any(above(u) for u in units) or key in experts:
        return
    if (pack := next((e for e in experts if key.startswith(e + ".")), None)) is not None:
        raise PlacementError(f"the device map places {key!r}, a part of {pack!r}: a map places a layer's routed "
                             f"experts all together; a partial pack of experts 0..K-1 on the card is --gpu-experts K")
    if (inside := next((u for u in units if key.startswith(u + ".")), None)) is not None:
        if key.endswith("." + EXPERTS_MODULE):
            raise PlacementError(f"the device map places {key!r}, but {inside} has a dense MLP, no routed experts")
        raise PlacementError(f"the device map places {key!r}, a part of {inside!r}: kvfold keeps a layer's attention, "
                             f"state, router and shared expert or dense MLP on one device; map {inside!r}, and "
                             f"'{inside}.{EXPERTS_MODULE}' to {HOST} for its routed experts on the host")
    raise PlacementError(f"the device map names {key!r}, which this model does not have; its modules are "
                         f"{units[0]}, {units[1]}..{units[-1 - n_head]}, {', '.join(units[-n_head:])}, and "
                         f"{{layer}}.{EXPERTS_MODULE} for a MoE layer's routed experts")


def _resolve_map(devices: dict[str, str], sizes: ModelSizes) -> dict[str, str]:
    """{module: device} for every whole unit and every routed-expert module, by the longest key
    that is the module or one above it."""
    units, experts = _map_units(sizes)
    for key in devices:
        _check_map_key(key, units, experts, len(sizes.head_modules))
    placed = {}
    for unit in units + experts:
        keys = [k for k in devices if k == "" or unit == k or unit.startswith(k + ".")]
        if not keys:
            raise PlacementError(f"the device map places no device for {unit!r}; map it (or a module above it)")
        placed[unit] = devices[max(keys, key=len)]
    return placed


def _map_experts(sizes: ModelSizes, placed: dict[str, str], i: int, accelerator: str) -> frozenset[int] | None:
    """Layer i's routed experts on the card: all of them where they follow a card layer, none where
    the map sends them to the host; a host layer's experts may not be on the card."""
    if sizes.layers[i].expert is None:
        return None
    layer = f"{sizes.layer_prefix}{i}"
    where = placed[f"{layer}.{EXPERTS_MODULE}"]
    if where == HOST:
        return frozenset()
    if placed[layer] == HOST:
        raise PlacementError(f"the device map puts '{layer}.{EXPERTS_MODULE}' on {accelerator} but {layer} on "
                             f"{HOST}: a host layer runs all its routed experts on the host (a card pack serves "
                             f"a layer whose attention is on the card); map {layer} to {accelerator} too, or its "
                             f"experts to {HOST}")
    return frozenset(range(sizes.n_experts))

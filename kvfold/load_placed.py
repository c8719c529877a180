"""`kvfold.load_model(..., placement=... or gpu_layers=..., gpu_experts=...)`: a model loaded on the
host, planned by kvfold/placement.py and split across one accelerator and host memory
(`CausalLM.place`); and the flags `kvfold generate` and `kvfold serve` take for it
(llama.cpp's `-ngl N --n-cpu-moe`, flyweight's expert offload: `--gpu-layers`, `--gpu-experts`).

The order, so that a request that cannot run is refused before a (possibly large) checkpoint
loads: the options are checked; the budgets are read, given or measured (the card's free memory
from torch.cuda.mem_get_info, the host's MemAvailable from /proc/meminfo, both before the load, so
that the host's figure still counts the memory the weights are about to take); a request naming
an accelerator this process cannot use is refused; then the model loads on the host, its byte
counts are taken from the loaded tensors (`loaded_sizes`), the placement is made within the
budgets or checked against them (the planner's refusals, which say what fits), and the model is
placed.

The byte counts are the loaded model's, not plan_placement.model_sizes' (a bf16 meta model built
from a config): a placement must fit what this load holds, in its dtype and weight residency,
with its MTP block, which moves with the head.

The whole model is on the host once, between the load and the placement: a model larger than host
memory cannot be loaded this way even where card and host together would hold it.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .argtypes import count_or, nonneg_float
from .errors import ConfigError, PlacementError
from .placement import (ACCELERATOR, DEFAULT_RESERVE_GIB, GIB, HOST, Budget, LayerSizes, ModelSizes, PartSizes,
                        Placement, check_devices_exist, check_fits)

DEFAULT_MAX_SEQ_LEN = 4096  # serve's default --max-seq-len: what one sequence's state is sized for
_NO_CARD_HINT = ("what runs here: everything on the host (--gpu-layers 0 --gpu-experts 0 --gpu-memory-gib 0), or "
                 "--virtual-devices (virtual_devices=) to check a placement with every device on the CPU")


@dataclass(frozen=True)
class PlacementRequest:
    """kvfold.load_model's placement keywords. `placement`: a Placement or an accelerate-style
    device map; else the flags make one (`gpu_layers`/`gpu_experts`: a count, "auto", "all" for
    experts). Budgets in GiB, None: measured. The budgets hold `sequences` states of `max_seq_len`
    tokens in `kv_dtype` beside the weights. `virtual_devices`: a VirtualDevices test mode."""
    placement: Placement | dict | None = None
    gpu_layers: int | str | None = None
    gpu_experts: int | str | None = None
    gpu_memory_gib: float | None = None
    host_memory_gib: float | None = None
    gpu_reserve_gib: float | None = None
    expert_policy: str = "static"
    virtual_devices: object = None
    max_seq_len: int | None = None
    sequences: int | None = None
    kv_dtype: str | None = None
    # partial packs made from the flags hold the experts these routing counts rank highest
    # (models/expert_counts.py): None: the checkpoint's expert_counts.json where it has one;
    # a path; False: experts 0..K-1
    expert_counts: str | Path | bool | None = None

    @property
    def placing(self) -> bool:
        """Whether anything asks for a placement (else load_model loads as it always has)."""
        return any(v is not None for v in (self.placement, self.gpu_layers, self.gpu_experts, self.gpu_memory_gib,
                                           self.host_memory_gib))

    @property
    def reserve_gib(self) -> float:
        return DEFAULT_RESERVE_GIB if self.gpu_reserve_gib is None else self.gpu_reserve_gib


def load_placed(path, device, dtype: torch.dtype, request: PlacementRequest, **kwargs):
    """kvfold.load_model: the registry's load, then the placement `request` asks for (if any)."""
    from .models.registry import checkpoint_dir, family_of, load
    if not request.placing:
        _refuse_without_placement(request)
        return load(path, device=device, dtype=dtype, **kwargs)
    _check_request(request, device, kwargs)
    gpu_gib, host_gib = _budget_gib(request)
    budget = Budget.of(gpu_gib, host_gib, request.sequences or 1, request.reserve_gib)  # refuses bad numbers
    _refuse_missing_accelerator(request)
    directory = checkpoint_dir(path)
    _refuse_host_below_checkpoint(directory, host_gib)
    model = load(path, device=HOST, dtype=dtype, **kwargs)
    family = family_of(directory).name if directory is not None else "deepseek_v4"  # tiny-random is one
    sizes = loaded_sizes(model, family, request.max_seq_len or DEFAULT_MAX_SEQ_LEN, request.kv_dtype)
    placement = _resolve(request, sizes, budget)
    counts = _counts_path(request, directory)
    if counts is not None and placement.partial_layers:
        from .models import expert_counts
        placement = placement.ranked(expert_counts.load(counts, model))
    model.place(placement, virtual=request.virtual_devices, expert_policy=request.expert_policy)
    model.devices.counts = counts
    return model


def _counts_path(request: PlacementRequest, directory: Path | None) -> Path | None:
    """The routing counts a flags-made static placement ranks its packs by, or None."""
    from .models.expert_counts import FILE
    if request.placement is not None or request.expert_policy != "static" or request.expert_counts is False:
        return None
    if request.expert_counts not in (None, True):
        return Path(request.expert_counts)
    found = directory / FILE if directory is not None else None
    if request.expert_counts is True and (found is None or not found.is_file()):
        raise PlacementError(f"no {FILE} beside the checkpoint; make it with kvfold calibrate-experts")
    return found if found is not None and found.is_file() else None


def _refuse_host_below_checkpoint(directory: Path | None, host_gib: float) -> None:
    """The model is whole in host memory between the load and `place` (the module docstring): a
    host budget below the checkpoint's own bytes is refused before the load, not met by the OOM
    killer. (Loading each part straight to its device is not built.)"""
    files = sorted(directory.glob("*.safetensors")) if directory is not None else []
    need = sum(f.stat().st_size for f in files) / GIB
    if need > host_gib:
        raise PlacementError(f"nothing fits: kvfold loads a model whole into host memory before it splits it, and "
                             f"this checkpoint's files hold {need:.2f} GiB, more than the {host_gib:.2f} GiB of host "
                             f"memory (--host-memory-gib, or MemAvailable); load it on a host with more memory")


def _refuse_without_placement(request: PlacementRequest) -> None:
    given = (("virtual_devices", request.virtual_devices), ("gpu_reserve_gib", request.gpu_reserve_gib),
             ("max_seq_len", request.max_seq_len), ("sequences", request.sequences), ("kv_dtype", request.kv_dtype))
    stray = [name for name, v in given if v is not None]
    stray += ["expert_policy"] if request.expert_policy != "static" else []
    if stray:
        raise ConfigError(f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} only to a model split "
                          f"across an accelerator and the host: "
                          f"give a placement too (placement=, or gpu_layers=/gpu_experts=/gpu_memory_gib=; on the "
                          f"command line --gpu-layers, --gpu-experts, --gpu-memory-gib or --device-map)")


def _check_request(request: PlacementRequest, device, kwargs: dict) -> None:
    """Refusals that need no model (PlacementError, before the load)."""
    from .layers.virtual_devices import VirtualDevices
    from .models.split_experts import POLICIES
    try:
        kind = torch.device(device).type
    except RuntimeError:  # not a device name at all: not the host either
        kind = str(device)
    if kind != HOST:
        raise PlacementError(f"device={str(device)!r} with a placement: a placed model loads on the host and moves "
                             f"each part to its own device; leave device at 'cpu' (--device cpu), the placement names "
                             f"the accelerator ({ACCELERATOR} for gpu_layers/gpu_experts, a device map its own)")
    if request.placement is not None and (request.gpu_layers is not None or request.gpu_experts is not None):
        raise PlacementError("give a placement (or device map) or gpu_layers/gpu_experts, not both: the flags make a "
                             "placement; use the flags, or put what they say in the map")
    if request.placement is not None and not isinstance(request.placement, (Placement, dict)):
        raise PlacementError(f"placement must be a kvfold.placement.Placement or a device map dict "
                             f"({{module: device}}), got {type(request.placement).__name__}")
    if kwargs.get("tp", 1) != 1:
        raise PlacementError(f"tp={kwargs['tp']} with a placement: a placement splits one whole model across one "
                             f"accelerator and the host; use tp=1 (--tp 1), or tensor parallelism without a placement")
    if request.expert_policy not in POLICIES:
        raise PlacementError(f"expert_policy must be one of {', '.join(POLICIES)}, got {request.expert_policy!r}")
    vd = request.virtual_devices
    if vd is not None and not isinstance(vd, VirtualDevices):
        raise PlacementError(f"virtual_devices must be a kvfold.layers.virtual_devices.VirtualDevices, got "
                             f"{type(vd).__name__}")
    # A mode that is not entered sees no op: the split would run unchecked and pass vacuously.
    if vd is not None and not vd.entered:
        raise PlacementError("virtual_devices must be entered around the load and every call that runs the model: "
                             "`with vd: model = kvfold.load_model(..., virtual_devices=vd); ...`")


def _budget_gib(request: PlacementRequest) -> tuple[float, float]:
    """(accelerator, host) memory in GiB: given, or measured now (before the load)."""
    gpu = request.gpu_memory_gib
    if gpu is None:
        gpu = _free_accelerator_gib(request)
    host = request.host_memory_gib
    return gpu, host if host is not None else _available_host_gib()


def _free_accelerator_gib(request: PlacementRequest) -> float:
    if request.virtual_devices is not None:
        raise PlacementError("virtual devices have no accelerator memory to measure: give gpu_memory_gib "
                             "(--gpu-memory-gib G), the card the placement is planned and checked for")
    if not torch.cuda.is_available():
        raise PlacementError(f"no gpu_memory_gib (--gpu-memory-gib) was given, and there is no accelerator to measure: "
                             f"torch.cuda.is_available() is False (no CUDA device, or a CPU-only torch); "
                             f"{_NO_CARD_HINT}")
    free, _total = torch.cuda.mem_get_info(torch.device(_accelerator(request)))
    return free / GIB


def _available_host_gib() -> float:
    """MemAvailable of /proc/meminfo: what the host can hold without swapping."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        found = None
    if found is None:
        raise PlacementError("no host_memory_gib (--host-memory-gib) was given and /proc/meminfo has no MemAvailable "
                             "to measure it from on this system: give it")
    return int(found.group(1)) * 1024 / GIB


def _map_accelerators(device_map: dict) -> list[str]:
    """The CUDA devices a device map names, as cuda:n (what else it names, from_device_map refuses)."""
    out = []
    for v in device_map.values():
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            out.append(f"cuda:{v}")
        elif str(v) == "cuda" or re.fullmatch(r"cuda:\d+", str(v)):
            out.append(ACCELERATOR if str(v) == "cuda" else str(v))
    return out


def _accelerator(request: PlacementRequest) -> str:
    """The accelerator the request names: a Placement's, a device map's first, else cuda:0."""
    p = request.placement
    if isinstance(p, Placement):
        return p.accelerator
    named = _map_accelerators(p) if isinstance(p, dict) else []
    return named[0] if named else ACCELERATOR


def _refuse_missing_accelerator(request: PlacementRequest) -> None:
    """A request that names the card on a machine without CUDA: refused before the load
    (check_devices_exist's words). `auto` can still choose the host alone: the placement is
    checked again when it is made."""
    if request.virtual_devices is not None or torch.cuda.is_available():
        return
    p = request.placement
    if isinstance(p, Placement):
        check_devices_exist(p)
        return
    layers = request.gpu_layers
    named = bool(_map_accelerators(p)) if isinstance(p, dict) else \
        isinstance(layers, int) and not isinstance(layers, bool) and layers > 0
    if named:
        accelerator = _accelerator(request)
        check_devices_exist(Placement((accelerator,), (None,), 0, HOST, HOST, accelerator))


def _resolve(request: PlacementRequest, sizes: ModelSizes, budget: Budget) -> Placement:
    """The placement the flags make within `budget`, or the one given, checked against it."""
    from .models.placed import DeviceMap
    p = request.placement
    if p is None:
        auto = lambda v: "auto" if v is None else v  # noqa: E731
        return Placement.from_flags(sizes, auto(request.gpu_layers), auto(request.gpu_experts),
                                    budget.gpu_memory_gib, budget.host_memory_gib, sequences=budget.sequences,
                                    reserve_gib=request.reserve_gib)
    if isinstance(p, dict):
        p = Placement.from_device_map(p, sizes)
    # made for this model's shape (a Placement may not be), before its bytes are counted
    DeviceMap(p, request.virtual_devices).check_model(len(sizes.layers), [ls.expert is not None for ls in sizes.layers],
                                                      sizes.n_experts)
    check_fits(p, sizes, budget)
    return p


# ---- byte counts of a loaded model ------------------------------------------------------------------
def loaded_sizes(model, family: str, max_seq_len: int, kv_dtype: str | None = None) -> ModelSizes:
    """The ModelSizes placement.py plans with, from a loaded (not yet placed) model: its units as
    `place` moves them, the bytes of their tensors, and each layer's state for one sequence of
    `max_seq_len` tokens (from a twin of the model on the meta device: nothing is allocated)."""
    embed, blocks, head = model._placement_units()
    names = {id(m): n for n, m in model.named_modules()}
    cfg = model.config
    layers = []
    for block, state in zip(blocks, _layer_state_bytes(model, max_seq_len, kv_dtype)):
        experts = getattr(block.mlp, "experts", None)
        one = None if experts is None else _scaled(_part([experts]), 1 / cfg.n_routed_experts)
        layers.append(LayerSizes(_part([block], skip=experts), one, state))
    residency = "quantized as stored" if model.quantized_weights() else "dequantized"
    settings = f"weights {str(model.dtype).removeprefix('torch.')} ({residency}), kv {kv_dtype or 'model dtype'}"
    return ModelSizes(family, model.num_parameters(), tuple(layers), cfg.n_routed_experts, cfg.num_experts_per_tok,
                      _part(embed, lookup=True), _part(head), tuple(names[id(m)] for m in head), settings, max_seq_len,
                      embed_module=names[id(embed[0])], layer_prefix=names[id(blocks[0])].rpartition(".")[0] + ".")


def _layer_state_bytes(model, max_seq_len: int, kv_dtype: str | None) -> list[int]:
    twin = type(model)(model.config, dtype=model.dtype, device="meta")
    state = twin.new_state(capacity=max_seq_len, kv_dtype=kv_dtype)
    try:
        return [layer.nbytes for layer in state.layers]
    finally:
        state.free()


def _part(modules: list[nn.Module], skip: nn.Module | None = None, lookup: bool = False) -> PartSizes:
    """Bytes the tensors of `modules` (less those under `skip`) hold, and read per decode token by
    format: all of each, but one row of a lookup table (the embedding when `lookup`, V4's hash
    routing table `tid2eid`). A QuantizedWeight's bytes and scales count in its format."""
    from .layers.basic import QuantizedWeight
    skipped = set() if skip is None else {id(t) for t in (*skip.parameters(), *skip.buffers())}
    held, reads = 0.0, PartSizes(0.0).reads
    for top in modules:
        for module in top.modules():
            fmt = module.fmt if isinstance(module, QuantizedWeight) else None
            for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
                if id(t) in skipped:
                    continue
                held += t.nbytes
                share = 1 / t.shape[0] if (lookup or name == "tid2eid") and t.dim() and t.shape[0] else 1.0
                reads[fmt or _storage_format(t)] += t.nbytes * share
    return PartSizes(held, reads)


def _storage_format(t: torch.Tensor) -> str:
    if t.dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "fp8" if t.dtype.is_floating_point and t.element_size() == 1 else "f32"


def _scaled(part: PartSizes, factor: float) -> PartSizes:
    return PartSizes(part.weights * factor, {f: b * factor for f, b in part.reads.items()})


def describe(model) -> str:
    """A placed model's placement in one line (what `kvfold generate` and `serve` print)."""
    d = model.devices
    p = d.placement
    mode = "; virtual devices: every device is the CPU, each side checked" if d.virtual is not None else ""
    if getattr(d, "counts", None) is not None:
        mode = f"; packs ranked by {d.counts}" + mode
    return (f"placement: {p.flags()}, embedding on {p.embed_device}, head on {p.head_device} "
            f"(of {len(p.layer_devices)} layers and {p.n_experts} routed experts each){mode}")


# ---- command-line flags (kvfold generate, kvfold serve) ---------------------------------------------
def device_map_arg(text: str) -> dict:
    """--device-map: a file holding a JSON object, or the object itself ({"model.layers.0": 0, ...})."""
    try:
        source = Path(text).read_text() if Path(text).is_file() else text
        value = json.loads(source)
    except (OSError, ValueError) as exc:  # ValueError: also a name too long to be a path
        raise argparse.ArgumentTypeError(f"{text!r} is neither a file holding a JSON device map nor one "
                                         f"({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('a device map is a JSON object {"module": device}, with device an '
                                         'integer n (cuda:n), "cuda:n" or "cpu"')
    return value


def add_placement_arguments(p: argparse.ArgumentParser, virtual_help: str) -> None:
    """The flags that split the model across one accelerator and host memory (none: as before)."""
    g = p.add_argument_group("one accelerator plus host memory (kvfold plan shows the same placement; without "
                             "these flags the whole model runs on --device)")
    g.add_argument("--gpu-layers", type=count_or("auto"), default=None, metavar="N|auto",
                   help="layers 0..N-1 keep attention, state, router and shared or dense MLP on the accelerator, "
                        "N.. run on the host; auto: the most that fit")
    g.add_argument("--gpu-experts", type=count_or("all", "auto"), default=None, metavar="K|all|auto",
                   help="routed experts 0..K-1 of each accelerator layer held there, the rest run on the host; "
                        "auto (default with --gpu-layers): the most that fit")
    g.add_argument("--gpu-memory-gib", type=nonneg_float, default=None, metavar="G",
                   help="accelerator memory to plan for (default: its free memory, torch.cuda.mem_get_info)")
    g.add_argument("--host-memory-gib", type=nonneg_float, default=None, metavar="H",
                   help="host memory to plan for (default: MemAvailable of /proc/meminfo)")
    g.add_argument("--gpu-reserve-gib", type=nonneg_float, default=None, metavar="R",
                   help=f"accelerator memory kept back for activations and the CUDA context "
                        f"(default {DEFAULT_RESERVE_GIB:g})")
    g.add_argument("--expert-policy", choices=("static", "lru"), default="static",
                   help="static: each accelerator layer holds experts 0..K-1; lru: K slots holding the experts "
                        "used most recently (default static)")
    g.add_argument("--expert-counts", default=None, metavar="PATH|none",
                   help="routing counts (kvfold calibrate-experts) that choose each partial pack's experts: the "
                        "K picked most (default: the checkpoint's expert_counts.json where it has one; none: "
                        "experts 0..K-1)")
    g.add_argument("--device-map", type=device_map_arg, default=None, metavar="JSON_OR_PATH",
                   help='accelerate-style map, e.g. {"model.embed_tokens": "cpu", "model.layers.0": 0, ..., '
                        '"model.layers.0.mlp.experts": "cpu", "lm_head": 0}, or a file holding one')
    g.add_argument("--virtual-devices", action="store_true", help=virtual_help)


def placement_options(args: argparse.Namespace, *, virtual=None, max_seq_len: int | None = None,
                      sequences: int | None = None, kv_dtype: str | None = None) -> dict:
    """kvfold.load_model's placement keywords from the flags: {} when none was given (the load is
    then exactly the one without placement). The sizing keywords join only a placement."""
    flags = {"placement": getattr(args, "device_map", None), "gpu_layers": getattr(args, "gpu_layers", None),
             "gpu_experts": getattr(args, "gpu_experts", None), "gpu_memory_gib": getattr(args, "gpu_memory_gib", None),
             "host_memory_gib": getattr(args, "host_memory_gib", None),
             "gpu_reserve_gib": getattr(args, "gpu_reserve_gib", None), "virtual_devices": virtual}
    options = {k: v for k, v in flags.items() if v is not None}
    if getattr(args, "expert_policy", "static") != "static":
        options["expert_policy"] = args.expert_policy
    counts = getattr(args, "expert_counts", None)
    if counts is not None:
        options["expert_counts"] = False if counts == "none" else counts
    if PlacementRequest(**options).placing:
        options.update(max_seq_len=max_seq_len, sequences=sequences, kv_dtype=kv_dtype)
    return options

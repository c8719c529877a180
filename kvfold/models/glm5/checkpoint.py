"""Load a GLM-5.3 (`glm5_next`) checkpoint directory into a `Glm5Model`.

Weights are named as the text part of a transformers `Glm5NextForConditionalGeneration` checkpoint
written by `save_pretrained` (`model.language_model.*`, `hc_attn_fn`, `q_conv1d`, per-expert
`experts.N.gate_proj`); the in-memory layout (`attn_hc.fn`, fused `conv1d`, `forget_gate.*`,
stacked `experts.gate_up_proj`) and text-only `model.*` names load as well.

Block-FP8 checkpoints (the GLM-5.3 release's format, docs/checkpoints.md): a quantized weight is
stored float8_e4m3fn under its usual name with `<name>_scale_inv` beside it, one scale per block of
config.json's `quantization_config.weight_block_size`, W[i, j] = q[i, j] * scale_inv[i // br, j // bc].
Which tensors are FP8 is read from the files (their dtype), not assumed. `weights="dequant"` decodes
them into the model dtype at load, `weights="quantized"` keeps them as `QuantizedWeight`s; both use
the decoder DeepSeek-V4's loader uses (`dequant_into`, `QuantizedWeight.load_`), so logits are
bit-identical. Every FP8 tensor and scale is checked from the file headers before the model is built.

Tensors are read one at a time as views of the memory-mapped safetensors files (DeepSeek-V4's
`CheckpointReader`); weights held as stored keep the views, each routed expert's tensors as pieces
of its stack, read in place (docs/checkpoints.md).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch

from ...errors import CheckpointError, ConfigError
from ...progress import ByteProgress
from ...layers.basic import QuantizedWeight, hold_quantized, weight_slots
from ..deepseek_v4.checkpoint import (WEIGHT_RESIDENCIES, CheckpointReader, expert_pieces, held_format,
                                      note_unlocked)
from ...numerics.quant_formats import BF16, FP8, QuantSettings, dequant_into, expected_scale_shape
from .config import fp8_weight_block, load_glm5_config, read_config_json
from .model import Glm5Model
from .mtp import Glm5Mtp
from .sharding import tp_counts, tp_slice
from ...parallel import TensorParallel, check_divides, local_expert, skips_shared_expert

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.")
_VISION_MARKERS = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.")
_HC_NAMES = {"hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
             "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale"}
_FUSED_CONV = ".self_attn.conv1d.weight"  # in-memory layout: q|k|v taps in one tensor

_FP8_STORED = "F8_E4M3"
_SCALE_STORED = {"F32", "BF16", "F16", "F8_E8M0", "U8"}
_MAX_LISTED = 20


def _internal(name: str, n_layers: int) -> tuple[str, str | None]:
    """(kind, internal name): kind "text" (the MTP layer's tensors under `mtp.`), "vision" or "skip"
    (further MTP layers, the MTP layer's copies of the embedding and head)."""
    bare = name
    for m in ("model.", ""):
        if any(bare.startswith(m + v) for v in _VISION_MARKERS):
            return "vision", None
    if bare == "lm_head.weight" or bare.startswith("lm_head."):
        return "text", bare
    for p in _TEXT_PREFIXES:
        if bare.startswith(p):
            bare = bare[len(p):]
            break
    else:
        return "skip", None
    parts = bare.split(".")
    if parts[0] == "layers" and int(parts[1]) == n_layers:  # the MTP layer (mtp.py)
        if parts[2] == "embed_tokens" or parts[2:4] == ["shared_head", "head"]:
            return "skip", None  # the main model's embedding and lm_head serve it
        return "text", "mtp." + ".".join(parts[2:])
    if parts[0] == "layers":
        if int(parts[1]) > n_layers or "shared_head" in parts or parts[2] in ("eh_proj", "enorm", "hnorm"):
            return "skip", None  # further MTP layers (one is read) and stray heads
        if parts[2] in _HC_NAMES:
            parts = parts[:2] + _HC_NAMES[parts[2]].split(".") + parts[3:]
        if parts[2] == "self_attn" and parts[3] == "forget_gate":
            parts = parts[:3] + parts[4:]
    return "text", "model." + ".".join(parts)


class _Slot(NamedTuple):
    """Where a checkpoint tensor goes: a model tensor (parameter, buffer or QuantizedWeight), or one
    expert's part of a stacked one (gate_proj and up_proj fill the two halves of gate_up_proj)."""
    name: str
    expert: int | None = None
    part: str | None = None  # "gate_proj", "up_proj" or "down_proj" with an expert


def _slot_of(name: str) -> _Slot:
    parts = name.split(".")
    e = next((i for i in range(len(parts) - 3) if parts[i] == "experts" and parts[i + 1].isdigit()), None)
    if e is not None:  # <module>.experts.N.gate_proj.weight
        which = parts[e + 2]
        if which not in ("gate_proj", "up_proj", "down_proj"):
            raise CheckpointError(f"unknown expert tensor {name}: experts have gate_proj, up_proj and down_proj")
        stacked = ".down_proj" if which == "down_proj" else ".gate_up_proj"
        return _Slot(".".join(parts[:e + 1]) + stacked, int(parts[e + 1]), which)
    if ".self_attn." in name and name.endswith("_conv1d.weight"):
        return _Slot(name[:-len(".weight")])
    return _Slot(name)


def _expert_rows(slot: _Slot, inter: int) -> slice | None:
    """The rows of one expert's gate_up_proj that its gate_proj (first half) or up_proj fills."""
    if slot.part == "gate_proj":
        return slice(0, inter)
    return slice(inter, 2 * inter) if slot.part == "up_proj" else None


def _text_tensors(reader: CheckpointReader, n_layers: int):
    """(checkpoint key, internal name) of every tensor the text model loads; the scale companions of
    weights are not among them (a scale whose weight is absent is)."""
    for key in reader.weight_keys:
        kind, name = _internal(key, n_layers)
        if kind == "text":
            yield key, name


def check_quantized_tensors(reader: CheckpointReader, n_layers: int, block: tuple[int, int] | None) -> None:
    """Refuse, from the file headers alone, every FP8 weight or block scale kvfold cannot decode, in one
    CheckpointError naming each tensor: an FP8 weight without its `_scale_inv`, a scale without its
    weight, a scale whose shape is not the weight's blocks under config.json's weight_block_size
    (another block size), a scale of an unknown dtype, FP8 dtypes other than e4m3, and FP8 or scaled
    weights in a checkpoint whose config declares no weight_block_size."""
    problems = []
    for key, name in sorted(_text_tensors(reader, n_layers)):
        entry, scale_key = reader.entries[key], reader.scales.get(key)
        if key.endswith("_scale_inv"):
            problems.append(f"{key} is a block scale, but its weight {key.removesuffix('_scale_inv')} is not in "
                            f"the checkpoint")
        elif entry.dtype.startswith("F8_") and entry.dtype != _FP8_STORED:
            problems.append(f"{key} is stored {entry.dtype}: kvfold reads FP8 weights in e4m3 ({_FP8_STORED}) only")
        elif scale_key is None:
            if entry.dtype == _FP8_STORED:
                problems.append(f"{key} is stored {_FP8_STORED} but has no block scale {key}_scale_inv next to it")
        elif block is None:
            problems.append(f"{key} has a block scale {scale_key}, but config.json declares no "
                            f"quantization_config.weight_block_size to read it with")
        elif name.endswith(_FUSED_CONV) or len(entry.shape) < 2:
            problems.append(f"{key} {list(entry.shape)} has a block scale, but kvfold decodes block-FP8 only in "
                            f"projection and expert weight matrices")
        else:
            scale = reader.entries[scale_key]
            want = expected_scale_shape(entry.shape, FP8, QuantSettings(fp8_block=block))
            if scale.dtype not in _SCALE_STORED:
                problems.append(f"{scale_key} is stored {scale.dtype}; block scales must be one of "
                                f"{sorted(_SCALE_STORED)}")
            elif tuple(scale.shape) != want:
                problems.append(f"{scale_key} has shape {list(scale.shape)}, but {key} {list(entry.shape)} in "
                                f"weight_block_size {list(block)} blocks needs {list(want)}")
    if problems:
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"checkpoint {reader.directory}: {len(problems)} FP8 weights cannot be decoded, "
                              f"nothing was loaded; check the files against config.json's quantization_config: "
                              + "; ".join(problems[:_MAX_LISTED]) + more)


def _keep_resident(model: Glm5Model, reader: CheckpointReader, block: tuple[int, int] | None) -> None:
    """weights="quantized": replace every float slot whose checkpoint tensors are all FP8 with scales
    (or all bf16 in an fp32 model: exact, half the bytes, as DeepSeek-V4's loader holds them), and
    whose module lists it in `quantizable`, by an empty `QuantizedWeight` of the stored format.
    Stacked experts whose gate / up halves do not fill whole row blocks (moe_intermediate_size not a
    multiple of the block's rows) keep one scale per row, so no block straddles gate and up."""
    cfg = model.config
    found: dict[str, list[tuple[str | None, _Slot, str | None]]] = {}
    for key, name in _text_tensors(reader, cfg.num_hidden_layers):
        if name.endswith(_FUSED_CONV):
            continue
        slot, scale_key = _slot_of(name), reader.scales.get(key)
        fmt = held_format(reader.entries[key].dtype, scale_key is not None, model.dtype)
        found.setdefault(slot.name, []).append((fmt, slot, reader.entries[scale_key].dtype if scale_key else None))
    for name, parts in found.items():
        fmts = {fmt for fmt, _, _ in parts}
        if len(fmts) != 1 or None in fmts:
            continue  # float, or a mix of formats: loaded as floats
        fmt = fmts.pop()
        pieces = expert_pieces([s.part if s.expert is not None else None for _, s, _ in parts])
        if fmt == BF16:
            hold_quantized(model, name, BF16, (1, 1), [], pieces)
            continue
        if fmt != FP8 or block is None:
            continue  # check_quantized_tensors refused every other scaled tensor
        stored = block
        if not pieces and any(s.part in ("gate_proj", "up_proj") for _, s, _ in parts) \
                and cfg.moe_intermediate_size % block[0]:
            stored = (1, block[1])
        hold_quantized(model, name, FP8, stored, [sd for _, _, sd in parts], pieces)


def _sliced(read, read_scale, whole: tuple, cut: tuple[int, int, int], settings, dtype, device):
    """A reader of this rank's slice of a whole tensor: decoded whole (FP8 with its scale, or as
    stored), one tensor at a time, then narrowed."""
    def one() -> torch.Tensor:
        full = torch.empty(whole, dtype=dtype, device=device)
        if read_scale is not None:
            dequant_into(full, read(), read_scale(), settings)
        else:
            full.copy_(read())
        return full.narrow(cut[0], cut[1], cut[2] - cut[1])
    return one


def _add_mtp_if_stored(model: Glm5Model, reader: CheckpointReader) -> None:
    """Build the MTP layer (mtp.py) when the checkpoint stores layer num_hidden_layers, so its
    tensors have slots; the load then requires every one of them."""
    if any(name.startswith("mtp.") for _, name in _text_tensors(reader, model.config.num_hidden_layers)):
        model.mtp = Glm5Mtp(model.config, model.dtype, model.device, model.tp)


@torch.no_grad()
def _load_weights(model: Glm5Model, reader: CheckpointReader, block: tuple[int, int] | None) -> None:
    """Float tensors are converted into place; FP8 ones (already checked, with their `_scale_inv` in
    `block` blocks) decoded straight into float slots, or copied as stored into `QuantizedWeight`s."""
    loader = _Loader(model, reader, block)
    n_vision = 0
    with ByteProgress(reader.total_bytes, "loading weights") as bar:
        for key, read, read_scale in reader.tensors():
            kind, name = _internal(key, model.config.num_hidden_layers)
            if kind == "vision":
                n_vision += 1
            elif kind == "text" and name.endswith(_FUSED_CONV):
                loader.put_fused_conv(key, name, read)
            elif kind == "text":
                loader.put(key, _slot_of(name), read, read_scale)
            bar.advance(reader.nbytes(key))  # skipped tensors too: the bar counts the files' bytes
    loader.finish()
    model.describe_held_weights()  # where it holds weights as stored
    note_unlocked(reader)
    if n_vision:
        print(f"kvfold: note: ignoring {n_vision} vision tensors (glm5_next is loaded as a text model)",
              file=sys.stderr)


class _Loader:
    """Puts checkpoint tensors into a model's slots one at a time (this rank's slice under tensor
    parallelism, sharding.py) and, at `finish`, refuses a checkpoint that left any slot empty."""

    def __init__(self, model: Glm5Model, reader: CheckpointReader, block: tuple[int, int] | None):
        self.model, self.reader, self.block, self.cfg, self.tp = model, reader, block, model.config, model.tp
        self.settings = QuantSettings(fp8_block=block) if block is not None else None
        self.slots = weight_slots(model)
        self.seen: set[str] = set()
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}

    def put(self, key: str, slot: _Slot, read, read_scale) -> None:
        cfg = self.cfg
        if skips_shared_expert(slot.name, self.tp):
            return  # another rank's tensor (sharding.py)
        if slot.expert is not None:
            local = local_expert(slot.expert, cfg.n_routed_experts, self.tp)
            if local is None:
                return
            slot = slot._replace(expert=local)
        cut = tp_slice(slot.name, cfg, self.tp) if slot.expert is None else None
        target = self.slots.get(slot.name)
        if target is None:
            raise CheckpointError(f"checkpoint tensor {key} ({slot.name}) has no place in the glm5_next model")
        want, rows = tuple(target.shape), _expert_rows(slot, cfg.moe_intermediate_size)
        if slot.expert is not None:
            if len(want) != 3 or slot.expert >= want[0]:
                raise CheckpointError(f"checkpoint expert tensor {key} has no place in the glm5_next model "
                                      f"({want[0] if want else 0} experts)")
            want = (cfg.moe_intermediate_size,) + want[2:] if rows is not None else want[1:]
        scaled = key in self.reader.scales
        if cut is not None:  # the file holds the whole tensor; this rank keeps its slice, decoded
            want = want[:cut[0]] + (want[cut[0]] * self.tp.size,) + want[cut[0] + 1:]
            read = _sliced(read, read_scale if scaled else None, want, cut, self.settings, target.dtype,
                           target.device)
            scaled = False
        stored = tuple(self.reader.entries[key].shape)
        if stored != want:
            raise CheckpointError(f"{key}: checkpoint shape {stored}, model expects {want}")
        if isinstance(target, QuantizedWeight):  # the stored bytes and scale, as they are
            q, scale = read(), read_scale()
            if target.load_(q, scale, self.block, slot.expert, rows, keep=True):
                self.reader.pages.hold([q, scale])  # held in place: its pages are kept resident
        else:
            dest = target.data if slot.expert is None else target.data[slot.expert]
            dest = dest if rows is None else dest[rows]
            if scaled:
                dequant_into(dest, read(), read_scale(), self.settings)  # decoded straight into the parameter
            else:
                dest.copy_(read())  # converted into place
        if slot.expert is None:
            self.seen.add(slot.name)
        else:
            self.expert_parts.setdefault(slot.name, set()).add((slot.expert, slot.part))

    def put_fused_conv(self, key: str, name: str, read) -> None:
        """The in-memory layout's fused q | k | v conv taps, one third per slot."""
        pre = name[:-len("conv1d.weight")]
        for sub, piece in zip(("q", "k", "v"), read().chunk(3, dim=0)):
            cut = tp_slice(f"{pre}{sub}_conv1d", self.cfg, self.tp)
            if cut is not None:
                piece = piece.narrow(cut[0], cut[1], cut[2] - cut[1])
            target = self.slots.get(f"{pre}{sub}_conv1d")
            if target is None or tuple(target.shape) != tuple(piece.shape):
                raise CheckpointError(f"{key}: its {sub} third {tuple(piece.shape)} has no place in the "
                                      f"glm5_next model")
            target.data.copy_(piece)
            self.seen.add(f"{pre}{sub}_conv1d")

    def finish(self) -> None:
        """Stacked experts count once every expert's parts are in; tie lm_head where the config says;
        then every slot must be filled."""
        slots, seen = self.slots, self.seen
        for name, parts in self.expert_parts.items():
            halves = ("down_proj",) if name.endswith(".down_proj") else ("gate_proj", "up_proj")
            if parts == {(e, h) for e in range(slots[name].shape[0]) for h in halves}:
                seen.add(name)
        if "lm_head.weight" not in seen and self.cfg.tie_word_embeddings and "model.embed_tokens.weight" in seen:
            slots["lm_head.weight"].data.copy_(slots["model.embed_tokens.weight"].data)
            seen.add("lm_head.weight")
        missing = sorted(set(slots) - seen)
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} glm5_next tensors, e.g. {missing[:5]}")


def load_glm5(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              numerics: str = "hf", weights: str = "dequant", tp: int = 1) -> Glm5Model:
    """A GLM-5.3 model from a checkpoint directory. `weights`: "dequant" decodes block-FP8 weights into
    `dtype` at load; "quantized" keeps them as stored (float8_e4m3fn + scales, decoded per matmul,
    routed experts only when routed to). Float tensors load as floats."""
    directory = Path(directory)
    if numerics != "hf":
        raise ConfigError(f"glm5_next supports numerics 'hf' only, got {numerics!r}")
    if weights not in WEIGHT_RESIDENCIES:
        raise ConfigError(f"weights must be one of {WEIGHT_RESIDENCIES}, got {weights!r}")
    cfg = load_glm5_config(directory)
    group = None
    if tp != 1:  # checked before the process group or any weight is touched
        check_divides(tp_counts(cfg), tp)
        if weights == "quantized":
            raise ConfigError("weights='quantized' is not sharded for tensor parallelism yet; load with "
                              "weights='dequant' (the default) under tp > 1")
        group = TensorParallel.current(tp)
    block = fp8_weight_block(read_config_json(directory))
    reader = CheckpointReader(directory)
    check_quantized_tensors(reader, cfg.num_hidden_layers, block)  # before the model is built
    # Held as stored, the model is built on meta first so the float placeholders of the weights it
    # keeps quantized are never allocated (GLM-5.3-Flash's experts would be 29 GB per layer in fp32).
    lazy = weights == "quantized" and group is None
    model = Glm5Model(cfg, dtype=dtype, device="meta" if lazy else device, tp=group)
    _add_mtp_if_stored(model, reader)
    if weights == "quantized":
        _keep_resident(model, reader, block)
    if lazy:
        model.materialize_(device)
    _load_weights(model, reader, block)
    try:
        from ...tokenizer import load_tokenizer
        model.tokenizer = load_tokenizer(str(directory), cfg.bos_token_id, cfg.eos_ids[0] if cfg.eos_ids else None,
                                         cfg.vocab_size)
    except ConfigError as e:
        print(f"kvfold: note: {e}", file=sys.stderr)
    return model.eval()

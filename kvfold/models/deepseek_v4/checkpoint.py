"""Load a DeepSeek-V4 checkpoint directory: `config.json` (or the official `inference/config.json`)
plus `model.safetensors` or shards listed in `model.safetensors.index.json` (or any `*.safetensors`).

Tensor names may follow the transformers module layout, what `save_pretrained` writes, or the
official release (see `checkpoint_names`). Weights stored as FP8 e4m3 with 128x128 ue8m0 block
scales, or as packed FP4 e2m1 with 1x32 scales (the official release), are dequantized at load
time into the model's dtype (see `quantized`).

With `weights="quantized"` the FP8 / FP4 weights are not decoded: the parameter they fill is
replaced by a `QuantizedWeight` (the stored bytes and scales, decoded per matmul). So are the bf16
matrices of an fp32 model (the release's embedding, lm_head and compressors): held in bf16, whose
fp32 values are exact, at half the bytes. Every other tensor loads as before. A checkpoint without
quantized or bf16 weights then loads exactly as with "dequant".

Tensors are read one at a time as views of the memory-mapped safetensors files (mapped_files.py):
a float parameter is written from its view (a quantized one decoded in place into it), and a
`QuantizedWeight` keeps the views themselves, each routed expert's tensors as pieces of its stack
(`expert_pieces`), so a checkpoint is never held in memory twice and weights held as stored are
never copied. Every missing, unexpected or mis-shaped tensor is collected and reported in one error.
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
from pathlib import Path

import torch

from .names import Target, is_mtp_key, mtp_target, to_kvfold_name
from .sharding import tp_slice
from ...parallel import local_expert, skips_shared_expert
from ..mapped_files import Entry, MappedFile, ResidentPages, read_header
from ...errors import CheckpointError
from ...progress import ByteProgress
from ...layers.basic import QuantizedWeight, hold_quantized, weight_slots
from ...numerics.quant_formats import (BF16, FP8, QuantSettings, dequant_into, expected_scale_shape, logical_shape,
                                       scale_keys, stored_format)

_PREFIX = "model."
WEIGHT_RESIDENCIES = ("dequant", "quantized")


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}; expected model.safetensors or shards")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards listed in the index are missing: {missing}")
    return files


class CheckpointReader:
    """A checkpoint's tensors indexed from the safetensors headers alone (no data is mapped), then read
    shard by shard, each tensor a view of its memory-mapped file (mapped_files.py): a shard stays
    mapped while the model holds views of it (weights held as stored), else only while its own
    tensors are read, so the pages of a 100 GB checkpoint loaded as floats never all count against
    the process at once. `mappings` lists every mapping made; `pages` keeps what a model holds of them in memory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files = checkpoint_files(self.directory)
        self.entries: dict[str, Entry] = {}
        for f in self.files:
            self.entries.update(read_header(f))
        self.mappings: set[tuple[int, int]] = set()
        self.pages = ResidentPages(self.mappings)  # what a model keeps of the mappings, locked in memory
        self.scales = scale_keys(self.entries)  # weight key -> its block-scale key
        scale_set = set(self.scales.values())
        self.weight_keys = [k for k in self.entries if k not in scale_set]
        self.total_bytes = sum(e.nbytes for e in self.entries.values())

    def nbytes(self, key: str) -> int:
        """Stored bytes of `key` plus its scale's."""
        s = self.scales.get(key)
        return self.entries[key].nbytes + (self.entries[s].nbytes if s else 0)

    def tensors(self):
        """Yield (key, read, read_scale) for every non-scale tensor, grouped by shard, in the order of
        their bytes in the file (from a cold page cache, the reads then run ahead of the loader);
        `read()` returns the tensor, `read_scale()` its block scale (or None). Valid until the next item."""
        by_file: dict[Path, list[str]] = {}
        for k in sorted(self.weight_keys, key=lambda k: (self.entries[k].offset, k)):
            by_file.setdefault(self.entries[k].file, []).append(k)
        for f in self.files:
            if f not in by_file:
                continue
            mapped = {f: MappedFile(f, self.mappings)}
            for key in by_file[f]:
                yield key, (lambda k=key: self._read(k, mapped)), (lambda k=key: self._scale(k, mapped))
            self.pages.settle()  # the file's held tensors, locked in memory in file order

    def _read(self, key: str, mapped: dict[Path, MappedFile]) -> torch.Tensor:
        entry = self.entries[key]
        if entry.file not in mapped:  # a scale in another shard
            mapped[entry.file] = MappedFile(entry.file, self.mappings)
        return mapped[entry.file].tensor(entry)

    def _scale(self, key: str, mapped: dict[Path, MappedFile]) -> torch.Tensor | None:
        s = self.scales.get(key)
        return None if s is None else self._read(s, mapped)


def _resolve(key: str) -> Target | None:
    """Checkpoint key -> destination (`mtp.*` keys go to the MtpModule's parameters); None: not loaded."""
    if is_mtp_key(key):
        return mtp_target(key)
    return to_kvfold_name(key)


def _stored_block(fmt: str, settings: QuantSettings) -> tuple[int, int]:
    return settings.fp8_block if fmt == FP8 else (1, settings.fp4_block)


def _expert_rows(target: Target, inter: int) -> slice | None:
    """The rows of one expert's slice that a per-expert tensor fills (w1: gate half, w3: up half)."""
    if target.expert is None or target.part == "w2":
        return None
    return slice(0, inter) if target.part == "w1" else slice(inter, 2 * inter)


def held_format(dtype: str, has_scale: bool, model_dtype: torch.dtype) -> str | None:
    """The format a checkpoint tensor of safetensors `dtype` is held in with weights="quantized":
    FP8 / FP4 (with a scale), BF16 (bf16 in an fp32 model: exact, half the bytes), else None."""
    if has_scale:
        return stored_format(dtype)
    return BF16 if dtype == "BF16" and model_dtype == torch.float32 else None


def _keep_quantized_(model: torch.nn.Module, reader: CheckpointReader, settings: QuantSettings) -> None:
    """Replace every parameter whose checkpoint tensors are all FP8 (or all packed FP4) with scales,
    or all bf16 in an fp32 model, and whose module lists it in `quantizable`, by an empty
    `QuantizedWeight` of the stored format. Only the file headers are read; the float parameters
    given up were never written to."""
    parts: dict[str, list[tuple[str | None, Target, str | None]]] = {}
    for key in reader.weight_keys:
        target = _resolve(key)
        if target is None:
            continue
        scale_key = reader.scales.get(key)
        fmt = held_format(reader.entries[key].dtype, scale_key is not None, model.dtype)
        parts.setdefault(target.name, []).append(
            (fmt, target, reader.entries[scale_key].dtype if scale_key is not None else None))
    inter = model.config.moe_intermediate_size
    for name, found in parts.items():
        fmts = {fmt for fmt, _, _ in found}
        if len(fmts) != 1 or None in fmts:
            continue  # unquantized, or a mix of formats: loaded as floats
        fmt = fmts.pop()
        pieces = expert_pieces([t.part if t.expert is not None else None for _, t, _ in found])
        if fmt == BF16:
            hold_quantized(model, name, fmt, (1, 1), [], pieces)
            continue
        block = _stored_block(fmt, settings)
        if pieces:  # each expert's tensors held where the file has them, each piece with its own scale blocks
            hold_quantized(model, name, fmt, block, [sd for _, _, sd in found], pieces)
            continue
        if fmt == FP8 and block[0] > 1:
            # per-expert halves of gate_up_proj share the stored row blocks only if I is a multiple of br
            for _, target, _ in found:
                rows = _expert_rows(target, inter)
                if rows is not None and (rows.start % block[0] or (rows.stop - rows.start) % block[0]):
                    block = (1, block[1])
        hold_quantized(model, name, fmt, block, [sd for _, _, sd in found])


def note_unlocked(reader: CheckpointReader) -> None:
    """One stderr note where weights read in place could not be locked in memory (mapped_files.py)."""
    note = reader.pages.note()
    if note:
        print(f"kvfold: note: {note}", file=sys.stderr)


def expert_pieces(parts: list[str | None]) -> int:
    """The row pieces a matrix of a stacked weight is held in when its checkpoint tensors, one per
    expert and `parts` name (None: a tensor of the whole stack), are each read in place: 2 for
    gate and up halves (w1 / w3, gate_proj / up_proj), 1 for whole experts, 0 (one stack) where
    any tensor is not one expert's."""
    if not parts or None in parts:
        return 0
    return 2 if set(parts) & {"w1", "w3", "gate_proj", "up_proj"} else 1


def read_config_dict(directory: str | Path) -> dict:
    """The raw config.json of a checkpoint directory (or its `inference/config.json`); {} if none."""
    d = Path(directory)
    for f in (d / "config.json", d / "inference" / "config.json"):
        if f.exists():
            try:
                return json.loads(f.read_text())
            except json.JSONDecodeError:
                return {}
    return {}


def read_quant_settings(directory: Path) -> QuantSettings:
    """The block sizes of the checkpoint's quantized weights, from its config.json; CheckpointError
    when the config declares ones kvfold cannot read."""
    try:
        return QuantSettings.from_config_dict(read_config_dict(directory))
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None


@torch.no_grad()
def load_weights(model: torch.nn.Module, directory: Path, progress: bool | None = None,
                 weights: str = "dequant", device: str | torch.device | None = None) -> None:
    """Fill `model` (and, when the checkpoint carries `mtp.0.*`, a new `model.mtp`) from a checkpoint
    directory: any of the three name layouts, unquantized or with FP8 / FP4 block-quantized weights
    (decoded straight into the parameters, one tensor at a time, from memory-mapped files).
    `weights="quantized"` keeps FP8 / FP4 weights as stored instead (see `QuantizedWeight`); float
    checkpoint tensors load as floats either way (nothing is quantized at load).
    `progress`: a stderr progress line (default: only when stderr is a terminal, outside
    `kvfold.progress.quieted()`). `device`: `model` was built on the meta device, and gets its
    tensors there once the weights held as stored are chosen (`CausalLM.materialize_`)."""
    if weights not in WEIGHT_RESIDENCIES:
        raise CheckpointError(f"weights must be one of {WEIGHT_RESIDENCIES}, got {weights!r}")
    directory = Path(directory)
    reader = CheckpointReader(directory)
    settings = read_quant_settings(directory)
    _prepare_slots(model, reader, settings, weights)
    if device is not None:
        model.materialize_(device)
    loader = _WeightLoader(model, reader, settings)
    with ByteProgress(reader.total_bytes, "loading weights", enabled=progress) as bar:
        for key, read, read_scale in reader.tensors():
            if loader.load(key, read, read_scale):
                bar.advance(reader.nbytes(key))
    loader.finish(directory)
    if weights == "quantized":
        model.describe_held_weights()
    note_unlocked(reader)


def _prepare_slots(model: torch.nn.Module, reader: CheckpointReader, settings: QuantSettings, weights: str) -> None:
    """Give the model every slot the checkpoint fills before a tensor is read: an MTP module when the
    checkpoint has MTP weights, and (`weights="quantized"`) a `QuantizedWeight` for each quantized one."""
    if getattr(model, "mtp", None) is None and any(is_mtp_key(k) and mtp_target(k) is not None
                                                    for k in reader.weight_keys):
        from .mtp import MtpModule
        model.mtp = MtpModule(model.config, model.dtype, model.device, model.tp)
    if weights == "quantized" and model.tp is not None:
        raise CheckpointError("weights='quantized' is not sharded for tensor parallelism yet; load with "
                              "weights='dequant' (the default) under tp > 1")
    if weights == "quantized":
        _keep_quantized_(model, reader, settings)
    elif any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise CheckpointError("this model keeps weights quantized; load weights='dequant' into a new model")


class _WeightLoader:
    """Loads checkpoint tensors into a model's slots one at a time, collecting every unexpected and
    mis-shaped tensor (and, at `finish`, every missing one) so that one error reports them all."""

    def __init__(self, model: torch.nn.Module, reader: CheckpointReader, settings: QuantSettings):
        self.model, self.reader, self.settings = model, reader, settings
        self.params = weight_slots(model)
        has_mtp = getattr(model, "mtp", None) is not None
        self.expected = {n for n in self.params if has_mtp or not n.startswith("mtp.")}
        self.seen: set[str] = set()
        self.expert_seen: dict[str, set[tuple[int, str]]] = {}  # stacked slot -> (expert, part) loaded
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []
        self.inter = model.config.moe_intermediate_size

    def load(self, key: str, read, read_scale) -> bool:
        """Load tensor `key` (and its scale) into its slot. False when it was reported instead
        (unexpected or mis-shaped); True when loaded, or skipped as not loaded at all."""
        target = _resolve(key)
        if target is None:  # not loaded (see mtp_target)
            return True
        tp, cfg = self.model.tp, self.model.config
        if skips_shared_expert(target.name, tp):
            return True  # another rank's tensor (sharding.py)
        if target.expert is not None:
            local = local_expert(target.expert, cfg.n_routed_experts, tp)
            if local is None:
                return True
            target = dataclasses.replace(target, expert=local)
        cut = tp_slice(target.name, cfg, tp) if target.expert is None else None
        if target.name not in self.params:
            self.unexpected.append(key)
            return False
        slot = self.params[target.name]
        rows = _expert_rows(target, self.inter)
        want = _slot_shape(slot, target, rows)
        if want is None:
            self.unexpected.append(key)
            return False
        if cut is not None:  # the file holds the whole tensor; this rank keeps want[cut dim] of it
            want = want[:cut[0]] + (want[cut[0]] * tp.size,) + want[cut[0] + 1:]
        scale_key = self.reader.scales.get(key)
        fmt = self._stored_format(key, scale_key, slot)
        problem = self._shape_problem(key, scale_key, fmt, want)
        if problem is not None:
            self.misshaped.append(problem)
            self.seen.add(target.name)  # reported as mis-shaped, not also as missing
            return False
        self._write(slot, target, rows, fmt, scale_key is not None, read, read_scale, cut, want)
        if target.expert is None:
            self.seen.add(target.name)
        else:
            self.expert_seen.setdefault(target.name, set()).add((target.expert, target.part))
        return True

    def _stored_format(self, key: str, scale_key: str | None, slot) -> str | None:
        """The quantized format `key` is stored in (None: read as it is). A quantized dtype without a
        scale is refused: FP8 always, packed FP4 when it would fill a float slot."""
        entry = self.reader.entries[key]
        floating = isinstance(slot, QuantizedWeight) or slot.is_floating_point()
        quantized_dtype = stored_format(entry.dtype) is not None
        if scale_key is None and quantized_dtype and (entry.dtype == "F8_E4M3" or floating):
            raise CheckpointError(f"{key} is stored quantized ({entry.dtype}) but has no block scale "
                                  f"(`.scale` or `.weight_scale_inv`) next to it")
        return stored_format(entry.dtype) if scale_key is not None else None

    def _shape_problem(self, key: str, scale_key: str | None, fmt: str | None, want: tuple) -> str | None:
        """What is mis-shaped about `key` or its scale, against the slot's `want`; None when nothing."""
        entry = self.reader.entries[key]
        shape = logical_shape(entry.shape, entry.dtype, fmt)
        if shape != want:
            return f"{key}: file {shape} vs expected {want}"
        if scale_key is not None:
            sshape = self.reader.entries[scale_key].shape
            want_scale = expected_scale_shape(shape, fmt or FP8, self.settings)
            if sshape != want_scale:
                return f"{scale_key}: scale {sshape} vs expected {want_scale} for {fmt or 'block'} weight {shape}"
        return None

    def _write(self, slot, target: Target, rows: slice | None, fmt: str | None, has_scale: bool,
               read, read_scale, cut=None, whole=None) -> None:
        if isinstance(slot, QuantizedWeight):  # the stored bytes and scale, as they are
            block = None if slot.fmt == BF16 else _stored_block(fmt, self.settings)
            q, scale = read(), read_scale() if has_scale else None
            if slot.load_(q, scale, block, target.expert, rows, keep=True):
                self.reader.pages.hold([q, scale])  # held in place: its pages are kept resident
            return
        dest = slot.data
        if target.expert is not None:
            dest = dest[target.expert] if rows is None else dest[target.expert][rows]
        if cut is not None:  # one whole tensor decoded, this rank's slice kept
            full = torch.empty(whole, dtype=dest.dtype, device=dest.device)
            if has_scale:
                dequant_into(full, read(), read_scale(), self.settings)
            else:
                full.copy_(read())
            dest.copy_(full.narrow(cut[0], cut[1], cut[2] - cut[1]))
        elif has_scale:
            dequant_into(dest, read(), read_scale(), self.settings)  # decoded straight into the parameter
        else:
            dest.copy_(read())  # one tensor at a time, converted into place

    def finish(self, directory: Path) -> None:
        """Count fully loaded stacked-expert slots as seen, tie lm_head to the embedding when the config
        says so and the checkpoint has none, then raise one CheckpointError listing every problem."""
        for name, parts in self.expert_seen.items():
            n_exp = self.params[name].shape[0]
            want = {(e, p) for e in range(n_exp) for p in (("w2",) if name.endswith("down_proj") else ("w1", "w3"))}
            if parts == want:
                self.seen.add(name)
        missing = sorted(self.expected - self.seen)
        if getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
            embed = self.params[_PREFIX + "embed_tokens.weight"]
            self.params["lm_head.weight"].data.copy_(embed.dequant() if isinstance(embed, QuantizedWeight)
                                                     else embed.data)
            missing.remove("lm_head.weight")
        _raise_mismatch(directory, missing, self.unexpected, self.misshaped)


def _slot_shape(slot, target: Target, rows: slice | None) -> tuple | None:
    """The shape a checkpoint tensor for `target` must have: the slot's, or for one expert's tensor
    its slice of the stacked slot (w1 / w3: half the rows). None: no such expert in the slot."""
    want = tuple(slot.shape)
    if target.expert is None:
        return want
    if len(want) != 3 or target.expert >= want[0]:
        return None
    want = want[1:]
    if rows is not None:
        want = (len(range(want[0])[rows]),) + want[1:]
    return want


def _raise_mismatch(directory: Path, missing: list[str], unexpected: list[str], misshaped: list[str]) -> None:
    if not (missing or unexpected or misshaped):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
    if misshaped:
        parts.append(f"mis-shaped {len(misshaped)}: {misshaped[:20]}")
    raise CheckpointError(f"checkpoint {directory} does not match its config.json: " + "; ".join(parts))


def save_checkpoint(model: torch.nn.Module, directory: str | Path, progress: bool | None = None) -> Path:
    """Write `config.json` + `model.safetensors` in the transformers layout (MTP under the
    official `mtp.0.*` names, which is where checkpoints carry it). Float weights only: a model
    loaded with weights="quantized" is refused (its checkpoint files can be rewritten with `convert`).
    `progress`: a stderr progress line (default: only when stderr is a terminal, outside
    `kvfold.progress.quieted()`)."""
    from .mtp import official_mtp_weights
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise CheckpointError("save_checkpoint writes float weights, but this model keeps its FP8 / FP4 weights "
                              "quantized (loaded with weights='quantized'); load it with weights='dequant' to save "
                              "it, or use `kvfold convert` to rewrite its checkpoint files without decoding them")
    config = model.config.to_hf_dict()  # ConfigError, before anything is written, if the layout can't hold it
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    if model.mtp is not None:
        tensors.update({k: v.cpu() for k, v in official_mtp_weights(model.mtp).items()})
    write_safetensors(directory / "model.safetensors", tensors, {"format": "pt"}, progress=progress)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    **({torch.float8_e8m0fnu: "F8_E8M0"} if hasattr(torch, "float8_e8m0fnu") else {}),
}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      progress: bool | None = None, label: str = "writing checkpoint") -> None:
    """Write CPU `tensors` as one safetensors file, tensor by tensor, so that a progress line can
    follow the bytes (`safetensors.save_file` writes in one call). The layout is safetensors': an
    8-byte header length, the JSON header padded with spaces to 8 bytes, then the data, largest
    element size first so every tensor starts aligned to its element size."""
    if sys.byteorder != "little":  # safetensors stores little-endian; its own writer swaps bytes
        from safetensors.torch import save_file
        save_file(tensors, str(path), metadata=metadata)
        return
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key}: cannot store dtype {t.dtype} in safetensors")
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f, ByteProgress(offset, label, enabled=progress) as bar:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for key in order:
            raw = tensors[key].contiguous().reshape(-1).view(torch.uint8)  # reshape: 0-d tensors too
            f.write(memoryview(raw.numpy()))
            bar.advance(raw.numel())


def checkpoint_dtype_breakdown(directory: str | Path) -> dict[str, tuple[int, int]]:
    """{stored dtype: (tensor count, bytes)} over a checkpoint's safetensors files, read from the file
    headers only (no tensor data is touched). Dtype names are safetensors' (`BF16`, `F32`, `F8_E4M3`,
    `F8_E8M0`, `I8`, `F4`, ...); FP4 experts packed in int8 count as `I8`. Sorted by bytes, largest first."""
    out: dict[str, list[int]] = {}
    for f in checkpoint_files(Path(directory)):
        for e in read_header(f).values():
            entry = out.setdefault(e.dtype, [0, 0])
            entry[0] += 1
            entry[1] += e.nbytes
    return {k: (c, b) for k, (c, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}

"""`kvfold convert SRC DST --to hf|official`: rewrite a DeepSeek-V4 checkpoint in another layout,
one tensor at a time (nothing but the tensor being converted is held in memory, except that a stacked
`gate_up_proj` / `down_proj` source tensor is read whole to split it per expert).

Layouts written:
* `official`: release names (`embed.weight`, `layers.N.attn.wq_a.weight`, per-expert
  `layers.N.ffn.experts.E.w1.weight`, `mtp.0.*`, ...), FP8 / FP4 weights with `.scale` (e8m0)
  companions, and a `config.json` in the official keys (`dim`, `n_layers`, `compress_ratios`, ...)
  with a `quantization_config`.
* `hf`: the names transformers' `save_pretrained` writes (official leaf names under `model.`,
  `head.weight`, `model.embed_tokens.weight`, `model.hc_head.*`; MTP as `mtp.0.*`), quantized
  weights with `.weight_scale_inv` (e8m0) companions, and a transformers `config.json`.

`quantize`: None (default) quantizes for `official` (FP8 for attention wq_a/wq_b/wkv/wo_a/wo_b,
indexer wq_b, shared experts and MTP e_proj/h_proj; FP4 for routed experts, as the official release stores them) and
keeps the source's formats for `hf`; True quantizes that same set for either layout; False writes every
weight dequantized. Dequantized weights are written in `dtype` (default bfloat16); unquantized source
tensors are copied in their stored dtype, except that `floats` (e.g. bfloat16, the release's dtype)
rewrites every float `*.weight` tensor written unquantized (embedding, lm_head, norms, compressor
projections, the indexer's weights_proj, the router) in that dtype; the hc parameters, biases,
position biases and sinks, which the release keeps in fp32, are copied as they are. A source tensor
already quantized in the wanted format (128x128 FP8 or 1x32 FP4 with power-of-two scales) is copied
bit for bit, never requantized.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import CheckpointReader, _resolve, read_quant_settings
from .names import Target, hf_key_for_official, official_quant_kind, to_official_names
from .config import CSA, HCA, SLIDING, Dsv4Config, load_config
from ...errors import CheckpointError, ConfigError
from ...progress import ByteProgress
from ...numerics.quant import (E8M0_BIAS, FP4_BLOCK, FP8_BLOCK, dequant_fp4_blocks, dequant_fp8_blocks,
                             quantize_fp4_blocks, quantize_fp8_blocks)
from ...numerics.quant_formats import FP4, FP8, QuantSettings, stored_format

LAYOUTS = ("hf", "official")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                       "weight_block_size": list(FP8_BLOCK), "activation_scheme": "dynamic"}


# ---- configs ----------------------------------------------------------------------------------

def official_config_dict(cfg: Dsv4Config, quantized: bool = True, expert_fp4: bool = True) -> dict:
    """`cfg` in the official config.json keys (what the release's `inference/config.json` uses), plus the
    bos/eos ids and, when the schedule needs them (a CSA ratio other than 4, or an HCA ratio of 4), the
    explicit layer types. `config_from_dict` reads it back to an equal config."""
    yarn = cfg.compress_yarn
    n_hash = sum(1 for t in cfg.mlp_layer_types if t == "hash_moe")
    d = {
        "vocab_size": cfg.vocab_size, "dim": cfg.hidden_size, "moe_inter_dim": cfg.moe_intermediate_size,
        "n_layers": cfg.num_hidden_layers, "n_hash_layers": n_hash, "n_mtp_layers": cfg.num_nextn_predict_layers,
        "n_heads": cfg.num_attention_heads, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "n_activated_experts": cfg.num_experts_per_tok,
        "score_func": cfg.scoring_func, "route_scale": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.head_dim, "rope_head_dim": cfg.qk_rope_head_dim,
        "norm_eps": cfg.rms_norm_eps, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "window_size": cfg.sliding_window,
        "original_seq_len": yarn.original_max_position_embeddings if yarn else 0,
        "rope_theta": cfg.rope_theta, "rope_factor": yarn.factor if yarn else 1.0,
        "beta_fast": yarn.beta_fast if yarn else 32, "beta_slow": yarn.beta_slow if yarn else 1,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "compress_rope_theta": cfg.compress_rope_theta,
        # one entry per layer, then one per MTP block (pure sliding window)
        "compress_ratios": list(cfg.compress_ratios) + [0] * cfg.num_nextn_predict_layers,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    }
    if cfg.mlp_layer_types != tuple(["hash_moe"] * n_hash + ["moe"] * (cfg.num_hidden_layers - n_hash)):
        d["mlp_layer_types"] = list(cfg.mlp_layer_types)
    # the release's code reads ratio 4 as CSA and any other as HCA; a schedule it would misread keeps its types
    if any((t == CSA) != (r == 4) for t, r in zip(cfg.layer_types, cfg.compress_ratios) if t != SLIDING):
        rates = cfg.compress_rates()  # ConfigError if one type has several ratios: not expressible then
        d["layer_types"] = list(cfg.layer_types)
        d["compress_rate_csa"], d["compress_rate_hca"] = rates.get(CSA, 4), rates.get(HCA, 128)
    if quantized:
        d.update(dtype="fp8", scale_fmt="ue8m0")
        d["quantization_config"] = dict(QUANTIZATION_CONFIG)
        if expert_fp4:
            d["expert_dtype"] = "fp4"
            d["quantization_config"]["expert_dtype"] = "fp4"
    else:
        d["dtype"] = "bf16"
    return d


# ---- writer -----------------------------------------------------------------------------------

class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` (holding one shard at a time),
    renamed to their final names with an index at `finish`."""

    def __init__(self, directory: Path, max_bytes: int):
        self.dir, self.max = directory, max(int(max_bytes), 1)
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.keys: set[str] = set()

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.keys:
            raise CheckpointError(f"two source tensors convert to the same name {key}")
        self.keys.add(key)
        n = t.numel() * t.element_size()
        if self.buf and self.size + n > self.max:
            self.flush()
        self.buf[key] = t.detach().contiguous().cpu().clone()
        self.size += n

    def flush(self) -> None:
        if not self.buf:
            return
        path = self.dir / f".part-{len(self.files):05d}.safetensors"
        save_file(self.buf, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buf)))
        self.buf, self.size = {}, 0

    def finish(self) -> list[Path]:
        self.flush()
        if len(self.files) == 1:
            final = self.dir / "model.safetensors"
            self.files[0][0].rename(final)
            return [final]
        n = len(self.files)
        weight_map, out, total = {}, [], 0
        for i, (path, keys) in enumerate(self.files):
            final = self.dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            total += final.stat().st_size
            weight_map.update({k: final.name for k in keys})
            out.append(final)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return out


# ---- conversion -------------------------------------------------------------------------------

def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor | None:
    """A scale as e8m0 exponent bytes, when it is exactly representable (e8m0 input, or float powers of
    two in range); None otherwise."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    s = scale.to(torch.float32)
    m, e = torch.frexp(s)
    k = e.to(torch.int32) - 1
    if not bool(((m == 0.5) & (k >= -E8M0_BIAS) & (k <= E8M0_BIAS)).all()):
        return None
    return (k + E8M0_BIAS).to(torch.uint8)


def _as_e8m0_tensor(exps: torch.Tensor) -> torch.Tensor:
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return exps.view(e8m0) if e8m0 is not None else exps


class _Piece:
    """One tensor to write: float values, or stored quantized bytes + scale (+ its format)."""

    def __init__(self, value: torch.Tensor, scale: torch.Tensor | None = None, fmt: str | None = None,
                 settings: QuantSettings | None = None):
        self.value, self.scale, self.fmt, self.settings = value, scale, fmt, settings

    def floats(self) -> torch.Tensor:
        if self.fmt == FP8:
            return dequant_fp8_blocks(self.value, self.scale, self.settings.fp8_block)
        if self.fmt == FP4:
            return dequant_fp4_blocks(self.value, self.scale, self.settings.fp4_block)
        return self.value


def convert(src: str | Path, dst: str | Path, to: str, *, quantize: bool | None = None,
            dtype: torch.dtype = torch.bfloat16, floats: torch.dtype | None = None,
            max_shard_bytes: int = 4 << 30, progress: bool | None = None) -> Path:
    """Convert checkpoint directory `src` into a new directory `dst` in layout `to` ("hf" or "official").
    Returns `dst`. See the module docstring for `quantize`, `dtype` and `floats`."""
    if to not in LAYOUTS:
        raise ValueError(f"to must be one of {LAYOUTS}, got {to!r}")
    src, dst = Path(src), Path(dst)
    cfg, settings = _check_convertible(src, dst, to)
    reader = CheckpointReader(src)
    _refuse_unknown_tensors(src, reader, cfg)
    dst.mkdir(parents=True, exist_ok=True)
    emitter = _Emitter(ShardWriter(dst, max_shard_bytes), to, _quant_mode(to, quantize), dtype, floats)
    _write_tensors(reader, cfg, settings, emitter, dst, progress)
    config = _output_config(cfg, to, emitter.written_fmts)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(src, dst)
    return dst


def write_official(dst: str | Path, cfg: Dsv4Config, tensors, max_shard_bytes: int = 4 << 30) -> Path:
    """A checkpoint in the release's layout and formats from `tensors`, an iterable of (official
    key, model parameter name, value), one held at a time: a float value is written as the
    release stores that parameter (quantized to FP8 / FP4, or in bf16); a pair (packed FP4 codes,
    e8m0 exponents) is an FP4 weight already stored so, copied bit for bit. Writes into the empty
    directory `dst` (the parts written so far are removed on any failure) with its config.json."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    emitter = _Emitter(ShardWriter(dst, max_shard_bytes), "official", "official", torch.bfloat16, torch.bfloat16)
    try:
        for key, name, value in tensors:
            piece = _Piece(value[0], value[1], FP4) if isinstance(value, tuple) else _Piece(value)
            emitter.emit(key, name, piece, piece.fmt)
        emitter.writer.finish()
    except BaseException:
        for part in dst.glob(".part-*.safetensors"):
            part.unlink()
        raise
    config = _output_config(cfg, "official", emitter.written_fmts)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def _check_convertible(src: Path, dst: Path, to: str) -> tuple[Dsv4Config, QuantSettings]:
    """The source's config and quantization settings, after every refusal that needs no tensor
    header: no source directory, a non-empty destination, a layer schedule `to` cannot hold."""
    if not src.is_dir():
        raise ConfigError(f"{src} is not a checkpoint directory")
    if dst.exists() and any(dst.iterdir()):
        raise ConfigError(f"{dst} exists and is not empty; convert writes a new directory")
    cfg = load_config(src)
    # a layer schedule the target layout cannot hold is refused before anything is written
    _ = cfg.to_hf_dict() if to == "hf" else official_config_dict(cfg)
    return cfg, read_quant_settings(src)


def _quant_mode(to: str, quantize: bool | None) -> str:
    """What `quantize` asks of layout `to`: "official" (quantize the release's set), "keep" (each tensor
    in its source format) or "none" (every weight as floats)."""
    if quantize is None:
        return "official" if to == "official" else "keep"
    return "official" if quantize else "none"


def _refuse_unknown_tensors(src: Path, reader: CheckpointReader, cfg: Dsv4Config) -> None:
    """CheckpointError, before anything is written, when a loadable tensor has no official name."""
    unknown = []
    for key in reader.weight_keys:
        target = _resolve(key)
        try:
            if target is not None:
                to_official_names(target.name, cfg.n_routed_experts)
        except KeyError:
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"{src}: {len(unknown)} tensors have no place in a DeepSeek-V4 model: {unknown[:20]}")


class _Emitter:
    """Writes each converted tensor under its name in the target layout, in the format `mode` wants."""

    def __init__(self, writer: ShardWriter, to: str, mode: str, dtype: torch.dtype,
                 floats: torch.dtype | None = None):
        self.writer, self.to, self.mode, self.dtype, self.floats = writer, to, mode, dtype, floats
        self.written_fmts: set[str] = set()  # quantized formats written: they decide the config's quantization

    def out_keys(self, official_key: str) -> tuple[str, str]:
        """(weight key, scale key) of `official_key` in the target layout."""
        stem = official_key[: -len(".weight")] if official_key.endswith(".weight") else official_key
        if self.to == "official":
            return official_key, stem + ".scale"
        key = official_key if official_key.startswith("mtp.") else hf_key_for_official(official_key)
        stem = key[: -len(".weight")] if key.endswith(".weight") else key
        return key, stem + ".weight_scale_inv"

    def wanted_format(self, param_name: str, source_fmt: str | None) -> str | None:
        if self.mode == "official":
            return official_quant_kind(param_name)
        if self.mode == "keep":
            return source_fmt
        return None

    def emit(self, official_key: str, param_name: str, piece: _Piece, source_fmt: str | None) -> None:
        want = self.wanted_format(param_name, source_fmt)
        key, skey = self.out_keys(official_key)
        if want is None:
            value = piece.floats().to(self.dtype) if piece.fmt else piece.value
            if self.floats is not None and value.is_floating_point() and official_key.endswith(".weight"):
                value = value.to(self.floats)
            self.writer.add(key, value)
            return
        self.written_fmts.add(want)
        q, exps = _quantized(official_key, piece, want)
        self.writer.add(key, q)
        self.writer.add(skey, _as_e8m0_tensor(exps))


def _quantized(official_key: str, piece: _Piece, want: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored values, e8m0 exponents) of `piece` in format `want`: its own bytes, bit for bit, when it
    is already stored so (with a 128x128 FP8 block and power-of-two scales), else quantized afresh."""
    exps = None
    if piece.fmt == want and (want == FP4 or piece.settings.fp8_block == FP8_BLOCK):
        exps = _e8m0_bytes(piece.scale)
    if exps is not None:  # already in the wanted format: copy bit for bit
        return (piece.value.view(torch.int8) if want == FP4 else piece.value), exps
    values = piece.floats()
    if want == FP4 and values.shape[-1] % 2:
        raise CheckpointError(f"{official_key}: FP4 needs an even input dim, got {tuple(values.shape)}")
    return quantize_fp8_blocks(values) if want == FP8 else quantize_fp4_blocks(values, FP4_BLOCK)


def _write_tensors(reader: CheckpointReader, cfg: Dsv4Config, settings: QuantSettings, emitter: _Emitter,
                   dst: Path, progress: bool | None) -> None:
    """Convert every source tensor and finish the shards; on any failure (or interrupt) the parts
    written so far are removed, leaving no half-written checkpoint behind."""
    bar = ByteProgress(reader.total_bytes, "converting", enabled=progress)
    try:
        for key, read, read_scale in reader.tensors():
            target = _resolve(key)
            if target is not None:  # None: a tensor the model does not load (dropped)
                _convert_tensor(target, read(), read_scale(), cfg, settings, emitter)
            bar.advance(reader.nbytes(key))
        emitter.writer.finish()
    except BaseException:
        for part in dst.glob(".part-*.safetensors"):
            part.unlink()
        raise
    finally:
        bar.close()


def _convert_tensor(target: Target, tensor: torch.Tensor, scale: torch.Tensor | None, cfg: Dsv4Config,
                    settings: QuantSettings, emitter: _Emitter) -> None:
    """Emit one source tensor under its official name(s): a stacked experts tensor becomes one
    tensor per expert (and w1 / w3 halves)."""
    names = to_official_names(target.name, cfg.n_routed_experts)
    fmt = stored_format(tensor.dtype) if scale is not None else None
    if target.expert is not None:  # one expert's w1 / w3 / w2, stored on its own
        off = [n for n in names if n[1] == target.expert and n[2] == target.part]
        emitter.emit(off[0][0], target.name, _Piece(tensor, scale, fmt, settings), fmt)
    elif len(names) == 1:
        emitter.emit(names[0][0], target.name, _Piece(tensor, scale, fmt, settings), fmt)
    else:  # a stacked experts tensor: split per expert (and into w1 / w3 rows)
        inter = cfg.moe_intermediate_size
        for official_key, e, part in names:
            rows = slice(None) if part == "w2" else slice(0, inter) if part == "w1" else slice(inter, None)
            emitter.emit(official_key, target.name, _expert_piece(tensor, scale, fmt, settings, e, rows), fmt)


def _expert_piece(tensor: torch.Tensor, scale: torch.Tensor | None, fmt: str | None, settings: QuantSettings,
                  e: int, rows: slice) -> _Piece:
    """Expert `e`'s `rows` of a stacked tensor. FP4's 1x32 blocks split cleanly along rows and stay
    quantized; FP8's 128-row blocks may not, so an FP8 expert is decoded before it is cut."""
    if fmt == FP4:
        return _Piece(tensor[e][rows], scale[e][rows], fmt, settings)
    if fmt is not None:
        return _Piece(_Piece(tensor[e], scale[e], fmt, settings).floats()[rows])
    return _Piece(tensor[e][rows])


def _output_config(cfg: Dsv4Config, to: str, written_fmts: set[str]) -> dict:
    """The config.json of the converted checkpoint, declaring the quantized formats it holds."""
    if to == "official":
        return official_config_dict(cfg, quantized=bool(written_fmts), expert_fp4=FP4 in written_fmts)
    config = cfg.to_hf_dict()
    if written_fmts:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        if FP4 in written_fmts:
            config["quantization_config"]["expert_dtype"] = "fp4"
    return config


def _copy_side_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer and generation files (everything but weights, index and config)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, dst / f.name)

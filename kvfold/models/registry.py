"""`kvfold.load_model`: a checkpoint directory or "tiny" -> a ready Dsv4Model with its tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .deepseek_v4.checkpoint import WEIGHT_RESIDENCIES, load_weights
from .deepseek_v4.config import load_config
from ..errors import ConfigError
from .deepseek_v4.model import Dsv4Model
from .deepseek_v4.mtp import MtpModule
from .deepseek_v4.tiny import init_random_, tiny_config

TINY_SEED = 1234


def _tokenizer_for(directory: Path | None, cfg):
    from ..tokenizer import load_tokenizer
    eos = cfg.eos_ids[0] if cfg.eos_ids else None
    return load_tokenizer(str(directory) if directory else None, cfg.bos_token_id, eos, cfg.vocab_size)


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         numerics: str = "hf", weights: str = "dequant") -> Dsv4Model:
    """`weights`: "dequant" decodes FP8 / FP4 checkpoint weights into `dtype` at load; "quantized" keeps
    them in memory as stored (float8_e4m3fn / packed FP4 bytes + e8m0 scales) and decodes each one for
    the matmul that reads it (routed experts: only the experts a batch uses). Logits are bit-identical
    either way. Float checkpoint tensors (and "tiny") load as floats either way: nothing is quantized."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if numerics not in ("hf", "reference"):
        raise ConfigError(f"numerics must be 'hf' or 'reference', got {numerics!r}")
    if weights not in WEIGHT_RESIDENCIES:
        raise ConfigError(f"weights must be one of {WEIGHT_RESIDENCIES}, got {weights!r}")
    if str(path) != "tiny" and (Path(path) / "config.json").is_file():
        from .glm5.config import is_glm5_config, read_config_json
        if is_glm5_config(read_config_json(path)):  # GLM-5.3 (`glm5_next*`): its own model and loader
            from .glm5.checkpoint import load_glm5
            return load_glm5(path, device=device, dtype=dtype, numerics=numerics, weights=weights)
    if str(path) == "tiny":
        model = Dsv4Model(tiny_config(), dtype=dtype, device=device)
        model.mtp = MtpModule(model.config, model.dtype, model.device)
        init_random_(model, TINY_SEED)
        model.tokenizer = _tokenizer_for(None, model.config)
        model.set_numerics(numerics)
        return model.eval()
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; pass a checkpoint directory or 'tiny'")
    cfg = load_config(directory)
    model = Dsv4Model(cfg, dtype=dtype, device=device)
    load_weights(model, directory, weights=weights)
    try:
        model.tokenizer = _tokenizer_for(directory, cfg)
    except ConfigError as e:  # the model still runs on token ids; text commands will say what is missing
        print(f"kvfold: note: {e}", file=sys.stderr)
    model.set_numerics(numerics)
    return model.eval()

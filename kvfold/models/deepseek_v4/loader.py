"""Load a DeepSeek-V4 model: a checkpoint directory (transformers or official layout; the trained
built-in "tiny" is one), or the random "tiny-random" model with its byte-level tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ...errors import ConfigError
from .checkpoint import load_weights
from .config import load_config
from .model import Dsv4Model
from .mtp import MtpModule
from .tiny import init_random_, tiny_config
from .sharding import tp_counts
from ...parallel import TensorParallel, check_divides

TINY_SEED = 1234


def _tokenizer_for(directory: Path | None, cfg):
    from ...tokenizer import load_tokenizer
    eos = cfg.eos_ids[0] if cfg.eos_ids else None
    return load_tokenizer(str(directory) if directory else None, cfg.bos_token_id, eos, cfg.vocab_size)


def load_tiny(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              numerics: str = "hf") -> Dsv4Model:
    model = Dsv4Model(tiny_config(), dtype=dtype, device=device)
    model.mtp = MtpModule(model.config, model.dtype, model.device)
    init_random_(model, TINY_SEED)
    model.tokenizer = _tokenizer_for(None, model.config)
    model.set_numerics(numerics)
    return model.eval()


def load_dsv4(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              numerics: str = "hf", weights: str = "dequant", tp: int = 1) -> Dsv4Model:
    """`tp` > 1: this rank's shard of the model (sharding.py), in the current process group; the
    config is checked for divisibility before the group or any weight is touched."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; pass a checkpoint directory or 'tiny'")
    cfg = load_config(directory)
    group = None
    if tp != 1:
        check_divides(tp_counts(cfg), tp)
        group = TensorParallel.current(tp)
    # held as stored: built on meta, so no float placeholder of a quantized weight is ever allocated
    lazy = weights == "quantized" and group is None
    model = Dsv4Model(cfg, dtype=dtype, device="meta" if lazy else device, tp=group)
    load_weights(model, directory, weights=weights, device=device if lazy else None)
    try:
        model.tokenizer = _tokenizer_for(directory, cfg)
    except ConfigError as e:  # the model still runs on token ids; text commands will say what is missing
        print(f"kvfold: note: {e}", file=sys.stderr)
    model.set_numerics(numerics)
    return model.eval()

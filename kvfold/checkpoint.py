"""Load a transformers-layout DeepSeek-V4 checkpoint directory: `config.json` plus
`model.safetensors` or shards listed in `model.safetensors.index.json`.

Tensors are read one at a time from memory-mapped safetensors files straight into the model's
parameters, so a checkpoint is never held in memory twice. Every missing, unexpected or
mis-shaped tensor is collected and reported in one error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

_PREFIX = "model."


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


def _model_name(key: str) -> str:
    """Checkpoint key -> our parameter name (we keep the transformers names)."""
    return key  # identical layout; `model.` prefix and `lm_head` are ours too


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = set(params)
    seen: set[str] = set()
    unexpected, misshaped = [], []
    for f in checkpoint_files(directory):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                if key.startswith("mtp."):
                    model.mtp_weights[key] = sf.get_tensor(key).to(model.device)
                    continue
                name = _model_name(key)
                if name not in params:
                    unexpected.append(key)
                    continue
                target = params[name]
                shape = tuple(sf.get_slice(key).get_shape())
                if shape != tuple(target.shape):
                    misshaped.append(f"{key}: file {shape} vs expected {tuple(target.shape)}")
                    continue
                target.data.copy_(sf.get_tensor(key))  # one tensor at a time, converted into place
                seen.add(name)
    missing = sorted(n for n in expected - seen if not n.startswith("mtp."))
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
        params["lm_head.weight"].data.copy_(params[_PREFIX + "embed_tokens.weight"].data)
        missing.remove("lm_head.weight")
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
        if misshaped:
            parts.append(f"mis-shaped {len(misshaped)}: {misshaped[:20]}")
        raise CheckpointError(f"checkpoint {directory} does not match its config.json: " + "; ".join(parts))


def save_checkpoint(model: torch.nn.Module, directory: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` in the transformers layout (MTP under the
    official `mtp.0.*` names, which is where checkpoints carry it)."""
    from safetensors.torch import save_file
    from .models.mtp import official_mtp_weights
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    if model.mtp is not None:
        tensors.update({k: v.cpu() for k, v in official_mtp_weights(model.mtp).items()})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    return directory

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

from .checkpoint_names import to_kvfold_name
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


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {n for n in params if not n.startswith("mtp.")}
    seen: set[str] = set()
    expert_seen: dict[str, set[tuple[int, str]]] = {}
    unexpected, misshaped = [], []
    inter = model.config.moe_intermediate_size
    for f in checkpoint_files(directory):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                target = to_kvfold_name(key)
                if target is None:  # mtp.*: kept for the MTP drafter
                    model.mtp_weights[key.removeprefix("model.")] = sf.get_tensor(key).to(model.device)
                    continue
                if target.name not in params:
                    unexpected.append(key)
                    continue
                dest = params[target.name].data
                if target.expert is not None:
                    if target.expert >= dest.shape[0]:
                        unexpected.append(key)
                        continue
                    dest = dest[target.expert]
                    if target.part != "w2":
                        dest = dest[:inter] if target.part == "w1" else dest[inter:]
                shape = tuple(sf.get_slice(key).get_shape())
                if shape != tuple(dest.shape):
                    misshaped.append(f"{key}: file {shape} vs expected {tuple(dest.shape)}")
                    seen.add(target.name)  # reported as mis-shaped, not also as missing
                    continue
                dest.copy_(sf.get_tensor(key))  # one tensor at a time, converted into place
                if target.expert is None:
                    seen.add(target.name)
                else:
                    expert_seen.setdefault(target.name, set()).add((target.expert, target.part))
    for name, parts in expert_seen.items():
        n_exp = params[name].shape[0]
        want = {(e, p) for e in range(n_exp) for p in (("w2",) if name.endswith("down_proj") else ("w1", "w3"))}
        if parts == want:
            seen.add(name)
    missing = sorted(expected - seen)
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

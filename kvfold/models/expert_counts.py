"""Routing counts over a calibration text: which routed experts each MoE layer picks, and how
often. A partial expert pack (models/split_experts.py) holds the K experts a layer picks most on
the card, so most routed pairs run there (`kvfold calibrate-experts`; the `/metrics` hit ratio
says how many do).

The counts are stored beside the checkpoint as `expert_counts.json` (plain JSON, read with
`json`: no code runs on load), tied to the model's config fingerprint so a file made for another
model is refused.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import PlacementError

FILE = "expert_counts.json"
FORMAT = "kvfold-expert-counts"
VERSION = 1


@torch.no_grad()
def count_routes(model, token_ids: list[int], chunk: int = 256) -> list[list[int] | None]:
    """Per layer, how many of the text's tokens picked each routed expert (None: a dense layer).
    The text runs as prefill chunks of `chunk` tokens through one state, and each router's
    choices are read as it makes them (a forward hook on `mlp.gate`)."""
    n = model.config.n_routed_experts
    counts: list[list[int] | None] = []
    hooks = []
    for block in model.model.layers:
        gate = getattr(block.mlp, "gate", None)
        if gate is None:
            counts.append(None)
            continue
        tally = [0] * n
        counts.append(tally)

        def hook(_module, _inputs, out, tally=tally):
            for e, c in enumerate(torch.bincount(out[1].reshape(-1).cpu(), minlength=n).tolist()):
                tally[e] += c
        hooks.append(gate.register_forward_hook(hook))
    try:
        state = model.new_state(capacity=len(token_ids))
        for a in range(0, len(token_ids), chunk):
            model.forward(token_ids[a:a + chunk], state, last_only=True)
        state.free()
    finally:
        for h in hooks:
            h.remove()
    return counts


def save(directory: str | Path, model, counts: list[list[int] | None], text: str, tokens: int) -> Path:
    path = Path(directory) / FILE
    doc = {"format": FORMAT, "version": VERSION, "fingerprint": model.config.fingerprint(), "tokens": tokens,
           "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
           "layers": {str(i): c for i, c in enumerate(counts) if c is not None}}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


def load(path: str | Path, model) -> list[list[int] | None]:
    """The counts of `path` (a file, or a checkpoint directory holding `expert_counts.json`) for
    `model`; PlacementError where the file is not one, or was made for another model."""
    path = Path(path)
    path = path / FILE if path.is_dir() else path
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PlacementError(f"cannot read the expert counts {path}: {e}; make them with kvfold calibrate-experts") \
            from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise PlacementError(f"{path} is not a {FORMAT} v{VERSION} file; make one with kvfold calibrate-experts")
    if doc.get("fingerprint") != model.config.fingerprint():
        raise PlacementError(f"{path} counts the routing of another model (config fingerprint "
                             f"{doc.get('fingerprint')}, this one {model.config.fingerprint()}); calibrate this one")
    n, layers = model.config.n_routed_experts, doc.get("layers")
    moe = [getattr(b.mlp, "gate", None) is not None for b in model.model.layers]
    want = {str(i) for i, m in enumerate(moe) if m}
    if not isinstance(layers, dict) or set(layers) != want or not all(
            isinstance(c, list) and len(c) == n and all(type(x) is int and x >= 0 for x in c)
            for c in layers.values()):
        raise PlacementError(f"{path} must count the {n} experts of each MoE layer {sorted(want, key=int)}; "
                             f"calibrate this model again")
    return [layers[str(i)] if m else None for i, m in enumerate(moe)]


def top_experts(counts: list[int], k: int) -> frozenset[int]:
    """The k experts picked most (ties: the lower id)."""
    return frozenset(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:k])

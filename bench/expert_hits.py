"""How often a partial expert pack serves a token's routed experts on the card (issue 46, item 2),
measured on the trained `tiny` over its held-out text.

The first half of kvfold/assets/tiny/heldout.txt calibrates (routing counts, models/expert_counts.py);
the second half is decoded token by token through a model whose five layers are on the card, each
holding K of its 8 experts, under three policies: the first K by id, the K the calibration ranks
highest, and the K used most recently (LRU). Every device is virtual (both sides are the CPU), so
the run is the split model's own code; the hit rate is `model.expert_hits()`: routed (token,
expert) pairs served on the card over all of them. Uniform routing would give K / 8.

    python bench/expert_hits.py [--tokens 1500] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import kvfold
from kvfold.layers.virtual_devices import VirtualDevices
from kvfold.models import expert_counts
from kvfold.models.registry import TINY_DIR
from kvfold.placement import Placement

CARD = "cuda:0"


def hit_rate(placement: Placement, policy: str, tokens: list[int]) -> float:
    model = kvfold.load_model("tiny")
    vd = VirtualDevices()
    with vd:
        model.place(placement, virtual=vd, expert_policy=policy)
        state = model.new_state(len(tokens) + 1)
        for t in tokens:
            model.forward([t], state)
    hits, slots = model.expert_hits()
    return hits / slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1500, help="held-out tokens decoded per setting")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    model = kvfold.load_model("tiny")
    text = (TINY_DIR / "heldout.txt").read_text(encoding="utf-8")
    half = len(text) // 2
    calibration, held_out = model.tokenizer.encode(text[:half]), model.tokenizer.encode(text[half:])[:args.tokens]
    counts = expert_counts.count_routes(model, calibration)
    n, e = model.config.num_hidden_layers, model.config.n_routed_experts
    rows = []
    for k in (2, 4, 6):
        first = Placement((CARD,) * n, (frozenset(range(k)),) * n, e, "cpu", CARD)
        for name, placement, policy in (("first K", first, "static"), ("calibrated", first.ranked(counts), "static"),
                                        ("lru", first, "lru")):
            t = time.perf_counter()
            rate = hit_rate(placement, policy, held_out)
            rows.append({"k": k, "set": name, "hit_rate": rate, "uniform": k / e, "tokens": len(held_out),
                         "calibration_tokens": len(calibration), "seconds": time.perf_counter() - t})
            print(f"K={k} {name:>10}: {rate:.3f} of routed pairs on the card (uniform {k / e:.3f})", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

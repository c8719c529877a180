"""`kvfold calibrate-experts`: count which routed experts each MoE layer picks over a text, and
store the counts beside the checkpoint (models/expert_counts.py), where a placement's partial
expert packs read them: each card layer then holds the K experts the text picked most."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_calibrate_command(sub) -> None:
    c = sub.add_parser("calibrate-experts", help="count routed experts over a text, for partial expert packs")
    c.add_argument("--model", required=True, help="a checkpoint directory (or tiny, with --out)")
    c.add_argument("--text", required=True, help="UTF-8 calibration text (a few thousand tokens of what you serve)")
    c.add_argument("--out", default=None, help="directory to write expert_counts.json to (default: the checkpoint's)")
    c.add_argument("--max-tokens", type=int, default=65536, help="count over the text's first N tokens")
    c.add_argument("--weights", choices=("dequant", "quantized"), default="quantized",
                   help="quantized (default): FP8/FP4 weights held as stored, as a real checkpoint needs to fit; "
                        "routing is computed the same either way")


def run_calibrate_command(args: argparse.Namespace) -> int:
    import kvfold
    from .errors import KvfoldError
    from .models import expert_counts
    from .models.registry import checkpoint_dir
    out = Path(args.out) if args.out else checkpoint_dir(args.model)
    if out is None or not out.is_dir():
        print(f"error: --out must name a directory for {args.model!r} (got {out})", file=sys.stderr)
        return 2
    try:
        text = Path(args.text).read_text(encoding="utf-8")
        model = kvfold.load_model(args.model, weights=args.weights)
        ids = model.tokenizer.encode(text)[:args.max_tokens]
        if not ids:
            raise KvfoldError(f"{args.text} holds no tokens to count")
        counts = expert_counts.count_routes(model, ids)
        path = expert_counts.save(out, model, counts, text, len(ids))
    except (OSError, UnicodeDecodeError, KvfoldError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layers = sum(c is not None for c in counts)
    print(f"counted the routing of {len(ids)} tokens in {layers} MoE layers: {path}")
    return 0

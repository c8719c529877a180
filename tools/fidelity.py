"""Regenerate docs/fidelity.md: held-out perplexity of the built-in `tiny` model in each numeric format.

    .venv/bin/python tools/fidelity.py            # about 2 minutes on 2 cores

Every row scores the same held-out text (kvfold/assets/tiny/heldout.txt, which training never saw)
with `kvfold.decoding.perplexity.score_text`, the code behind `kvfold eval-ppl`, and is compared
with the fp32 row: perplexity, its relative change, and the fraction of positions where both rank
the same token first. The FP8/FP4 rows read a conversion made here with `kvfold convert --to
official` (FP8 e4m3 with 128x128 ue8m0 scales for the attention and shared-expert weights, FP4 e2m1
with 1x32 scales for the routed experts, as the release stores them).
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kvfold  # noqa: E402
from kvfold.decoding.perplexity import score_text, unigram_perplexity  # noqa: E402
from kvfold.models.deepseek_v4.convert import convert  # noqa: E402
from kvfold.models.registry import TINY_DIR  # noqa: E402

CONTEXT = 512
# (label, checkpoint: "float" | "fp8", load options, kv_dtype)
ROWS = [
    ("fp32", "float", {}, None),
    ("bf16 weights and activations", "float", {"dtype": torch.bfloat16}, None),
    ('fp32, `kv_dtype="fp8"`', "float", {}, "fp8"),
    ('bf16, `numerics="reference"`', "float", {"dtype": torch.bfloat16, "numerics": "reference"}, None),
    ('FP8/FP4 weights, `weights="quantized"`, fp32', "fp8", {"weights": "quantized"}, None),
    ('FP8/FP4 weights, `weights="dequant"`, fp32', "fp8", {}, None),
    ('FP8/FP4 weights, bf16, `numerics="reference"`, `kv_dtype="fp8"` (the release\'s own setup)', "fp8",
     {"dtype": torch.bfloat16, "numerics": "reference", "weights": "quantized"}, "fp8"),
]


def measure(fp8_dir: Path) -> tuple[list[tuple[str, float, float, float, float]], int, float]:
    text = (TINY_DIR / "heldout.txt").read_text(encoding="utf-8")
    ids = None
    base = None
    rows = []
    for label, checkpoint, options, kv_dtype in ROWS:
        model = kvfold.load_model(TINY_DIR if checkpoint == "float" else fp8_dir, **options)
        if ids is None:
            ids = model.tokenizer.encode(text)
        t = time.perf_counter()
        scores = score_text(model, ids, context=CONTEXT, kv_dtype=kv_dtype)
        seconds = time.perf_counter() - t
        base = base or scores
        rows.append((label, scores.perplexity, scores.perplexity / base.perplexity - 1,
                     scores.top1_agreement(base), seconds))
        print(f"{label}: {scores.perplexity:.4f} ({seconds:.1f} s)", flush=True)
    return rows, len(ids), unigram_perplexity(ids)


def render(rows, n_tokens: int, unigram: float, command: str) -> str:
    lines = [
        "# Fidelity of kvfold's numeric formats, measured on real text",
        "",
        "The built-in `tiny` model (`kvfold/assets/tiny/`, trained by `tools/train_tiny.py` on Python's",
        "documentation; see `training.json` there) scores the held-out text `kvfold/assets/tiny/heldout.txt`",
        f"({n_tokens} tokens that training never saw) in windows of {CONTEXT} tokens, each behind BOS.",
        "Each row is compared with the fp32 row on the same tokens.",
        "",
        f"Regenerate with `{command}`; one row is `kvfold eval-ppl --model tiny --text "
        "kvfold/assets/tiny/heldout.txt` with the row's options.",
        "",
        "| format | perplexity | vs fp32 | top-1 agreement with fp32 | seconds |",
        "|---|---|---|---|---|",
    ]
    for label, ppl, rel, agree, seconds in rows:
        lines.append(f"| {label} | {ppl:.4f} | {100 * rel:+.3f}% | {100 * agree:.2f}% | {seconds:.1f} |")
    lines += [
        "",
        f"For scale: the text's own unigram distribution, fitted on the scored text itself, has perplexity "
        f"{unigram:.1f}.",
        "",
        "Targets, from what the DeepSeek-V4 report claims for its formats: FP8 KV within +1% of the fp32",
        "perplexity, bf16 within +0.5%.",
        "",
        "- `weights=\"quantized\"` and `weights=\"dequant\"` of the same FP8/FP4 checkpoint give the same",
        "  perplexity to every digit: kvfold decodes the stored weights to the same floats either way",
        "  (docs/checkpoints.md), so the two rows differ only in when the decoding happens.",
        "- The FP8/FP4 rows measure the conversion of a bf16-trained model, which costs more than the",
        "  release's quantization-aware training would: the real checkpoints were trained in these formats.",
        "",
        f"Measured on Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "fidelity.md"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fp8_dir = convert(TINY_DIR, Path(tmp) / "tiny-fp8", "official")
        rows, n_tokens, unigram = measure(fp8_dir)
    Path(args.out).write_text(render(rows, n_tokens, unigram, "python tools/fidelity.py"), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

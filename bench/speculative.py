"""Speculative decoding on real text: the trained built-in `tiny` model, greedy, drafting with its
MTP block and with n-gram prompt lookup at 1 to 4 draft tokens, against plain decoding.

    .venv/bin/python bench/speculative.py [--prompts 6] [--new-tokens 96] [--reps 3] [--threads 2]

Prompts are the first 48 tokens of consecutive 400-character slices of the held-out text
(kvfold/assets/tiny/heldout.txt), so each continues documentation the model never saw. For each
setting the whole prompt set runs `--reps` times, alternating settings within each repetition; the
table gives the median decode tok/s, its spread (min-max) and the ratio to plain decoding's median.
Every setting's tokens are checked to equal plain greedy decoding's: speculation never changes
greedy output.
"""
import argparse
import json
import statistics

import torch

import kvfold
from kvfold.models.registry import TINY_DIR

PROMPT_TOKENS = 48


def prompts(model, n: int) -> list[list[int]]:
    text = (TINY_DIR / "heldout.txt").read_text(encoding="utf-8")
    tok = model.tokenizer
    return [[tok.bos_id] + tok.encode(text[i * 400:(i + 1) * 400])[:PROMPT_TOKENS] for i in range(n)]


def run(model, ps, new_tokens: int, speculative, k: int):
    drafted = accepted = steps = generated = 0
    seconds = 0.0
    outs = []
    for p in ps:
        r = kvfold.generate(model, p, new_tokens, speculative=speculative, num_draft=k, ignore_eos=True)
        drafted, accepted, steps = drafted + r.drafted, accepted + r.accepted, steps + r.verify_steps
        generated += len(r.tokens) - 1  # the first token comes from the prefill
        seconds += r.decode_seconds
        outs.append(r.tokens)
    return outs, dict(drafted=drafted, accepted=accepted, steps=steps, tok_s=generated / seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvfold.load_model("tiny")
    ps = prompts(model, args.prompts)
    settings = [(None, 0)] + [(s, k) for s in ("mtp", "ngram") for k in (1, 2, 3, 4)]
    run(model, ps[:1], 8, None, 0)  # warm-up
    speeds = {s: [] for s in settings}
    stats, plain_out = {}, None
    for _ in range(args.reps):
        for s in settings:
            outs, st = run(model, ps, args.new_tokens, *s)
            if s == (None, 0):
                plain_out = plain_out or outs
            elif outs != plain_out:
                raise SystemExit(f"{s}: speculative greedy output differs from plain greedy output")
            speeds[s].append(st["tok_s"])
            stats[s] = st
    base = statistics.median(speeds[(None, 0)])
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, {args.reps} reps, {args.threads} threads; "
          f"greedy outputs identical in every setting")
    print("| drafter | draft tokens | acceptance | tokens per verify step | decode tok/s (median, min-max) | speed-up |")
    print("|---|---|---|---|---|---|")
    rows = []
    for s in settings:
        st, med = stats[s], statistics.median(speeds[s])
        acc = st["accepted"] / st["drafted"] if st["drafted"] else float("nan")
        per_step = (st["accepted"] + st["steps"]) / st["steps"] if s[0] else 1.0
        name = s[0] or "none"
        print(f"| {name} | {s[1] or '-'} | {'-' if not s[0] else f'{100 * acc:.1f}%'} | {per_step:.2f} | "
              f"{med:.1f} ({min(speeds[s]):.1f}-{max(speeds[s]):.1f}) | {med / base:.2f}x |")
        rows.append(dict(drafter=name, k=s[1], acceptance=acc, tokens_per_step=per_step, tok_s=speeds[s]))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

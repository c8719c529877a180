"""Speculative decoding on real text: the trained built-in `tiny` model (or `--model`), greedy,
drafting with its MTP block and with n-gram prompt lookup, at a fixed 1 to 4 draft tokens and with
the draft length chosen each step by measurement (`adaptive_draft=True`, up to 4: draft_length.py), against
plain decoding.

    .venv/bin/python bench/speculative.py [--prompts 6] [--new-tokens 96] [--reps 5] [--threads 2]
        [--model tiny] [--weights dequant] [--drafters mtp,ngram] [--fixed 1,2,3,4]

Prompts are the first 48 tokens of consecutive 400-character slices of the held-out text
(kvfold/assets/tiny/heldout.txt), so each continues documentation the model never saw. Each
repetition runs every setting on each prompt in turn, in an order rotated from prompt to prompt
(so the machine's slow phases hit every setting alike) and gives each setting's decode tok/s over the prompt set and its ratio to plain
decoding's in that repetition; the table gives the median tok/s with its spread (min-max) and the
median ratio with its spread.
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


def one(model, p, new_tokens: int, speculative, k: int, adaptive: bool):
    r = kvfold.generate(model, p, new_tokens, speculative=speculative, num_draft=max(k, 1),
                        adaptive_draft=adaptive, ignore_eos=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--weights", default="dequant")
    ap.add_argument("--drafters", default="mtp,ngram")
    ap.add_argument("--fixed", default="1,2,3,4", help="fixed draft lengths to run (empty: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvfold.load_model(args.model, weights=args.weights)
    ps = prompts(model, args.prompts)
    fixed = [int(k) for k in args.fixed.split(",") if k]
    drafters = [d for d in args.drafters.split(",") if d]
    plain = (None, 0, False)
    settings = [plain] + [(s, k, False) for s in drafters for k in fixed] + [(s, 4, True) for s in drafters]
    for s in settings:  # warm-up (and the adaptive settings' first cost measurements)
        one(model, ps[0], 16, *s)
    ratios = {s: [] for s in settings}
    speeds = {s: [] for s in settings}
    counts = {s: dict(drafted=0, accepted=0, steps=0) for s in settings}
    plain_out = [one(model, p, args.new_tokens, *plain).tokens for p in ps]
    for rep in range(args.reps):
        seconds = {s: 0.0 for s in settings}
        generated = {s: 0 for s in settings}
        for i, p in enumerate(ps):  # every setting on each prompt in turn: slow phases hit all alike
            first = (i + rep) % len(settings)  # and in a rotated order: none always runs first
            for s in settings[first:] + settings[:first]:
                r = one(model, p, args.new_tokens, *s)
                if r.tokens != plain_out[i]:
                    raise SystemExit(f"{s}: speculative greedy output differs from plain greedy output")
                seconds[s] += r.decode_seconds
                generated[s] += len(r.tokens) - 1  # the first token comes from the prefill
                c = counts[s]
                c.update(drafted=c["drafted"] + r.drafted, accepted=c["accepted"] + r.accepted,
                         steps=c["steps"] + r.verify_steps)
        for s in settings:
            speeds[s].append(generated[s] / seconds[s])
            ratios[s].append(speeds[s][-1] / speeds[plain][-1])
    print(f"{args.model} ({args.weights}), {args.prompts} prompts x {args.new_tokens} new tokens, {args.reps} reps, "
          f"{args.threads} threads; greedy outputs identical in every setting")
    print("| drafter | draft tokens | acceptance | tokens per verify step | decode tok/s (median, min-max) "
          "| speed-up (median of reps, min-max) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for s in settings:
        c, med = counts[s], statistics.median(speeds[s])
        acc = c["accepted"] / c["drafted"] if c["drafted"] else float("nan")
        per_step = (c["accepted"] + c["steps"]) / c["steps"] if s[0] else 1.0
        name, rs = s[0] or "none", ratios[s]
        k = ("adaptive <= 4" if s[2] else s[1]) or "-"
        print(f"| {name} | {k} | {'-' if not s[0] else f'{100 * acc:.1f}%'} | {per_step:.2f} | "
              f"{med:.1f} ({min(speeds[s]):.1f}-{max(speeds[s]):.1f}) | "
              f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f}) |")
        rows.append(dict(drafter=name, k=s[1], adaptive=s[2], acceptance=acc, tokens_per_step=per_step,
                         tok_s=speeds[s], ratio=rs))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

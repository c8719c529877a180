"""Per-token cost of structured output: `mask_` + `accept` of a JSON-schema grammar against plain
greedy choice on the same random logits, for the tiny model's byte vocab (258 ids, RAW) and for
a synthetic 128k-token byte-level BPE vocab (the size of Llama 3's). One thread.

    .venv/bin/python bench/grammar.py [--tokens 2000] [--reps 5]

Each repetition times `--tokens` steps; a matcher that reaches the end of its grammar is replaced
by a fresh one (its construction counts). Then the same end to end: `kvfold.generate` on the
tiny model, greedy, with and without the grammar, the same number of tokens, alternating runs.
Needs xgrammar: pip install 'kvfold[structured]'.
"""
import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvfold.decoding.grammar import GrammarMatcher, GrammarSpec, compile_grammar
from kvfold.tokenizer import ByteTokenizer, HFTokenizer

torch.set_num_threads(1)
SCHEMA = {"type": "array", "maxItems": 50, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["id", "name", "kind"]}}


def synthetic_bpe(directory: Path, n_tokens: int) -> HFTokenizer:
    """A byte-level BPE tokenizer.json of n_tokens: the 256 byte symbols, then random word-like
    pieces ("Ġ" marks a leading space) and JSON-ish punctuation runs. No merges: only the
    vocabulary matters to the grammar."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    rng = random.Random(0)
    letters, punct = "etaoinshrdlucmfwypvbgkjqxz", '{}[]":,.-_0123456789'
    while len(vocab) < n_tokens:
        if rng.random() < 0.85:
            piece = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            piece = ("Ġ" if rng.random() < 0.5 else "") + (piece.capitalize() if rng.random() < 0.2 else piece)
        else:
            piece = "".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory, bos_id=n_tokens, eos_id=n_tokens + 1, vocab_size=n_tokens + 2)


def steps_per_s(logits: torch.Tensor, n: int, compiled=None) -> float:
    """Greedy steps per second over rows of `logits`, through the grammar when `compiled`."""
    matcher = GrammarMatcher(compiled) if compiled is not None else None
    t0 = time.perf_counter()
    for i in range(n):
        x = logits[i % len(logits)].clone()
        if matcher is not None:
            if matcher.terminated:
                matcher = GrammarMatcher(compiled)
            matcher.mask_(x)
        token = int(x.argmax())
        if matcher is not None:
            matcher.accept(token)
    return n / (time.perf_counter() - t0)


def spread(rates: list[float]) -> str:
    return f"median {statistics.median(rates):9.0f}  min {min(rates):9.0f}  max {max(rates):9.0f} tok/s"


def bench(name: str, tokenizer, vocab_size: int, tokens: int, reps: int) -> None:
    t0 = time.perf_counter()
    compiled = compile_grammar(GrammarSpec("json_schema", SCHEMA), tokenizer, vocab_size)
    setup_s = time.perf_counter() - t0
    logits = torch.randn(512, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    steps_per_s(logits, 200), steps_per_s(logits, 200, compiled)  # warm-up
    plain = [steps_per_s(logits, tokens) for _ in range(reps)]
    grammar = [steps_per_s(logits, tokens, compiled) for _ in range(reps)]
    overhead_us = (1 / statistics.median(grammar) - 1 / statistics.median(plain)) * 1e6
    print(f"{name} (vocab {vocab_size}; TokenizerInfo + compile {setup_s:.2f} s)")
    print(f"  no grammar   {spread(plain)}")
    print(f"  grammar      {spread(grammar)}")
    print(f"  ratio (median grammar / median plain) {statistics.median(grammar) / statistics.median(plain):.3f}; "
          f"grammar adds {overhead_us:.1f} us/token")


def model_bench(reps: int) -> None:
    """Decode tok/s of `kvfold.generate` on the tiny model with the grammar and without, for as
    many tokens as the constrained output takes (plain runs with stop_ids=[] to match it)."""
    import kvfold
    model = kvfold.load_model("tiny-random")
    prompt = [model.tokenizer.bos_id] + model.tokenizer.encode("A JSON list of records: ")
    # exactly 6 records: the random model cannot stop early (the main SCHEMA lets it answer "[]")
    schema = {**SCHEMA, "minItems": 6, "maxItems": 6}
    compiled = compile_grammar(GrammarSpec("json_schema", schema), model.tokenizer, model.config.vocab_size)
    n = len(kvfold.generate(model, prompt, 400, grammar=GrammarMatcher(compiled)).tokens)
    plain, grammar = [], []
    for _ in range(reps):
        plain.append(kvfold.generate(model, prompt, n, stop_ids=[]).decode_tok_s)
        grammar.append(kvfold.generate(model, prompt, n, grammar=GrammarMatcher(compiled)).decode_tok_s)
    print(f"tiny model, kvfold.generate, {n} greedy tokens")
    print(f"  no grammar   {spread(plain)}")
    print(f"  grammar      {spread(grammar)}")
    print(f"  ratio (median grammar / median plain) {statistics.median(grammar) / statistics.median(plain):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="steps per repetition")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median, min, max over them)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import xgrammar  # noqa: F401  (timed apart: ~3 s, once per process)
    print(f"import xgrammar {time.perf_counter() - t0:.2f} s; schema {json.dumps(SCHEMA)[:60]}...")
    bench("byte tokenizer (tiny model)", ByteTokenizer(258), 258, args.tokens, args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok = synthetic_bpe(Path(tmp), 128_000)
        print(f"synthetic tokenizer.json built in {time.perf_counter() - t0:.2f} s")
        bench("synthetic byte-level BPE", tok, tok.vocab_size, args.tokens, args.reps)
    model_bench(args.reps)


if __name__ == "__main__":
    main()

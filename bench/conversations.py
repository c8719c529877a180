"""Time to first token of each turn of a conversation a stateless client re-sends whole, as coding
agents do: with the engine keeping the conversations it produced (`Engine(conversations=...)`,
engine/transcripts.py) against the prefix cache alone (block boundaries of cold runs).

    .venv/bin/python bench/conversations.py --model tiny --history 4096 --turns 5 --output 64 --repeats 3

A live server (in this process, uvicorn on a thread) serves the model in its chat format with the
prefix cache on. Turn 1 sends a system prompt of about `--history` tokens and a question; every
later turn re-sends the whole conversation (the earlier replies as the API returned them) plus a
short question. Each reply is `--output` tokens (greedy, ignore_eos; `--words`: lower-case words,
for a random checkpoint whose bytes are no text, which a client could not send back). TTFT is from sending the
streamed chat completion to its first content chunk. The two settings alternate, `--repeats`
conversations each (each on a fresh engine), and the report gives each turn's median TTFT, the
prompt tokens and the share of them cached.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import httpx
import torch

import kvfold
from kvfold.server.app import create_app

from responses_resume import Server

TEXT = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree by the river. "


def turn(url: str, messages: list[dict], output: int, words: bool) -> tuple[float, str, dict]:
    """(seconds to the first content chunk, the reply, usage) of one streamed chat completion."""
    body = {"model": "m", "messages": messages, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if words:  # a random model's bytes are no text: lower-case words, which the reply's text keeps
        body["guided_regex"] = f"[a-z ]{{{output}}}"
    start, first, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", ()):
                piece = c["delta"].get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
            usage = chunk.get("usage") or usage
    return first, text, usage


def conversation(model, conversations: bool, args) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) of each turn on a fresh engine."""
    engine = kvfold.Engine(model, max_seq_len=args.history + args.turns * (args.output + 64) + 256,
                           max_running=2, conversations=(1 << 22) if conversations else 0)
    system = (TEXT * (args.history // 20 + 1))[: args.history * 4]
    ids = model.tokenizer.encode(system)[: args.history]
    messages = [{"role": "system", "content": model.tokenizer.decode(ids)}]
    out = []
    with Server(create_app(engine, model_name="m")) as url:
        for k in range(args.turns):
            messages.append({"role": "user", "content": f"Question {k}: what happened next?"})
            ttft, reply, usage = turn(url, messages, args.output, args.words)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out.append((ttft, usage["prompt_tokens"], cached))
            messages.append({"role": "assistant", "content": reply})
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--history", type=int, default=4096, help="tokens of the system prompt")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--output", type=int, default=64, help="tokens of each reply")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--words", action="store_true",
                    help="constrain replies to lower-case words (a random checkpoint writes bytes that are no text)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvfold.load_model(args.model)
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for on in (True, False):
            runs[on].append(conversation(model, on, args))
    print(f"model {args.model}, system prompt {args.history} tokens, {args.turns} turns of {args.output} tokens, "
          f"{args.repeats} conversations each, alternating; {args.threads} thread(s); {cpu_model()}; "
          f"torch {torch.__version__}")
    print("turn | prompt tokens | conversations kept: TTFT ms median [min-max], cached | prefix cache alone: "
          "TTFT ms, cached | ratio")
    for k in range(args.turns):
        cells = {}
        for on in (True, False):
            t = [r[k][0] * 1000 for r in runs[on]]
            cells[on] = (statistics.median(t), min(t), max(t), runs[on][0][k][2] / runs[on][0][k][1])
        n = runs[True][0][k][1]
        (a, a0, a1, ca), (b, b0, b1, cb) = cells[True], cells[False]
        print(f"{k + 1} | {n} | {a:.1f} [{a0:.1f}-{a1:.1f}], {ca:.1%} | {b:.1f} [{b0:.1f}-{b1:.1f}], {cb:.1%} | "
              f"{b / a:.1f}x")


if __name__ == "__main__":
    main()

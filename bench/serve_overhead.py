"""What the serving path adds to one stream: HTTP against in-process decode, side by side in one run.

    .venv/bin/python bench/serve_overhead.py [--requests 16] [--prompt-tokens 128] [--max-tokens 32]
                                             [--rounds 3] [--threads 2] [--no-batch-invariant]

It starts `kvfold serve --model tiny` as a separate process (127.0.0.1, a free port, the same
thread count and numerics mode), and loads the same model in this process. Each round sends the
requests one at a time through `kvfold bench serve`'s streaming `openai` client, then decodes the
same prompts in this process with `kvfold.decoding.generate` (greedy, the same `max_tokens`, EOS
stops both), so one path is idle while the other runs. The time per output token is bench serve's
definition for both: (end - first token) / (tokens - 1), per request. The table gives each
path's median over every request of every round, its spread (p10-p90), and the ratio of the
speeds (in-process ms per token / HTTP ms per token: 1.0 means HTTP adds nothing).
"""
import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch

import kvfold
from kvfold.bench.serve import make_prompts, percentile, run_load
from kvfold.bench.spawn import child_env
from kvfold.decoding.generate import generate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, threads: int, invariant: bool) -> subprocess.Popen:
    env = child_env(threads)
    cmd = [sys.executable, "-m", "kvfold", "serve", "--model", "tiny", "--port", str(port)]
    if not invariant:
        cmd.append("--no-batch-invariant")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvfold serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("kvfold serve did not come up within 120 s")


def http_tpots(port: int, prompts: list[list[int]], max_tokens: int) -> list[float]:
    run = asyncio.run(run_load(f"http://127.0.0.1:{port}/v1", "none", prompts, concurrency=1,
                               max_tokens=max_tokens, stream=True, seed=0, timeout_s=600,
                               warmup_prompts=prompts[:1]))
    bad = [r["error"] for r in run["records"] if not r["ok"]]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {bad[:3]}")
    return [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in run["records"]
            if r["output_tokens"] > 1]


def in_process_tpots(model, prompts: list[list[int]], max_tokens: int) -> list[float]:
    out = []
    generate(model, prompts[0], max_tokens)  # warm-up, as the HTTP side has
    for p in prompts:
        stamps: list[float] = []
        generate(model, p, max_tokens, on_token=lambda _t: stamps.append(time.perf_counter()))
        if len(stamps) > 1:
            out.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return out


def spread(values: list[float]) -> str:
    s = sorted(values)
    return (f"{1e3 * statistics.median(s):.2f} [{1e3 * percentile(s, 10):.2f}-{1e3 * percentile(s, 90):.2f}]"
            f" (n={len(s)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-batch-invariant", dest="invariant", action="store_false")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = kvfold.load_model("tiny")
    model.set_batch_invariant(args.invariant)
    prompts = make_prompts(args.requests, args.prompt_tokens, model.config.vocab_size, seed=0)
    port = free_port()
    server = start_server(port, args.threads, args.invariant)
    http, local = [], []
    try:
        for r in range(args.rounds):
            http += http_tpots(port, prompts, args.max_tokens)
            local += in_process_tpots(model, prompts, args.max_tokens)
            print(f"round {r + 1}: HTTP {spread(http)} ms, in-process {spread(local)} ms", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    ratio = statistics.median(local) / statistics.median(http)
    mode = "batch-invariant" if args.invariant else "--no-batch-invariant"
    print(f"\n{mode}, {args.threads} threads, {args.requests} requests x {args.rounds} rounds, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} out")
    print(f"ms per output token, median [p10-p90]:  HTTP stream {spread(http)}   in-process generate {spread(local)}")
    print(f"HTTP speed / in-process speed: {ratio:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mode": mode, "threads": args.threads, "http_tpot_s": http, "in_process_tpot_s": local,
                       "ratio": ratio, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

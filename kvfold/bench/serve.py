"""`kvfold bench serve`: a bounded, loopback-only load generator for `kvfold serve`.

It sends `--requests` completions (random token-id prompts of `--prompt-tokens` ids, greedy,
`--max-tokens` each, a fixed seed) with at most `--concurrency` in flight, through the `openai`
AsyncOpenAI client, and reports requests/s, output tokens/s and the p50/p90/p99 of the time to
first token, the inter-token latency (with `--stream`), the time per output token and the
end-to-end latency, plus the errors. It prints a table and writes the JSON (`--out`). The client
is the `bench` extra's (`pip install 'kvfold[bench]'`); without it the command stops at once.

Without `--url` it serves `--model` itself, in this process, on 127.0.0.1 (a free port) and stops
the server afterwards; client and server then share this process (and its GIL). With `--url` the
server must be on this machine: 127.0.0.0/8, ::1 or localhost; anything else is refused. The
requests, concurrency, prompt and output lengths are capped, and the whole run has a deadline
(`--timeout`): requests unfinished by then count as errors. The HTTP client ignores proxy
environment variables and does not follow redirects, so no request leaves the machine.

With `--stream`, a chunk carrying k tokens (kvfold's `return_token_ids` tells) after a gap g adds
k inter-token latencies of g/k. The time to first token, inter-token latency and time per output token
are only measured with `--stream`; without it only the end-to-end latency is.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import ipaddress
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from ..errors import KvfoldError
from .deps import require

MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 256
MAX_PROMPT_TOKENS = 32_768
MAX_OUTPUT_TOKENS = 8_192
MAX_TIMEOUT_S = 3_600.0
MAX_WARMUP = 16
PERCENTILES = (50, 90, 99)


class BenchServeError(KvfoldError):
    """`kvfold bench serve` was asked for something it does not do (a non-loopback URL, a limit
    over its cap), or the server could not be reached / did not answer the warm-up request."""


# ---- arguments -------------------------------------------------------------------------------------
def _bounded_int(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def _timeout(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < v <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {text}")
    return v


def _url(text: str) -> str:
    try:
        check_loopback_url(text)
    except BenchServeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="tiny",
                   help='checkpoint directory, or "tiny" (default): served in-process when there is no --url; '
                        "with --url, only its vocabulary is read (for the random prompts)")
    p.add_argument("--url", type=_url, default=None,
                   help="a running server on this machine, e.g. http://127.0.0.1:8000 "
                        "(127.0.0.0/8, ::1 or localhost only; default: serve --model in-process)")
    p.add_argument("--api-key", default=None,
                   help="API key to send (and, in-process, to require); default $KVFOLD_API_KEY, else none")
    p.add_argument("--concurrency", type=_bounded_int(1, MAX_CONCURRENCY), default=8,
                   help=f"requests in flight at once (default 8, at most {MAX_CONCURRENCY})")
    p.add_argument("--requests", type=_bounded_int(1, MAX_REQUESTS), default=64,
                   help=f"requests timed (default 64, at most {MAX_REQUESTS})")
    p.add_argument("--prompt-tokens", type=_bounded_int(1, MAX_PROMPT_TOKENS), default=64,
                   help=f"random token ids per prompt (default 64, at most {MAX_PROMPT_TOKENS})")
    p.add_argument("--max-tokens", type=_bounded_int(1, MAX_OUTPUT_TOKENS), default=32,
                   help=f"max_tokens of each request (default 32, at most {MAX_OUTPUT_TOKENS}); "
                        "a request may end earlier at an EOS token")
    p.add_argument("--stream", action="store_true",
                   help="stream the completions (needed for time to first token and inter-token latency)")
    p.add_argument("--timeout", type=_timeout, default=600.0,
                   help=f"deadline of the whole run, seconds (default 600, at most {MAX_TIMEOUT_S:g}); "
                        "unfinished requests then count as errors")
    p.add_argument("--warmup", type=_bounded_int(0, MAX_WARMUP), default=1,
                   help=f"untimed requests sent one at a time first (default 1, at most {MAX_WARMUP})")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default 0)")
    p.add_argument("--vocab-size", type=_bounded_int(1, 1 << 24), default=None,
                   help="token ids are drawn from [0, N) (default: the vocabulary of --model)")
    p.add_argument("--out", default=None, help="JSON results file (default kvfold-bench-serve.json)")
    g = p.add_argument_group("in-process server (without --url)")
    g.add_argument("--max-running", type=_bounded_int(1, 4096), default=16,
                   help="sequences decoding at once (default 16, as kvfold serve)")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight dtype (default float32)")
    g.add_argument("--weights", choices=("dequant", "quantized"), default="dequant",
                   help="as kvfold serve --weights (default dequant)")
    g.add_argument("--threads", type=_bounded_int(1, 1024), default=None,
                   help="the server's kernel threads (default: as kvfold serve, at most one fewer than the CPUs)")
    g.add_argument("--speculative", choices=("mtp", "ngram"), default=None,
                   help="as kvfold serve --speculative (default: none)")
    g.add_argument("--num-draft", type=_bounded_int(1, 16), default=4, help="as kvfold serve --num-draft (default 4)")
    g.add_argument("--fixed-draft", action="store_true", help="as kvfold serve --fixed-draft")
    return p


def check_loopback_url(url: str) -> str:
    """The OpenAI base URL (ending in /v1) of `url`, which must be http(s) on a loopback address
    (127.0.0.0/8, ::1, or the name localhost; no other name is resolved). Raises BenchServeError."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        raise BenchServeError(f"--url {url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise BenchServeError(f"--url {url!r} must be http://HOST:PORT with HOST a loopback address")
    ok = host.lower() == "localhost"
    if not ok:
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        if addr is not None:
            mapped = getattr(addr, "ipv4_mapped", None)
            ok = addr.is_loopback or (mapped is not None and mapped.is_loopback)
    if not ok:
        raise BenchServeError(f"--url {url!r}: kvfold bench serve only loads servers on this machine "
                              "(127.0.0.0/8, ::1 or localhost); refusing host " + repr(host))
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def check_limits(args: argparse.Namespace) -> None:
    """Re-check the caps (for a Namespace not built by the parser). Raises BenchServeError."""
    for name, lo, hi in (("requests", 1, MAX_REQUESTS), ("concurrency", 1, MAX_CONCURRENCY),
                         ("prompt_tokens", 1, MAX_PROMPT_TOKENS), ("max_tokens", 1, MAX_OUTPUT_TOKENS),
                         ("warmup", 0, MAX_WARMUP)):
        v = getattr(args, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise BenchServeError(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {v!r}")
    t = args.timeout
    if not (isinstance(t, (int, float)) and 0 < t <= MAX_TIMEOUT_S):
        raise BenchServeError(f"--timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {t!r}")
    if args.url is not None:
        check_loopback_url(args.url)


# ---- prompts and statistics ------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids, uniform in [0, vocab_size), reproducible from `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of an ascending list."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, Any] | None:
    """{"count", "mean", "min", "max", "p50", "p90", "p99"} of `values` (seconds), or None if empty."""
    if not values:
        return None
    s = sorted(values)
    d: dict[str, Any] = {"count": len(s), "mean": sum(s) / len(s), "min": s[0], "max": s[-1]}
    for q in PERCENTILES:
        d[f"p{q}"] = percentile(s, q)
    return d


def summarize(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """The aggregate numbers of one run from its per-request records."""
    ok = [r for r in records if r["ok"]]
    errors = [r for r in records if not r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    itl = [x for r in ok for x in r.get("itl_s") or ()]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
            if r.get("ttft_s") is not None and r["output_tokens"] > 1]
    dur = duration_s if duration_s > 0 else float("nan")
    return {
        "requests": len(records), "succeeded": len(ok), "errors": len(errors),
        "error_kinds": dict(Counter(r["error"] for r in errors).most_common(10)),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / dur,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / dur,
        "prompt_tokens": prompt_tokens, "prompt_tokens_per_s": prompt_tokens / dur,
        "output_tokens_per_request": distribution([float(r["output_tokens"]) for r in ok]),
        "ttft_s": distribution([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
        "itl_s": distribution(itl),
        "tpot_s": distribution(tpot),
        "latency_s": distribution([r["latency_s"] for r in ok]),
    }


# ---- the load ----------------------------------------------------------------------------------------
def _client(base_url: str, api_key: str, timeout_s: float):
    import openai

    # trust_env=False: no HTTP(S)_PROXY detour; no redirects: the requests stay on this machine
    http = openai.DefaultAsyncHttpxClient(trust_env=False, follow_redirects=False, timeout=timeout_s)
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                              http_client=http)


def _error_text(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}" + (f" {status}" if status else "") + (f": {msg}" if msg else "")


async def _one(client, model: str, prompt: list[int], max_tokens: int, stream: bool, seed: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": False, "error": None, "prompt_tokens": len(prompt), "output_tokens": 0,
                           "ttft_s": None, "latency_s": None, "itl_s": []}
    t0 = time.perf_counter()
    rec["start"] = t0
    try:
        if not stream:
            resp = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0.0, seed=seed)
            t1 = time.perf_counter()
            usage = resp.usage
            rec["output_tokens"] = int(usage.completion_tokens) if usage is not None else 0
            rec["latency_s"] = t1 - t0  # no time to first token without streaming
            rec["finish_reason"] = resp.choices[0].finish_reason if resp.choices else None
            rec["ok"] = True
            return rec
        s = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                            seed=seed, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
        last = None
        counted = 0
        usage_tokens = None
        async for chunk in s:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:
                usage_tokens = int(chunk.usage.completion_tokens)
            for choice in chunk.choices or ():
                ids = getattr(choice, "token_ids", None)
                if ids is None and isinstance(getattr(choice, "model_extra", None), dict):
                    ids = choice.model_extra.get("token_ids")
                n = len(ids) if ids is not None else (1 if choice.text else 0)
                if choice.finish_reason is not None:
                    rec["finish_reason"] = choice.finish_reason
                if n == 0:
                    continue
                if last is None:
                    rec["ttft_s"] = now - t0
                else:
                    rec["itl_s"].extend([(now - last) / n] * n)
                last = now
                counted += n
        t1 = time.perf_counter()
        rec["latency_s"] = t1 - t0
        rec["output_tokens"] = usage_tokens if usage_tokens is not None else counted
        if rec["ttft_s"] is None:  # nothing generated (an empty completion): count the end
            rec["ttft_s"] = rec["latency_s"]
        rec["ok"] = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 -- every failure is a counted error, never a crash
        rec["error"] = _error_text(exc)
        rec["latency_s"] = time.perf_counter() - t0
    return rec


async def run_load(base_url: str, api_key: str, prompts: list[list[int]], *, concurrency: int, max_tokens: int,
                   stream: bool, seed: int, timeout_s: float, warmup_prompts: list[list[int]] = (),
                   log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Send `prompts` to the server at `base_url` (an OpenAI base URL, already checked to be
    loopback), at most `concurrency` at once, within `timeout_s` overall (warm-up included).
    Returns {"model", "records", "duration_s", "timed_out"}."""
    deadline = time.perf_counter() + timeout_s
    client = _client(base_url, api_key, timeout_s)
    try:
        try:
            models = await asyncio.wait_for(client.models.list(), timeout=max(0.1, deadline - time.perf_counter()))
            model = models.data[0].id
        except Exception as exc:  # noqa: BLE001
            raise BenchServeError(f"could not list the models at {base_url}: {_error_text(exc)}") from None
        for i, p in enumerate(warmup_prompts):
            left = deadline - time.perf_counter()
            if left <= 0:
                raise BenchServeError(f"--timeout {timeout_s:g} s ran out during the warm-up")
            try:
                rec = await asyncio.wait_for(_one(client, model, p, max_tokens, stream, seed), timeout=left)
            except asyncio.TimeoutError:
                raise BenchServeError(f"--timeout {timeout_s:g} s ran out during the warm-up") from None
            if not rec["ok"]:
                raise BenchServeError(f"warm-up request {i + 1} failed: {rec['error']}")
        log(f"model {model!r}: sending {len(prompts)} requests, {concurrency} at a time")

        records: list[dict[str, Any] | None] = [None] * len(prompts)
        order = iter(range(len(prompts)))

        async def worker() -> None:
            for i in order:  # one iterator shared by the workers: each index is sent once
                records[i] = await _one(client, model, prompts[i], max_tokens, stream, seed)

        t0 = time.perf_counter()
        timed_out = False
        workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(prompts)))]
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout=max(0.0, deadline - t0))
        except asyncio.TimeoutError:
            timed_out = True
        t1 = time.perf_counter()
        done = [r for r in records if r is not None]
        end = max([r["start"] + r["latency_s"] for r in done], default=t1)
        duration = (min(end, t1) if not timed_out else t1) - t0
        for i, r in enumerate(records):
            if r is None:
                records[i] = {"ok": False, "error": f"unfinished at the --timeout of {timeout_s:g} s",
                              "prompt_tokens": len(prompts[i]), "output_tokens": 0, "ttft_s": None,
                              "latency_s": None, "itl_s": [], "start": None}
        for r in records:
            r["start_s"] = None if r.get("start") is None else r.pop("start") - t0
            r.pop("start", None)
        return {"model": model, "records": records, "duration_s": duration, "timed_out": timed_out}
    finally:
        await client.close()


# ---- the in-process server -------------------------------------------------------------------------
@contextmanager
def in_process_server(args: argparse.Namespace, api_key: str | None,
                      log: Callable[[str], None] = lambda m: None) -> Iterator[tuple[str, int]]:
    """Serve `args.model` with uvicorn on 127.0.0.1 (a free port) from a background thread;
    yields (url, vocab_size) and stops the server on exit."""
    import uvicorn

    from ..server import add_serve_parser, build_app

    parser = argparse.ArgumentParser(prog="kvfold")
    add_serve_parser(parser.add_subparsers(dest="command"))
    argv = ["serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
            "--max-seq-len", str(max(4096, args.prompt_tokens + args.max_tokens)),
            "--max-running", str(args.max_running), "--max-queue", str(max(256, args.concurrency)),
            "--device", args.device, "--dtype", args.dtype, "--weights", args.weights]
    if api_key is not None:
        argv += ["--api-key", api_key]
    if getattr(args, "speculative", None) is not None:
        argv += ["--speculative", args.speculative, "--num-draft", str(args.num_draft)]
        argv += ["--fixed-draft"] if args.fixed_draft else []
    serve_args = parser.parse_args(argv)
    t = time.perf_counter()
    app = build_app(serve_args)
    vocab = app.state.engine.engine.vocab_size
    log(f"loaded {args.model!r} in {time.perf_counter() - t:.1f} s (vocabulary {vocab})")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="kvfold-bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise BenchServeError("the in-process server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", vocab
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _vocab_of(model: str) -> int:
    """The vocabulary size of a built-in model or a checkpoint directory's config.json (no weights loaded)."""
    from ..models.registry import checkpoint_dir
    directory = checkpoint_dir(model)
    if directory is None:
        from ..models.deepseek_v4.tiny import tiny_config
        return int(tiny_config().vocab_size)
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchServeError(f"cannot read the vocabulary size from {path} ({exc}); pass --vocab-size") from None
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return int(c["vocab_size"])
    raise BenchServeError(f"{path} has no vocab_size; pass --vocab-size")


# ---- report ------------------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    st, sm = result["settings"], result["summary"]
    lines = [f"kvfold bench serve: {st['requests']} requests, concurrency {st['concurrency']}, "
             f"prompt {st['prompt_tokens']} tok, max_tokens {st['max_tokens']}, "
             f"{'streamed' if st['stream'] else 'not streamed'}, temperature 0, seed {st['seed']}",
             f"server: {result['server']}; model {result.get('model')!r}",
             f"machine: {result['machine']}",
             "",
             f"succeeded / errors      {sm['succeeded']} / {sm['errors']}"
             + ("  (hit --timeout)" if result.get("timed_out") else ""),
             f"duration                {sm['duration_s']:.2f} s",
             f"requests/s              {sm['requests_per_s']:.2f}",
             f"output tokens/s         {sm['output_tokens_per_s']:.1f}  ({sm['output_tokens']} tokens"
             + (f", {sm['output_tokens_per_request']['mean']:.1f} per request)" if sm['output_tokens_per_request']
                else ")"),
             f"prompt tokens/s         {sm['prompt_tokens_per_s']:.1f}",
             ""]
    head = f"{'latency (ms)':<22}|{'mean':>9} |{'p50':>9} |{'p90':>9} |{'p99':>9} |{'max':>9} |{'n':>7}"
    lines += [head, "-" * 22 + ("+" + "-" * 10) * 5 + "+" + "-" * 7]
    for key, label in (("ttft_s", "time to first token"), ("itl_s", "inter-token"),
                       ("tpot_s", "time per output token"), ("latency_s", "end-to-end")):
        d = sm[key]
        if d is None:
            lines.append(f"{label:<22}|" + "|".join(f"{'-':>9} " for _ in range(5)) + f"|{0:>7}")
        else:
            lines.append(f"{label:<22}|" + "|".join(f"{d[k] * 1e3:>9.1f} " for k in ("mean", "p50", "p90", "p99", "max"))
                         + f"|{d['count']:>7}")
    if not st["stream"]:
        lines.append("(not streamed: only the end-to-end latency is measured; use --stream for the others)")
    if sm["error_kinds"]:
        lines.append("errors: " + "; ".join(f"{n} x {e}" for e, n in sm["error_kinds"].items()))
    return "\n".join(lines)


def _machine() -> str:
    import platform
    s = f"{os.cpu_count()} CPUs, python {platform.python_version()}"
    if hasattr(os, "getloadavg"):
        s += ", load avg at start " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return s


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def run_bench_serve(args: argparse.Namespace, log: Callable[[str], None] | None = _log) -> int:
    """Run `kvfold bench serve`; print the table; write the JSON. Returns 0, or 1 when any request
    failed. Raises BenchServeError (a KvfoldError: exit status 2 from the CLI) for a refused URL or
    limit, or a server that cannot be reached, and MissingPackageError (also a KvfoldError) before
    anything runs when the openai package (the `bench` extra) is not installed."""
    log = log or (lambda m: None)
    require("openai", "kvfold bench serve")
    check_limits(args)
    api_key = args.api_key if args.api_key is not None else (os.environ.get("KVFOLD_API_KEY") or None)
    started = _dt.datetime.now(_dt.timezone.utc)
    machine = _machine()
    if args.url is None:  # the in-process server's kernels, as kvfold serve sets them
        import torch
        from ..server import serving_threads
        torch.set_num_threads(serving_threads(args.threads))

    def go(base_url: str, vocab: int) -> dict[str, Any]:
        prompts = make_prompts(args.requests + args.warmup, args.prompt_tokens, vocab, args.seed)
        return asyncio.run(run_load(base_url, api_key or "none", prompts[args.warmup:], concurrency=args.concurrency,
                                    max_tokens=args.max_tokens, stream=args.stream, seed=args.seed,
                                    timeout_s=args.timeout, warmup_prompts=prompts[:args.warmup], log=log))

    if args.url is not None:
        base = check_loopback_url(args.url)
        vocab = args.vocab_size or _vocab_of(args.model)
        server_desc = f"{args.url} (external, loopback)"
        run = go(base, vocab)
    else:
        with in_process_server(args, api_key, log=log) as (url, model_vocab):
            vocab = args.vocab_size or model_vocab
            server_desc = (f"in-process kvfold serve --model {args.model} on {url} (max-running {args.max_running}, "
                           f"{args.device}, {args.dtype}, {args.weights} weights, {torch.get_num_threads()} kernel "
                           f"threads, speculative {getattr(args, 'speculative', None) or 'off'}; client and server "
                           "share one process)")
            run = go(check_loopback_url(url), vocab)

    return _write_result(args, run, started=started, machine=machine, server_desc=server_desc, vocab=vocab)


def _write_result(args: argparse.Namespace, run: dict[str, Any], *, started: _dt.datetime, machine: str,
                  server_desc: str, vocab: int) -> int:
    """Print the table of a finished run and write its JSON (atomically); the exit status."""
    records = run["records"]
    result: dict[str, Any] = {
        "command": getattr(args, "command_line", None) or " ".join(["kvfold"] + sys.argv[1:]),
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "server": server_desc,
        "model": run["model"],
        "settings": {"requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "stream": bool(args.stream), "seed": args.seed,
                     "temperature": 0.0, "vocab_size": vocab, "warmup": args.warmup, "timeout_s": args.timeout,
                     "url": args.url},
        "timed_out": run["timed_out"],
        "summary": summarize(records, run["duration_s"]),
        "requests": [{k: v for k, v in r.items() if k != "itl_s"} for r in records],
    }
    table = format_table(result)
    result["report"] = table
    print(table, flush=True)
    out = Path(args.out) if args.out else Path("kvfold-bench-serve.json")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out)
    print(f"results written to {out}", flush=True)
    return 0 if result["summary"]["errors"] == 0 else 1

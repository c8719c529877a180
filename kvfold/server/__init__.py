"""`kvfold serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `kvfold.Engine`.

This module only defines the command line; fastapi and uvicorn are imported when the server
starts, so other commands never pay for them. The app itself is `kvfold.server.app.create_app`.
"""
from __future__ import annotations

import argparse
import contextlib
import os

_DTYPES = ("float32", "bfloat16", "float16")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        v = int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` command to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="tiny", help='checkpoint directory, "tiny" (default) or "tiny-random"')
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVFOLD_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help='model id clients send (default: the built-in name or the checkpoint directory name)')
    p.add_argument("--no-web-page", dest="web_page", action="store_false",
                   help="do not serve the chat page at / (default: served; it asks for --api-key when one is set)")
    p.add_argument("--max-seq-len", type=_int_at_least(1), default=4096,
                   help="prompt + max_tokens limit per request (default 4096)")
    p.add_argument("--max-running", type=_int_at_least(1), default=16,
                   help="sequences decoding at once (default 16)")
    p.add_argument("--max-queue", type=_int_at_least(0), default=256,
                   help="requests waiting beyond those; more get 503 (default 256)")
    p.add_argument("--max-batch-tokens", type=_int_at_least(1), default=512, help="tokens per step (default 512)")
    p.add_argument("--max-state-bytes", type=_int_at_least(1), default=None,
                   help="bound on the bytes of all live states; requests wait beyond it (default: none)")
    p.add_argument("--prefix-cache-bytes", type=_int_at_least(0), default=256 << 20,
                   help="prefix-cache budget in bytes (snapshots plus pages only the cache holds), "
                        "0 disables (default 256 MiB)")
    p.add_argument("--cache-dir", default=None,
                   help="keep prefix-cache entries on disk under DIR: evicted ones, and all of them at a clean "
                        "shutdown; a restarted server finds them again (docs/serving.md)")
    p.add_argument("--cache-disk-gib", type=float, default=8.0,
                   help="byte budget of --cache-dir in GiB, least recently used entries go first (default 8)")
    p.add_argument("--responses-store-mib", type=float, default=512.0,
                   help="memory for stored /v1/responses (their items and the state snapshots previous_response_id "
                        "resumes from), least recently used out; 0 stores none (default 512)")
    p.add_argument("--conversation-tokens", type=_int_at_least(0), default=1 << 22,
                   help="tokens of finished conversations kept, so that a client re-sending one (every coding "
                        "agent does) continues its exact state from the prefix cache; 0 keeps none (default 4Mi)")
    p.add_argument("--kv-page-bytes", type=_int_at_least(0), default=None,
                   help="bytes of the shared compressed-KV page pool, 0 for private per-sequence pools "
                        "(default: room for max-running sequences of max-seq-len)")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false", default=None,
                   help="torch's kernels: a request's last logit bits (and, at near-ties, its tokens) may then "
                        "depend on what else is running (default: batch-invariant wherever the model supports "
                        "it, fp32 on the CPU; see docs/backends.md)")
    p.add_argument("--batch-invariant", dest="batch_invariant", action="store_true",
                   help="batch-invariant mode where it is not the default: on CUDA (fp32, bf16) the token-parallel "
                        "ops run in kvfold's fixed-order Triton kernels, expected slower than torch's "
                        "(see docs/backends.md)")
    p.add_argument("--speculative", choices=("mtp", "ngram"), default=None,
                   help="speculative decoding: every sequence drafts with n-gram prompt lookup or the checkpoint's "
                        "MTP layer and verifies in the batched step (default: none)")
    p.add_argument("--num-draft", type=_int_at_least(1), default=4,
                   help="most draft tokens per sequence and step with --speculative (default 4); each step "
                        "drafts what measured acceptance and step costs say pays (draft_length.py)")
    p.add_argument("--fixed-draft", action="store_true", help="always draft --num-draft tokens")
    p.add_argument("--decode-graphs", action="store_true",
                   help="run each step's decode rows as one captured CUDA graph per bucket (DeepSeek-V4, "
                        "GLM-5.3; for --device cuda: on the CPU the same step runs eagerly, slower than the "
                        "default); batch invariance off unless --batch-invariant, which only DeepSeek-V4 with "
                        "KVFOLD_TRITON=1 keeps")
    p.add_argument("--tp", type=_int_at_least(1), default=1,
                   help="shard the model over N ranks (DeepSeek-V4): torchrun --nproc-per-node N -m kvfold serve "
                        "... --tp N; rank 0 serves HTTP and schedules, the others follow")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=_DTYPES, default="float32", help="weight dtype (default float32)")
    p.add_argument("--weights", choices=("dequant", "quantized"), default="dequant",
                   help="dequant: decode FP8/FP4 weights at load; quantized: keep them as stored, read by the "
                        "native kernels (default dequant)")
    p.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="threads of the model's kernels (default: torch's count, at most one fewer than the "
                        "CPUs, so the HTTP front end keeps a core)")
    from ..load_placed import add_placement_arguments
    add_placement_arguments(p, "test mode: every device is the CPU and each side is checked (the engine's "
                               "thread enters the check too); for checking a placement on a machine without "
                               "the card")
    return p


def serving_threads(requested: int | None = None) -> int:
    """The kernels' thread count in a serving process: `requested`, else torch's count but at
    most one fewer than the CPUs this process may run on (at least 1). The HTTP front end
    (uvicorn, detokenisation, SSE framing) needs a core of its own: OpenMP's workers spin between
    kernel calls, so a pool as wide as the machine keeps that core busy and every streamed token
    then waits for the scheduler (bench/RESULTS.md has the measurements). Calling it again gives
    the same count. The count changes no bits: the kernels split output columns, never a
    reduction."""
    import torch
    if requested is not None:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cpus - 1))


def build_engine(args: argparse.Namespace):
    """The engine `kvfold serve` runs: on every rank under --tp (a torchrun launch)."""
    import torch

    import kvfold
    from ..engine import Engine
    from ..errors import KvfoldError
    tp = getattr(args, "tp", 1)
    placing = _placement_options(args)
    if tp > 1 and not placing:  # (a placement with --tp is refused at the load, before any work)
        from ..parallel.group import join_group
        join_group(tp, args.device)
    virtual = placing.get("virtual_devices")
    with virtual if virtual is not None else contextlib.nullcontext():
        model = kvfold.load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                                  weights=getattr(args, "weights", "dequant"), **({"tp": tp} if tp > 1 else {}),
                                  **placing)
    try:
        return Engine(model, max_seq_len=args.max_seq_len, max_running=args.max_running,
                      max_queue=args.max_queue, max_batch_tokens=args.max_batch_tokens,
                      max_state_bytes=args.max_state_bytes, prefix_cache_bytes=args.prefix_cache_bytes,
                      kv_page_bytes=args.kv_page_bytes, batch_invariant=args.batch_invariant,
                      speculative=args.speculative, num_draft=args.num_draft, adaptive_draft=not getattr(args, "fixed_draft", False),
                      decode_graphs=getattr(args, "decode_graphs", False), cache_dir=getattr(args, "cache_dir", None),
                      cache_disk_bytes=int(getattr(args, "cache_disk_gib", 0) * (1 << 30)),
                      conversations=getattr(args, "conversation_tokens", 0))
    except ValueError as exc:  # inconsistent limits: a usage error, reported like kvfold's own
        raise KvfoldError(f"serve: {exc}") from None


def _placement_options(args: argparse.Namespace) -> dict:
    """load_model's placement keywords from serve's flags ({} without them): the budgets hold
    --max-running sequences of --max-seq-len tokens."""
    from ..load_placed import placement_options
    virtual = None
    if getattr(args, "virtual_devices", False):  # entered for the load here, and by the engine's thread
        from ..layers.virtual_devices import VirtualDevices
        virtual = VirtualDevices()
    return placement_options(args, virtual=virtual, max_seq_len=args.max_seq_len, sequences=args.max_running)


def build_app(args: argparse.Namespace):
    """Load the model and build the app `kvfold serve` runs (separate from run_serve for tests)."""
    from .app import create_app
    from ..models.registry import checkpoint_dir, family_of
    from ..chat.template import ChatTemplate

    engine = build_engine(args)
    model = engine.model
    model_dir = checkpoint_dir(args.model)
    name = served_model_name(args)
    family = family_of(model_dir).name if model_dir is not None else None
    template = ChatTemplate.for_model(model.tokenizer, model_dir, family) if model.tokenizer is not None else None
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVFOLD_API_KEY") or None
    return create_app(engine, model_name=name, api_key=api_key, chat_template=template,
                      web_page=getattr(args, "web_page", True),
                      responses_store_bytes=int(getattr(args, "responses_store_mib", 512.0) * (1 << 20)))


def served_model_name(args: argparse.Namespace) -> str:
    """The model id clients send: --served-model-name, else the built-in name or the directory's name."""
    from ..models.registry import BUILT_IN
    return args.served_model_name or (args.model if args.model in BUILT_IN
                                      else os.path.basename(os.path.normpath(args.model)))


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def base_url(host: str, port: int) -> str:
    """http://HOST:PORT (an IPv6 address in brackets, as URLs write it)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def startup_banner(args: argparse.Namespace, engine) -> str:
    """What `kvfold serve` prints to stderr once before uvicorn starts: the model, where it runs,
    the memory its weights and state reservation take, the prefix cache, and the URLs."""
    from ..models.registry import checkpoint_dir, family_of
    model = engine.model
    model_dir = checkpoint_dir(args.model)
    family = family_of(model_dir).name if model_dir is not None else "deepseek_v4"  # tiny-random is one
    kept = len(model.quantized_weights())
    weights = f"{args.weights}{f' ({kept} tensors kept FP8/FP4/bf16)' if kept else ''}"
    threads = serving_threads(args.threads)
    url = base_url(args.host, args.port)
    port_note = " (port 0: the system picks one; uvicorn logs it)" if args.port == 0 else ""
    page = f"{url}/" if getattr(args, "web_page", True) else "off"
    lines = [f"kvfold serve: {args.model} as {served_model_name(args)!r} ({family})",
             f"  weights:      {weights}, {_mib(model.weight_bytes())} in memory",
             f"  device:       {model.device}, {str(model.dtype).removeprefix('torch.')}, {threads} "
             f"thread{'s' if threads != 1 else ''}, batch-invariant {'on' if engine.batch_invariant else 'off'}"
             # under --tp the weights and state above are this rank's share
             f"{f', rank 0 of {args.tp} (memory: its share)' if getattr(args, 'tp', 1) > 1 else ''}",
             *_placement_lines(model),
             f"  state:        {_state_summary(args, engine)}",
             f"  prefix cache: {_prefix_cache_summary(args, engine)}",
             f"  page:         {page}{port_note}",
             f"  API:          {url}/v1{port_note}"]
    return "\n".join(lines) + "\n"


def _placement_lines(model) -> list[str]:
    """The banner's line for a model split across the accelerator and the host (none otherwise)."""
    if getattr(model, "devices", None) is None:
        return []
    from ..load_placed import describe
    return [f"  placement:    {describe(model).removeprefix('placement: ')}"]


def _state_summary(args: argparse.Namespace, engine) -> str:
    """The state memory reserved at start (the shared page pool) and what one sequence takes."""
    per_seq = f"a {args.max_seq_len}-token sequence takes up to {_mib(engine.state_bytes(args.max_seq_len))}"
    bound = f", all states at most {_mib(args.max_state_bytes)}" if args.max_state_bytes else ""
    pool = engine.pages
    if pool is None:
        return f"private per-sequence pools, allocated per request; {per_seq}, {args.max_running} at once{bound}"
    return (f"{_mib(pool.nbytes)} page pool reserved now ({pool.num_pages} pages of {engine.model.page_tokens} "
            f"tokens); {per_seq}, {args.max_running} at once{bound}")


def _prefix_cache_summary(args: argparse.Namespace, engine) -> str:
    cache = engine.prefix_cache
    if cache is None:
        return "off (--prefix-cache-bytes 0)"
    disk = getattr(args, "cache_dir", None)
    disk_note = f", on disk under {disk} up to {getattr(args, 'cache_disk_gib', 0):g} GiB" if disk else ""
    return f"{_mib(cache.max_bytes)} in memory, blocks of {cache.block} tokens{disk_note}"


def run_serve(args: argparse.Namespace) -> int:
    """`kvfold serve`: run until interrupted. Returns the exit status."""
    import torch
    import uvicorn

    torch.set_num_threads(serving_threads(args.threads))
    if getattr(args, "tp", 1) > 1:
        import torch.distributed as dist
        from ..parallel.group import join_group
        join_group(args.tp, args.device)
        if dist.get_rank() != 0:  # a follower: no HTTP, the same engine steps as rank 0's
            build_engine(args).follow()
            return 0  # the group is left by kvfold.cli.main, as on rank 0
    app = build_app(args)
    if not getattr(args, "quiet", False):
        import sys
        print(startup_banner(args, app.state.server.engine), end="", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0

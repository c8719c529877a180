"""Command line: `kvfold generate ...` streams text; `kvfold inspect ...` shows a model's layout;
`kvfold eval-ppl ...` measures perplexity on a text file; `kvfold doctor` checks the machine."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from typing import Any, Sequence

import torch

from .argtypes import nonneg_float as _nonneg_float, nonneg_int as _nonneg_int, pos_int as _pos_int, top_p as _top_p
from .errors import KvfoldError
from .progress import is_quiet, quieted
from .decoding.generate import generate, generation_capacity
from .models.registry import checkpoint_dir

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIB = 1024 * 1024
_MODEL_HELP = ('checkpoint directory, "tiny" (default: a small DeepSeek-V4 trained on Python\'s documentation) '
               'or "tiny-random" (random weights, byte-level tokenizer)')


def _load_model(path: str, device: str, dtype: torch.dtype, numerics: str = "hf", weights: str = "dequant") -> Any:
    # Imported lazily so this module loads (and tests can patch this function) on its own.
    import kvfold

    extra = {k: v for k, v in (("numerics", numerics), ("weights", weights))
             if v != {"numerics": "hf", "weights": "dequant"}[k]}
    return kvfold.load_model(path, device=device, dtype=dtype, **extra)


def _load_for(args: argparse.Namespace, seq_len: int | None = None) -> Any:
    """The model a command runs; with placement flags (generate, serve: kvfold/load_placed.py)
    split across the accelerator and the host, its state sized for `seq_len` tokens."""
    tp = getattr(args, "tp", 1)
    placing = _placement_options(args, seq_len)
    if placing:  # (--tp > 1 with a placement is refused before the load, so no group is joined)
        return _load_placed_for(args, placing)
    if tp > 1:  # this process is one rank of a torchrun launch
        import kvfold
        from .parallel.group import join_group
        join_group(tp, args.device)
        return kvfold.load_model(args.model, device=args.device, dtype=_DTYPES[args.dtype], numerics=args.numerics,
                                 weights=args.weights, tp=tp)
    if args.numerics == "hf" and args.weights == "dequant":  # (tests patch a 3-argument _load_model)
        return _load_model(args.model, args.device, _DTYPES[args.dtype])
    return _load_model(args.model, args.device, _DTYPES[args.dtype], args.numerics, args.weights)


def _placement_options(args: argparse.Namespace, seq_len: int | None) -> dict:
    from .load_placed import placement_options
    return placement_options(args, virtual=getattr(args, "virtual", None), max_seq_len=seq_len,
                             kv_dtype=getattr(args, "kv_dtype", None))


def _load_placed_for(args: argparse.Namespace, placing: dict) -> Any:
    import kvfold
    from .load_placed import describe
    tp = getattr(args, "tp", 1)
    model = kvfold.load_model(args.model, device=args.device, dtype=_DTYPES[args.dtype], numerics=args.numerics,
                              weights=args.weights, **({"tp": tp} if tp > 1 else {}), **placing)
    if not is_quiet():
        print(f"[kvfold] {describe(model)}", file=sys.stderr)
    return model


def _virtual_devices(args: argparse.Namespace):
    """--virtual-devices: the test mode (kvfold/layers/virtual_devices.py), entered for the whole
    command: a TorchFunctionMode sees only the ops run while it is entered, on this thread."""
    args.virtual = None
    if not getattr(args, "virtual_devices", False):
        return contextlib.nullcontext()
    from .layers.virtual_devices import VirtualDevices
    args.virtual = VirtualDevices()
    return args.virtual


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weight dtype (default float32)")
    p.add_argument("--numerics", choices=("hf", "reference"), default="hf",
                   help="hf: transformers' math; reference: the official code's order and FP8/FP4 roundings "
                        "(with --dtype bfloat16)")
    p.add_argument("--weights", choices=("dequant", "quantized"), default="dequant",
                   help="dequant: decode FP8/FP4 weights at load; quantized: keep them, decode per matmul")
    p.add_argument("--kv-dtype", choices=("fp8",), default=None,
                   help="store window rows and compressed entries in FP8 (non-rope dims)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfold", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming to stdout")
    g.add_argument("--model", default="tiny", help=_MODEL_HELP)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=_nonneg_int, required=True)
    g.add_argument("--temperature", type=_nonneg_float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=_top_p, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--speculative", choices=("mtp", "ngram"), default=None,
                   help="draft tokens with the model's MTP head or by prompt lookup, verify them in one forward")
    g.add_argument("--num-draft", type=_pos_int, default=4,
                   help="most draft tokens per verify step (default 4); each step drafts what measurement says pays")
    g.add_argument("--fixed-draft", action="store_true", help="always draft --num-draft tokens")
    g.add_argument("--save-session", metavar="FILE", default=None,
                   help="write the state and token history to FILE when done (atomically)")
    g.add_argument("--load-session", metavar="FILE", default=None,
                   help="continue the conversation saved in FILE; --prompt is appended to it")
    g.add_argument("--tp", type=_pos_int, default=1,
                   help="shard the model over N ranks (DeepSeek-V4): run as torchrun --nproc-per-node N -m kvfold "
                        "generate ... --tp N; rank 0 prints")
    _add_model_args(g)
    from .load_placed import add_placement_arguments
    add_placement_arguments(g, "test mode: run the placement with every device on the CPU, each op checked to run "
                               "on its own side (layers/virtual_devices.py); needs --gpu-memory-gib")

    i = sub.add_parser("inspect", help="print the layer schedule, state sizes and kernels of a model")
    i.add_argument("model", help=_MODEL_HELP)
    _add_model_args(i)

    e = sub.add_parser("eval-ppl", help="perplexity of a model on a text file")
    e.add_argument("--model", default="tiny", help=_MODEL_HELP)
    e.add_argument("--text", required=True, help="UTF-8 text file to score")
    e.add_argument("--context", type=_pos_int, default=512, help="tokens per window, each behind BOS (default 512)")
    e.add_argument("--max-tokens", type=_pos_int, default=None, help="score only the text's first N tokens")
    _add_model_args(e)

    from .server import add_serve_parser
    add_serve_parser(sub)
    from .plan_placement import add_plan_command
    add_plan_command(sub)
    from .calibrate_experts import add_calibrate_command
    add_calibrate_command(sub)
    from .bench import add_bench_parser
    add_bench_parser(sub)
    from .doctor import add_doctor_parser
    add_doctor_parser(sub)

    c = sub.add_parser("convert", help="rewrite a checkpoint in the transformers (hf) or official layout")
    c.add_argument("src", help="checkpoint directory to read")
    c.add_argument("dst", help="directory to write (new or empty)")
    c.add_argument("--to", choices=("hf", "official"), required=True, help="layout to write")
    q = c.add_mutually_exclusive_group()
    q.add_argument("--quantize", dest="quantize", action="store_const", const=True, default=None,
                   help="store the release's FP8/FP4 weights quantized (the default for --to official; "
                        "--to hf keeps the source's formats by default)")
    q.add_argument("--dequantize", dest="quantize", action="store_const", const=False,
                   help="store every weight dequantized, in --dtype")
    c.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                   help="dtype of dequantized weights (default bfloat16); other tensors keep their stored dtype")
    c.add_argument("--floats", choices=sorted(_DTYPES), default=None,
                   help="write the unquantized float *.weight tensors (embedding, lm_head, norms, compressors, "
                        "router) in this dtype, as the release stores them in bfloat16 (default: as stored)")
    c.add_argument("--shard-size-gib", type=float, default=4.0, help="maximum shard size (default 4 GiB)")
    _add_quiet_args(sub)
    return parser


_QUIET_COMMANDS = ("generate", "inspect", "eval-ppl", "serve", "convert", "bench")


def _add_quiet_args(sub: Any) -> None:
    """`--quiet` on every command that loads or writes a checkpoint (and on `bench`'s `serve` mode,
    so that it may follow either word)."""
    help_text = "no progress lines on stderr (and no start-up banner for serve)"
    for name in _QUIET_COMMANDS:
        parser = sub.choices[name]
        parser.add_argument("--quiet", action="store_true", help=help_text)
        for action in parser._actions:  # argparse lists a parser's sub-parsers only there
            if isinstance(action, argparse._SubParsersAction):
                for mode in action.choices.values():
                    # SUPPRESS: unset here, the mode does not overwrite `bench --quiet serve`
                    mode.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=help_text)


def _cmd_generate(args: argparse.Namespace) -> int:
    from . import session as sess

    loaded = None
    if args.load_session:  # a damaged file is refused before the (possibly large) model loads
        loaded = sess.read_session(args.load_session)
    model = _load_for(args, _generation_tokens(args, loaded))
    state = None
    try:
        if loaded is not None:
            ids, state, history = _resume_session(args, model, loaded)
        else:
            ids, state, history = _fresh_prompt(args, model)
        decoder = model.tokenizer.stream_decoder()
        tp = getattr(model, "tp", None)
        lead = tp is None or tp.rank == 0  # under --tp every rank runs the loop; rank 0 writes
        out = sys.stdout if lead else io.StringIO()
        result = generate(
            model,
            ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            on_token=_text_streamer(decoder, out),
            speculative=args.speculative,
            num_draft=args.num_draft,
            adaptive_draft=not getattr(args, "fixed_draft", False),
            state=state,
            history=history,
            **({"kv_dtype": args.kv_dtype} if args.kv_dtype and state is None else {}),
        )
        out.write(decoder.flush() + "\n")
        out.write(_generate_summary(args, model, result) + "\n")
        out.flush()
        if args.save_session and lead:  # the state is replicated: rank 0's blob is every rank's
            consumed, pending = sess.split_history(list(history) + ids, result.tokens)
            sess.save_session(args.save_session, state, consumed, pending)
            print(f"[kvfold] session saved to {args.save_session} ({len(consumed)} tokens)", file=sys.stderr)
    finally:
        if state is not None:
            state.free()
    return 0


def _generation_tokens(args: argparse.Namespace, loaded: Any) -> int:
    """At most the tokens this run's state holds, known before the tokenizer loads (a placement's
    budgets hold that state): each prompt token covers at least a byte, plus BOS and a session's."""
    fed = len(args.prompt.encode("utf-8")) + 1 + (0 if loaded is None else len(loaded.tokens) + 1)
    return generation_capacity(fed, args.max_new_tokens, args.speculative, args.num_draft)[0]


def _resume_session(args: argparse.Namespace, model: Any, loaded: Any) -> tuple[list[int], Any, list[int]]:
    """(ids to feed, restored state, token history) to continue the conversation of `loaded`: its
    pending token(s) then --prompt, encoded without BOS (the conversation goes on)."""
    from . import session as sess

    sess.check_session_model(loaded, model, source=f"session {args.load_session}")
    ids = loaded.continuation(model.tokenizer.encode(args.prompt))
    if not ids:
        raise sess.SessionCorruptedError(
            f"session {args.load_session} has no pending token and --prompt is empty: nothing to feed")
    cap, max_rewind = generation_capacity(len(ids), args.max_new_tokens, args.speculative, args.num_draft)
    state = sess.restore_session(model, loaded, capacity=loaded.pos + cap, max_rewind=max_rewind)
    return ids, state, loaded.tokens


def _fresh_prompt(args: argparse.Namespace, model: Any) -> tuple[list[int], Any, list[int] | None]:
    """(ids to feed, state, history) for a new conversation: BOS (when the tokenizer has one) and --prompt.
    With --save-session the state is made here, so that it outlives `generate` for the snapshot;
    otherwise (None, None): `generate` makes and frees its own."""
    tok = model.tokenizer
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    if not args.save_session:
        return ids, None, None
    cap, max_rewind = generation_capacity(len(ids), args.max_new_tokens, args.speculative, args.num_draft)
    kw = {"kv_dtype": args.kv_dtype} if args.kv_dtype else {}
    return ids, model.new_state(capacity=cap, max_rewind=max_rewind, **kw), []


def _text_streamer(decoder: Any, out: Any):
    """An `on_token` callback writing each token's text to `out` as soon as it decodes."""
    def on_token(token_id: int) -> None:
        text = decoder.push(token_id)
        if text:
            out.write(text)
            out.flush()
    return on_token


def _generate_summary(args: argparse.Namespace, model: Any, result: Any) -> str:
    """The `[kvfold] prompt ... tok | ...` line printed after the generated text."""
    summary = (f"[kvfold] prompt {result.prompt_tokens} tok | generated {len(result.tokens)} tok"
               f" | prefill {result.prefill_tok_s:.1f} tok/s | decode {result.decode_tok_s:.1f} tok/s"
               f" | state {result.state_bytes / _MIB:.2f} MiB")
    per_token = getattr(model, "state_bytes_per_token", None)
    if per_token is not None:
        summary += f" ({per_token(**({'kv_dtype': args.kv_dtype} if args.kv_dtype else {})):.0f} B/token)"
    if args.speculative is not None:
        summary += f" | accept {100.0 * result.acceptance_rate:.1f}%"
        if result.accepted_per_position:  # as peers report it: by draft position, and tokens a verify step
            summary += (" (by position " + ", ".join(f"{100.0 * r:.0f}%" for r in result.accepted_per_position)
                        + f"; {result.mean_accepted_length:.2f} tokens per verify step)")
    return summary


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def _cmd_inspect(args: argparse.Namespace) -> int:
    model = _load_for(args)
    cfg = model.config
    attn, ratios, mlps = list(cfg.layer_types), list(cfg.compress_ratios), list(cfg.mlp_layer_types)
    out = sys.stdout
    out.write(f"model: {args.model}\n")
    out.write(f"parameters: {model.num_parameters():,}\n")
    if hasattr(model, "weight_bytes"):
        out.write(f"weights in memory: {_fmt_bytes(model.weight_bytes())}"
                  f"{' (FP8/FP4 kept quantized)' if model.quantized_weights() else ''}\n")
    out.write(f"layers: {len(attn)}\n")
    out.write(f"  {'idx':>3}  {'attention':<32} {'ratio':>5}  mlp\n")
    for idx, (a, r, m) in enumerate(zip(attn, ratios, mlps, strict=True)):
        out.write(f"  {idx:>3}  {a:<32} {r if r else '-':>5}  {m}\n")

    # Summary of the schedule: how many layers of each (attention, ratio) kind.
    counts: dict[tuple[str, Any], int] = {}
    for a, r in zip(attn, ratios):
        counts[(a, r)] = counts.get((a, r), 0) + 1
    out.write("ratios: " + ", ".join(f"{a} x{r}: {n}" if r else f"{a}: {n}" for (a, r), n in counts.items()) + "\n")

    per_tok = float(model.state_bytes_per_token())
    fixed = int(model.fixed_state_bytes())
    fp8_note = ""
    if model.capabilities.fp8_kv:
        fp8_note = f"; {model.state_bytes_per_token(kv_dtype='fp8'):.1f} B with --kv-dtype fp8"
    out.write(f"state per token: {per_tok:.1f} B (caches that grow with the sequence{fp8_note})\n")
    out.write(f"fixed state per sequence: {_fmt_bytes(fixed)} (buffers that do not grow with length)\n")
    for n in (4096, 131072, 1048576):
        out.write(f"state at {n} tokens: {_fmt_bytes(fixed + per_tok * n)}\n")
    _write_kernels(out, model)
    directory = checkpoint_dir(args.model)
    if directory is not None:
        from .models.deepseek_v4.checkpoint import checkpoint_dtype_breakdown

        out.write("checkpoint tensors by stored dtype:\n")
        for name, (count, nbytes) in checkpoint_dtype_breakdown(directory).items():
            out.write(f"  {name:<8} {count:>7} tensors  {_fmt_bytes(nbytes):>12}\n")
    return 0


def _write_kernels(out, model) -> None:
    """Each op's implementation in the model's own mode, and why (numerics/backend.py)."""
    ops = model.backend()
    out.write(f"kernels ({model.device.type}, {str(model.dtype).removeprefix('torch.')}, numerics {model.numerics}, "
              f"batch-invariant {'on' if ops.batch_invariant else 'off'}):\n")
    for op, impl, why in ops.describe():
        out.write(f"  {op:<17} {impl:<61} {why}\n")


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from .decoding.perplexity import score_text, unigram_perplexity
    from .errors import InvalidInputError

    try:
        text = open(args.text, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read --text {args.text}: {exc}") from None
    model = _load_for(args)
    ids = model.tokenizer.encode(text)[: args.max_tokens]
    scores = score_text(model, ids, context=args.context, kv_dtype=args.kv_dtype)
    print(f"perplexity {scores.perplexity:.4f} over {scores.tokens} tokens of {args.text} "
          f"(windows of {args.context}; the text's own unigram perplexity: {unigram_perplexity(ids):.2f})")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .models.deepseek_v4.convert import convert

    out = convert(args.src, args.dst, args.to, quantize=args.quantize, dtype=_DTYPES[args.dtype],
                  floats=_DTYPES[args.floats] if args.floats else None, max_shard_bytes=int(args.shard_size_gib * (1 << 30)))
    print(f"[kvfold] wrote {out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    # Generated text may contain characters the terminal encoding lacks; never crash on them.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    clean = False
    try:
        with quieted(getattr(args, "quiet", False)):
            rc = _dispatch(args)
        clean = True
        return rc
    except KvfoldError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    finally:
        if getattr(args, "tp", 1) > 1:  # a torchrun rank: leave its group before the process exits
            from .parallel.group import leave_group
            leave_group(clean)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        with _virtual_devices(args):
            return _cmd_generate(args)
    if args.command == "convert":
        return _cmd_convert(args)
    if args.command == "eval-ppl":
        return _cmd_eval_ppl(args)
    if args.command == "bench":
        from .bench import run_bench
        return run_bench(args)
    if args.command == "calibrate-experts":
        from .calibrate_experts import run_calibrate_command
        return run_calibrate_command(args)
    if args.command == "plan":
        from .plan_placement import run_plan_command
        return run_plan_command(args)
    if args.command == "serve":
        from .server import run_serve
        return run_serve(args)
    if args.command == "doctor":
        from .doctor import run_doctor
        return run_doctor(args)
    return _cmd_inspect(args)


if __name__ == "__main__":
    raise SystemExit(main())

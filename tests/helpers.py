from contextlib import contextmanager

import torch

from kvfold.numerics.backend import Backend, KernelSet, build_backend


def random_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def chunked_reference(model, ids: list[int], max_new: int, chunk: int = 128, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None, stop_ids=None) -> list[int]:
    """What the serving engine must produce for one request run alone, written with the plain
    model API: the prompt fed in chunks ending at multiples of `chunk` (the engine's split, which
    makes prefix-cache hits exact), then one token per forward, sampled like `kvfold.generate`.
    For prompts up to `chunk` tokens this is exactly `kvfold.generate`."""
    from kvfold.decoding.sampling import sample_next
    stops = set(model.config.eos_ids if stop_ids is None else stop_ids)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    state = model.new_state(capacity=len(ids) + max_new)
    try:
        for a in range(0, len(ids), chunk):
            logits = model.forward(ids[a:a + chunk], state, last_only=True)
        out: list[int] = []
        while True:
            tok = sample_next(logits[-1], temperature, top_p, gen)
            out.append(tok)
            if tok in stops or len(out) >= max_new:
                return out
            logits = model.forward([tok], state)
    finally:
        state.free()


@contextmanager
def serving(app):
    """Run an ASGI app on 127.0.0.1 (a free port the OS picks) in a background thread; yield its URL."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def fp32_paths_bound(logits: torch.Tensor, n_layers: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two fp32 evaluations of the same logits (say full prefill and token-by-token decode)
    may differ by rounding alone: each is within c * L * eps * max|logit| of the exact logits, so
    they are within twice that of each other. To first order each of the L blocks adds one local
    rounding term, carried and amplified by the blocks after it: linear in L and proportional to
    the logits' scale. c = 8 comes from float64 measurements on GLM-5.3 (median 1.6, max 7.1 over
    96 sequences, flat in L from 2 to 20; tests/test_glm5_next.py); the DeepSeek-V4 tiny model's
    paths differ by at most 1.4 (native kernels) and 2.3 (torch only) units of L * eps * max|logit|
    over 60 sequences, within the 16 this allows. `dtype`: paths that round every op's output to
    a narrower dtype (bf16) instead; the same first-order argument with that dtype's eps.
    `n_layers` may be an effective count: `KdaReadoutGains` adds what ill-conditioned KDA
    readouts amplify."""
    return 2 * 8 * n_layers * torch.finfo(dtype).eps * logits.abs().max().item()


class KdaReadoutGains:
    """How much each KDA layer of a GLM-5.3 model amplifies rounding, per token, read off the numbers
    of a (float64) forward. The readout o = S^T q is a dot product of length dk; its rounding and
    the error its inputs carry (the state S is within a few eps of its largest entry: the
    recurrence mixes its entries step after step; q within a few eps relatively) move o_j by at
    most a few eps * max|S| * ||q||_1. The gated norm after it (kda.py: o / sqrt(mean(o^2) + e),
    e = rms_norm_eps) turns that into a few eps times the gain of its O(1) output,
    gain = max|S| * ||q||_1 / sqrt(mean(o^2) + e), the largest over the heads. A head whose output
    is of the size of its inputs has gain ~1; one whose output cancels (|o| << |S||q|) up to
    ||q||_1 max|S| / sqrt(e) (hundreds at e = 1e-5): there one fp32 rounding of the readout moves
    the logits by hundreds of eps, whichever kernel computes it. `rows()`: per row of the
    forward(s) since the last call, L plus the sum of that row's gains over the KDA layers, the
    effective block count of `fp32_paths_bound` (the other blocks stay one each).
    A float64 Glm5Model runs the KDA recurrence in fp32 (its state is fp32, kda.py), so the
    reference itself is one fp32 evaluation of the readout: a path and the reference are two."""

    def __init__(self, model):
        from kvfold.models.glm5.kda import KdaAttention
        self.model, self.calls = model, []
        self.kda_layers = [m for m in model.modules() if isinstance(m, KdaAttention)]
        for m in self.kda_layers:
            m.register_forward_hook(self._record)

    def _record(self, attn, args, out) -> None:
        from kvfold.models.glm5.kda import kda_recurrent
        x, _, s0, ops = args
        q, k, v, g, beta = (t.double() for t in attn.recurrence_inputs(x, out[1].full, ops))
        o, _, states = kda_recurrent(q, k, v, g, beta, s0.double(), keep_states=True)
        scale = torch.stack(states).abs().amax((-2, -1)) * q.abs().sum(-1)  # [T, H]
        self.calls.append((scale / (o.pow(2).mean(-1) + attn.o_norm.eps).sqrt()).amax(-1))  # [T]

    def rows(self) -> torch.Tensor:
        """[rows]: the effective block count of each row since the last call (the forward runs
        the KDA layers in order, each over the batch's sequences in order), then forget them."""
        gains = torch.cat(self.calls).view(len(self.kda_layers), -1).sum(0)
        self.calls = []
        return self.model.config.num_hidden_layers + gains


def rows_within_paths_bound(got: torch.Tensor, exact: torch.Tensor, blocks: torch.Tensor) -> float:
    """The worst row's |got - exact| as a fraction of its `fp32_paths_bound` with `blocks[r]`
    effective blocks (KdaReadoutGains.rows): at most 1 when every row is within its bound."""
    err = (got.double() - exact.double()).abs().amax(-1)
    return max((e / fp32_paths_bound(x, b)).item() for e, x, b in zip(err, exact, blocks))


def flat_rows(rows: dict):
    """Attention.project's rows (tensors and pairs of tensors by name; "positions" aside) as one
    flat tensor, in name order: two such dicts compare with one torch.equal."""
    import torch
    return torch.cat([t.flatten() for k in sorted(rows) if k != "positions"
                      for t in (rows[k] if isinstance(rows[k], tuple) else (rows[k],))])


def wait_engine_idle(engine, timeout: float = 30.0) -> None:
    """Until nothing is live, running or queued in `engine` (a cancelled or refused request's
    state goes between steps); fails after `timeout` seconds with the metrics."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        m = engine.metrics()
        if m["live_states"] == 0 and m["running"] == 0 and m["queue_depth"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def ops_for(device: str = "cpu", dtype: torch.dtype = torch.float32, *, invariant: bool = False,
            numerics: str = "hf", native: bool = True, triton: bool = False, rows_on_cpu: bool = False) -> Backend:
    """The Backend a model of this device, dtype and numerics would get in that batch-invariant mode,
    with these kernel families: how tests call an op alone, as a model would (numerics/backend.py)."""
    return build_backend(device, dtype, numerics, invariant,
                         KernelSet(native=native, triton=triton, triton_rows_on_cpu=rows_on_cpu))


TORCH_OPS = ops_for(native=False)  # every op its torch reference (fp32, CPU)

from contextlib import contextmanager

import torch


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


def fp32_paths_bound(logits: torch.Tensor, n_layers: int, dtype: torch.dtype = torch.float32) -> float:
    """How far two fp32 evaluations of the same logits (say full prefill and token-by-token decode)
    may differ by rounding alone: each is within c * L * eps * max|logit| of the exact logits, so
    they are within twice that of each other. To first order each of the L blocks adds one local
    rounding term, carried and amplified by the blocks after it: linear in L and proportional to
    the logits' scale. c = 8 comes from float64 measurements on GLM-5.3 (median 1.6, max 7.1 over
    96 sequences, flat in L from 2 to 20; tests/test_glm5_next.py); the DeepSeek-V4 tiny model's
    paths differ by at most 1.4 (native kernels) and 2.3 (torch only) units of L * eps * max|logit|
    over 60 sequences, within the 16 this allows. `dtype`: paths that round every op's output to
    a narrower dtype (bf16) instead; the same first-order argument with that dtype's eps."""
    return 2 * 8 * n_layers * torch.finfo(dtype).eps * logits.abs().max().item()


def flat_rows(rows: dict):
    """Attention.project's rows (tensors and pairs of tensors by name; "positions" aside) as one
    flat tensor, in name order: two such dicts compare with one torch.equal."""
    import torch
    return torch.cat([t.flatten() for k in sorted(rows) if k != "positions"
                      for t in (rows[k] if isinstance(rows[k], tuple) else (rows[k],))])

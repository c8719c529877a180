"""KDA's chunked form (kda.py) builds a chunk's decays as a running product over its rows, one
[H, t, dk] multiply per row, where it once cumprod'ed an [H, L, L, dk] tensor of per-step factors
and multiplied and summed whole [H, L, L, dk] products. The two must give the same bits: a
forward, its replay (state.py) and the graph step (graph_step.py) share `kda_chunked`, and
snapshots restored across versions continue bit-identically only if nothing moved. The old form
is kept here, verbatim, as the reference."""
import pytest
import torch

from kvfold.models.glm5.kda import _chunk, kda_chunk_starts, kda_chunked


def old_kda_chunked(q, k, v, g, beta, s0, starts=None, keep_at=()):
    """kda_chunked before the row-by-row decays (the reference: do not optimise)."""
    t_all = k.shape[0]
    starts = kda_chunk_starts(t_all) if starts is None else list(starts)
    s = s0
    outs, at = [], {}
    for a, b in zip(starts, starts[1:] + [t_all]):
        at[a] = s
        kc, vc, gc, bc = (_chunk(x, a, b) for x in (k, v, g, beta))
        L = kc.shape[1]
        step = gc.exp()
        eg = step.cumprod(dim=1)
        lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
        decay = step[:, :, None, :].expand(-1, -1, L, -1).masked_fill(~lower.tril(-1)[None, :, :, None], 1.0)
        decay = decay.cumprod(dim=1).masked_fill_(~lower[None, :, :, None], 0.0)
        kk = (kc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1)
        A = (kk * bc[..., None]).masked_fill(~lower.tril(-1)[None], 0.0)
        rhs = bc[..., None] * (vc - (kc * eg) @ s)
        eye = torch.eye(L, dtype=k.dtype, device=k.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        if q is not None:
            qc = _chunk(q, a, b)
            B = (qc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1).masked_fill(~lower[None], 0.0)
            outs.append(((qc * eg) @ s + B @ u).transpose(0, 1))
        s = s * eg[:, -1, :, None] + (kc * decay[:, -1]).transpose(1, 2) @ u
    at[t_all] = s
    kept = [at[i] for i in keep_at]
    o = None if q is None else (torch.cat(outs) if outs else v.new_zeros(v.shape))
    return o, s, kept


def inputs(t, h, dk, seed):
    """The recurrence's inputs as the layer makes them: unit keys, q scaled by dk^-0.5, log-decays
    in (-5, 0) (the model's lower bound), beta in (0, 1), a nonzero start state."""
    gen = torch.Generator().manual_seed(seed)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(torch.randn(t, h, dk, generator=gen)) * dk ** -0.5
    k = unit(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dk, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(t, h, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))
    s0 = 0.5 * torch.randn(h, dk, dk, generator=gen)
    return q, k, v, g, beta, s0


def same(a, b) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t,h,dk,single_from", [
    (67, 64, 128, 65),  # GLM-5.3-Flash's KDA widths: a whole chunk of 64, then single-token chunks
    (130, 4, 128, None),  # two whole chunks and a short one
    (140, 2, 8, 137),  # the tiny test model's widths
    (23, 3, 24, 20),  # a head dim with a vector tail
])
def test_row_by_row_decays_equal_the_cumprod_form_bit_for_bit(t, h, dk, single_from, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, g, beta, s0 = inputs(t, h, dk, seed=t + h + dk)
        starts = kda_chunk_starts(t, single_from)
        keep = sorted({0, starts[-1], t})
        new = kda_chunked(q, k, v, g, beta, s0, starts=starts, keep_at=keep)
        old = old_kda_chunked(q, k, v, g, beta, s0, starts=starts, keep_at=keep)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1]) and same(new[2], old[2])
        # the replay's state-only form (q None) too
        assert torch.equal(kda_chunked(None, k, v, g, beta, s0, starts=starts)[1], new[1])
        assert torch.equal(old_kda_chunked(None, k, v, g, beta, s0, starts=starts)[1], new[1])
    finally:
        torch.set_num_threads(before)


def test_decays_reach_the_outputs():
    """The bit-equality above is not vacuous: a log-decay off by a few ulps in one channel of one
    step moves that step's outputs and the final state (64 steps of one chunk; the decays are strong, so an
    earlier step's factor reaches the final state below its rounding)."""
    q, k, v, g, beta, s0 = inputs(64, 2, 16, seed=1)
    base = kda_chunked(q, k, v, g, beta, s0)
    g2 = g.clone()
    g2[63, 1, 3] *= 1 + 2.0 ** -20
    moved = kda_chunked(q, k, v, g2, beta, s0)
    assert not torch.equal(base[0][63:], moved[0][63:]) and not torch.equal(base[1], moved[1])
    assert torch.equal(base[0][:63], moved[0][:63])  # causal: rows before the step are untouched


def test_cumprod_runs_in_float64_on_the_cpu():
    """What the row-by-row decays copy (kda._decayed_dots): torch's CPU cumprod of fp32 factors is
    a running product in float64, each value rounded to fp32 once; a running product in fp32 is
    not the same bits (so the comparison above tells the two apart)."""
    gen = torch.Generator().manual_seed(2)
    step = (-5 * torch.sigmoid(torch.randn(64, 64, 128, generator=gen))).exp()
    want = step.cumprod(dim=1)
    run64, run32, rows64, rows32 = torch.ones_like(step[:, 0], dtype=torch.float64), torch.ones_like(step[:, 0]), [], []
    for t in range(step.shape[1]):
        run64, run32 = run64 * step[:, t].double(), run32 * step[:, t]
        rows64.append(run64.float())
        rows32.append(run32)
    assert torch.equal(torch.stack(rows64, dim=1), want)
    assert not torch.equal(torch.stack(rows32, dim=1), want)

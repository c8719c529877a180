"""KDA (Kimi delta attention) linear-attention layer of GLM-5.3.

Per token t (C = heads x head_dim channels each for q, k, v):
  1. q, k, v projections; a causal depthwise conv (kernel K, SiLU) over their concatenation [3C];
  2. q, k L2-normalised (sqrt(sum + 1e-6)), q scaled by head_dim^-0.5 (fp32);
  3. log-decay per head and key channel  g = lb * sigmoid(exp(A_log) * (f_b(f_a x) + dt_bias))  in
     (lb, 0) with the lower bound lb (-5), or -exp(A_log) * softplus(...) without one;
  4. beta = sigmoid(b_proj x) per head;
  5. per head, S [dk, dv] fp32:  S <- diag(exp g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q;
  6. out = o_proj(gated RMSNorm(o, sigmoid(g_b(g_a x)))).

Two exact forms of step 5: `kda_recurrent` (token by token) and `kda_chunked` (chunks of 64 in
closed form: U = (I + A)^-1 (beta V - beta K Gamma S0), O = Q Gamma S0 + B U). Both are within a few
fp32 units of roundoff of the exact recurrence (tests/test_glm5_next.py), independent of the chunk
length: the chunked form builds every decay exp(G_t - G_s) as the product of the per-step factors
exp(g_j), s < j <= t, like the recurrence, never as exp of a difference of two cumulative log-decays
G = cumsum(g), whose rounding (~|G_t| eps, |G_t| up to chunk * |lb| = 320) lands in every decay.

The layer always runs the chunked form, with chunks that start at the call's first token and
every 64 tokens after it, except that the last `max_rewind` tokens of a call run one token per
chunk (`kda_chunk_starts`). So a call's outputs and final state depend only on its tokens, the state
it starts from and where its chunks start, and every position a rewind may return to is a chunk
start. Rewinding (state.py) replays with the same function: `kda_chunked` over one forward chunk's
tokens, from the state at that chunk's start, computes what the forward computed (the same ops on
equal tensors), so the forward hands out the per-token inputs of the recurrence (`KdaStep`) and
the states at chunk starts, and keeps no per-token state. Every chunk's inputs are copied into
fresh tensors before use, in the forward and in a replay alike, so the two hand each op operands
of the same shape, strides and allocation, not views at different offsets. In batch-invariant
mode the token-parallel part (the conv, the gates, the L2 normalisation) computes each token's
inputs of the recurrence on its own (`numerics.rows.unary` / `l2norm`), so they do not depend on
the call's length either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.basic import Linear, _param
from ...numerics.backend import Backend
from ...numerics.norms import unweighted_rms_norm
from ...numerics.rows import l2norm, unary

KDA_CHUNK = 64


def kda_recurrent(q, k, v, g, beta, s0: torch.Tensor, keep_states: bool = False):
    """q, k, g [T, H, dk]; v [T, H, dv]; beta [T, H]; s0 [H, dk, dv]; all fp32 (q already scaled).
    Returns (o [T, H, dv], final state, [state after each token] if keep_states)."""
    s = s0
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[..., None]
        mem = (s * k[t][..., None]).sum(dim=-2)  # S^T k  [H, dv]
        delta = (v[t] - mem) * beta[t][..., None]
        s = s + k[t][..., None] * delta[:, None, :]
        outs.append((s * q[t][..., None]).sum(dim=-2))
        if keep_states:
            states.append(s)
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return o, s, states


def kda_chunk_starts(t: int, single_from: int | None = None) -> list[int]:
    """Where a call of t tokens starts its chunks: every KDA_CHUNK tokens from 0, and from
    `single_from` on (the first token a rewind may return to; None: never) at every token."""
    single_from = t if single_from is None else max(0, min(single_from, t))
    return list(range(0, single_from, KDA_CHUNK)) + list(range(single_from, t))


def _chunk(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) as [H, L, .], in a fresh contiguous tensor (module docstring)."""
    return x[a:b].transpose(0, 1).clone(memory_format=torch.contiguous_format)


def kda_chunked(q, k, v, g, beta, s0: torch.Tensor, starts=None, keep_at=()):
    """The same recurrence in closed form per chunk (see the module docstring); chunks start at the
    token indices `starts` (sorted, from 0; default every KDA_CHUNK tokens). q, k, g [T, H, dk];
    v [T, H, dv]; beta [T, H]; s0 [H, dk, dv]; all fp32. Returns (o [T, H, dv], final state, kept):
    `kept` lists the state at each token index of `keep_at`, each a chunk start or T (0 is s0, T the
    final state). With q None, o is None and only the state is computed, by the very same ops
    (replay, state.py)."""
    t_all = k.shape[0]
    starts = kda_chunk_starts(t_all) if starts is None else list(starts)
    s = s0
    outs, at = [], {}
    for a, b in zip(starts, starts[1:] + [t_all]):
        at[a] = s
        kc, vc, gc, bc = (_chunk(x, a, b) for x in (k, v, g, beta))  # [H, L, .]
        qc = None if q is None else _chunk(q, a, b)
        L = kc.shape[1]
        # every decay is a product of the per-step factors exp(g_j), as in the recurrence (module
        # docstring): eg_t = exp(G_t) = prod_{j<=t}, decay[t, s] = exp(G_t - G_s) = prod_{s<j<=t}
        step = gc.exp()  # [H, L, dk]
        eg = step.cumprod(dim=1)
        kk, B, last = _decayed_dots(kc, qc, step)
        lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
        A = (kk * bc[..., None]).masked_fill(~lower.tril(-1)[None], 0.0)
        rhs = bc[..., None] * (vc - (kc * eg) @ s)  # [H, L, dv]
        eye = torch.eye(L, dtype=k.dtype, device=k.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        if q is not None:
            B = B.masked_fill(~lower[None], 0.0)
            outs.append(((qc * eg) @ s + B @ u).transpose(0, 1))
        s = s * eg[:, -1, :, None] + (kc * last).transpose(1, 2) @ u
    at[t_all] = s
    kept = [at[i] for i in keep_at]
    o = None if q is None else (torch.cat(outs) if outs else v.new_zeros(v.shape))
    return o, s, kept


def _decayed_dots(kc: torch.Tensor, qc: torch.Tensor | None, step: torch.Tensor):
    """A chunk's decayed dot products, row t at a time: kk[t, s] = sum_d k_t k_s decay[t, s] and
    (with qc) B[t, s] = sum_d q_t k_s decay[t, s] for s <= t (zero above the diagonal), and the
    last row of decays [H, L, dk]. kc, qc, step = exp(g) [H, L, dk].

    decay[t, s] = prod_{s<j<=t} step_j is the running product over t that a cumprod of the per-step
    factors computes (torch's on the CPU: in float64, each value rounded to fp32 once), kept in
    float64 here and updated in place, one [H, t, dk] multiply per row: equal, bit for bit, to
    cumprod over the [H, L, L, dk] tensor of factors, whose every element costs a strided scalar
    step and whose size (128 MiB at GLM-5.3's widths, per product) costs page faults. Each row's
    products and sums are those of the whole tensor's, in the same order: the same bits
    (tests/test_glm5_kda_decay.py), at half the work (no s > t) and in buffers reused across rows.
    In-place on tensors made from the inputs, so `torch.vmap` batches them (graph_step.py)."""
    L = kc.shape[1]
    lead = kc[:, None] if qc is None else torch.stack([kc, qc], dim=1)  # [H, n, L, dk]: whose dots with k
    step64 = step.double()
    run = torch.ones_like(step64)  # run[:, s] = decay[t, s] in float64, for s <= t
    decay = torch.empty_like(step)
    prod = torch.empty_like(lead)
    rows = []
    for t in range(L):
        if t:
            run[:, :t].mul_(step64[:, t, None])
        decay[:, :t + 1].copy_(run[:, :t + 1])
        p = prod[:, :, :t + 1]  # (k_t k_s) decay[t, s], or (q_t k_s) decay[t, s]
        p.copy_(kc[:, None, :t + 1]).mul_(lead[:, :, t, None, :]).mul_(decay[:, None, :t + 1])
        rows.append(F.pad(p.sum(-1), (0, L - 1 - t)))  # [H, n, L]
    dots = torch.stack(rows, dim=2)  # [H, n, t, s]
    return dots[:, 0], (None if qc is None else dots[:, 1]), decay


@dataclass
class KdaStep:
    """What one forward of a KDA layer over T tokens hands its state (state.py): the recurrence's
    per-token inputs, exactly the tensors `kda_chunked` got (k [T, H, dk], v [T, H, dv], g [T, H, dk],
    beta [T, H], fp32, contiguous), the conv inputs `full` [K-1+T, 3C] (the conv state the call
    started from, then the call's pre-conv rows: the conv state after token i is full[i+1:i+K]),
    the chunk starts it ran (`starts`), the final recurrent state and the states at the token
    indices asked for (`kept`)."""
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    full: torch.Tensor
    starts: list
    rec: torch.Tensor
    kept: list


class GatedRMSNorm(nn.Module):
    """o_norm: fp32 RMSNorm with a weight, times sigmoid(gate), cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, ops: Backend) -> torch.Tensor:
        h = unweighted_rms_norm(ops, x.float(), self.eps)
        h = self.weight.float() * h * unary(ops, "sigmoid", gate.float())
        return h.to(x.dtype)


class KdaAttention(nn.Module):
    """Weights named as in the checkpoint `save_pretrained` writes (`q_conv1d`, `A_log`, `f_a_proj` ...)."""

    def __init__(self, cfg, dtype: torch.dtype, device=None, tp=None):
        """`tp`: hold this rank's heads (sharding.py); the output is then the sum over ranks."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        h, nh, dk = cfg.hidden_size, cfg.linear_num_heads // (tp.size if self.tp else 1), cfg.linear_head_dim
        c, kw = nh * dk, cfg.linear_conv_kernel_dim
        self.nh, self.dk, self.c, self.kw = nh, dk, c, kw
        self.lower_bound = cfg.linear_lower_bound
        self.q_proj = Linear(h, c, dtype, device)
        self.k_proj = Linear(h, c, dtype, device)
        self.v_proj = Linear(h, c, dtype, device)
        # depthwise conv taps [C, K] each (checkpoint shape [C, 1, K]); kept fp32 like HF
        self.q_conv1d = _param(c, 1, kw, dtype=torch.float32, device=device)
        self.k_conv1d = _param(c, 1, kw, dtype=torch.float32, device=device)
        self.v_conv1d = _param(c, 1, kw, dtype=torch.float32, device=device)
        self.f_a_proj = Linear(h, dk, dtype, device)
        self.f_b_proj = Linear(dk, c, dtype, device)
        self.dt_bias = _param(c, dtype=torch.float32, device=device)
        self.A_log = _param(nh, dtype=torch.float32, device=device)
        self.b_proj = Linear(h, nh, dtype, device)
        self.g_a_proj = Linear(h, dk, dtype, device)
        self.g_b_proj = Linear(dk, c, dtype, device)
        self.o_norm = GatedRMSNorm(dk, cfg.rms_norm_eps, dtype, device)
        self.o_proj = Linear(c, h, dtype, device)

    def conv_weight(self) -> torch.Tensor:
        return torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d])[:, 0, :]  # [3C, K]

    def forget_gate(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        f = self.f_b_proj(self.f_a_proj(x, ops), ops).float() + self.dt_bias.float()
        f = f.view(x.shape[0], self.nh, self.dk)
        rate = self.A_log.float().exp()[None, :, None]
        if self.lower_bound is not None:
            return self.lower_bound * unary(ops, "sigmoid", rate * f)
        return -rate * unary(ops, "softplus", f)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, ops: Backend,
                starts=None, keep_at=()):
        """x [T, hidden]; conv_state [K-1, 3C] (pre-conv inputs of the previous K-1 tokens);
        rec_state [H, dk, dv] fp32; `starts` the chunk starts (kda_chunk_starts; default every
        KDA_CHUNK tokens). Neither input is modified. Returns (out [T, hidden], KdaStep), the step
        keeping the recurrent states at the chunk starts `keep_at` (token indices)."""
        t = x.shape[0]
        full = torch.cat([conv_state.to(x.dtype), self.mixed(x, ops)])  # [K-1+T, 3C]
        q, k, v, g, beta = self.recurrence_inputs(x, full, ops)
        starts = kda_chunk_starts(t) if starts is None else list(starts)
        o, s, kept = kda_chunked(q, k, v, g, beta, rec_state.float(), starts=starts, keep_at=keep_at)
        return self.output(x, o, ops), KdaStep(k, v, g, beta, full, starts, s, kept)

    def mixed(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        """The pre-conv rows [T, 3C] of x [T, hidden]: the q, k and v projections side by side."""
        return torch.cat([self.q_proj(x, ops), self.k_proj(x, ops), self.v_proj(x, ops)], dim=-1)

    def recurrence_inputs(self, x: torch.Tensor, full: torch.Tensor, ops: Backend) -> tuple[torch.Tensor, ...]:
        """(q, k, v, g, beta) of x's T rows, fp32 and contiguous, from the conv inputs `full`
        [..., K-1+T, 3C] (the conv state, then the rows' pre-conv rows; a leading dim of one
        sequence per row gives each row its own, with T = 1)."""
        t = x.shape[0]
        w = self.conv_weight()
        win = full.float().unfold(-2, self.kw, 1)  # [..., T, 3C, K]: taps of token t are full[t .. t+K-1]
        taps = win[..., 0] * w[:, 0]  # the K taps summed in order: elementwise IEEE ops, exact in any kernel
        for j in range(1, self.kw):
            taps = taps + win[..., j] * w[:, j]
        conv = unary(ops, "silu", taps).to(x.dtype)
        q, k, v = (z.float().reshape(t, self.nh, self.dk) for z in conv.split(self.c, dim=-1))
        q = l2norm(ops, q) * self.dk ** -0.5
        # contiguous, as the replay's copies are: the recurrence sees the same tensors either way
        k, v = l2norm(ops, k).contiguous(), v.contiguous()
        g = self.forget_gate(x, ops).contiguous()
        beta = unary(ops, "sigmoid", self.b_proj(x, ops).float()).contiguous()
        return q, k, v, g, beta

    def output(self, x: torch.Tensor, o: torch.Tensor, ops: Backend) -> torch.Tensor:
        """The layer's output [T, hidden] from the recurrence's o [T, H, dv]: gated norm, o_proj."""
        gate = self.g_b_proj(self.g_a_proj(x, ops), ops).view(x.shape[0], self.nh, self.dk)
        out = self.o_proj(self.o_norm(o.to(x.dtype), gate, ops).reshape(x.shape[0], self.c), ops)
        return out if self.tp is None else self.tp.all_reduce_sum(out)

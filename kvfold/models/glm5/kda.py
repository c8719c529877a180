"""KDA (Kimi delta attention) linear-attention layer of GLM-5.3.

Per token t (C = heads x head_dim channels each for q, k, v):
  1. q, k, v projections; a causal depthwise conv (kernel K, SiLU) over their concatenation [3C];
  2. q, k L2-normalised (sqrt(sum + 1e-6)), q scaled by head_dim^-0.5 (fp32);
  3. log-decay per head and key channel  g = lb * sigmoid(exp(A_log) * (f_b(f_a x) + dt_bias))  in
     (lb, 0) with the lower bound lb (-5), or -exp(A_log) * softplus(...) without one;
  4. beta = sigmoid(b_proj x) per head;
  5. per head, S [dk, dv] fp32:  S <- diag(exp g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q;
  6. out = o_proj(gated RMSNorm(o, sigmoid(g_b(g_a x)))).

Two exact forms of step 5: `kda_recurrent` (token by token, and it yields the state after every
token) and `kda_chunked` (chunks of 64 in closed form: U = (I + A)^-1 (beta V - beta K Gamma S0),
O = Q Gamma S0 + B U). Both are within a few fp32 units of roundoff of the exact recurrence
(tests/test_glm5_next.py), independent of the chunk length: the chunked form builds every decay
exp(G_t - G_s) as the product of the per-step factors exp(g_j), s < j <= t, like the recurrence,
never as exp of a difference of two cumulative log-decays G = cumsum(g), whose rounding (~|G_t| eps,
|G_t| up to chunk * |lb| = 320) lands in every decay. The layer always runs the chunked form (chunks
start at the call's first token), so a call's outputs and final state depend only on its tokens
and the state it starts from, never on how many per-token states the caller keeps for rewinding;
those come from the same chunk quantities in closed form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.basic import Linear, _param

KDA_CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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


def kda_chunked(q, k, v, g, beta, s0: torch.Tensor, chunk: int = KDA_CHUNK, keep_from: int | None = None):
    """The same recurrence in closed form per chunk of `chunk` tokens (see the module docstring).
    Returns (o [T, H, dv], final state, states): `states` lists the state after each token
    t >= keep_from (none if keep_from is None), the intermediate ones in closed form
    S_t = diag(exp G_t) S0 + sum_{s<=t} (k_s * exp(G_t - G_s)) u_s^T (G_t: the sum of g from the
    chunk start through t) and the last one the final state itself, so the state at the end of a
    call never depends on keep_from."""
    t_all = q.shape[0]
    s = s0
    outs, states = [], []
    for a in range(0, t_all, chunk):
        qc, kc, vc, gc, bc = (x[a:a + chunk].transpose(0, 1) for x in (q, k, v, g, beta))  # [H, L, .]
        L = qc.shape[1]
        # every decay is a product of the per-step factors exp(g_j), as in the recurrence (module
        # docstring): eg_t = exp(G_t) = prod_{j<=t}, decay[t, s] = exp(G_t - G_s) = prod_{s<j<=t}
        # (a cumprod over t of exp(g_t) masked to t > s), zero above the diagonal
        step = gc.exp()  # [H, L, dk]
        eg = step.cumprod(dim=1)
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        decay = step[:, :, None, :].expand(-1, -1, L, -1).masked_fill(~lower.tril(-1)[None, :, :, None], 1.0)
        decay = decay.cumprod(dim=1).masked_fill_(~lower[None, :, :, None], 0.0)  # [H, t, s, dk]
        kk = (kc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1)  # [H, t, s]
        A = (kk * bc[..., None]).masked_fill(~lower.tril(-1)[None], 0.0)
        rhs = bc[..., None] * (vc - (kc * eg) @ s)  # [H, L, dv]
        eye = torch.eye(L, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        B = (qc[:, :, None, :] * kc[:, None, :, :] * decay).sum(-1).masked_fill(~lower[None], 0.0)
        outs.append(((qc * eg) @ s + B @ u).transpose(0, 1))
        if keep_from is not None:
            for i in range(max(keep_from - a, 0), L - 1 if a + L == t_all else L):
                states.append(s * eg[:, i, :, None] + (kc * decay[:, i]).transpose(1, 2) @ u)
        s = s * eg[:, -1, :, None] + (kc * decay[:, -1]).transpose(1, 2) @ u
    if keep_from is not None and keep_from < t_all:
        states.append(s)
    o = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return o, s, states


class GatedRMSNorm(nn.Module):
    """o_norm: fp32 RMSNorm with a weight, times sigmoid(gate), cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h * torch.sigmoid(gate.float())
        return h.to(x.dtype)


class KdaAttention(nn.Module):
    """Weights named as in the checkpoint `save_pretrained` writes (`q_conv1d`, `A_log`, `f_a_proj` ...)."""

    def __init__(self, cfg, dtype: torch.dtype, device=None):
        super().__init__()
        h, nh, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
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

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        f = f.view(x.shape[0], self.nh, self.dk)
        rate = self.A_log.float().exp()[None, :, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, record: int = 0):
        """x [T, hidden]; conv_state [K-1, 3C] (pre-conv inputs of the previous K-1 tokens);
        rec_state [H, dk, dv] fp32. Neither input is modified.

        Returns (out [T, hidden], states) where states lists, for each of the last `record`
        tokens (oldest first), the pair (conv state, recurrent state) after that token; the last
        pair is the state after the whole call (always present)."""
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3C]
        full = torch.cat([conv_state.to(mixed.dtype), mixed])  # [K-1+T, 3C]
        w = self.conv_weight()
        win = full.float().unfold(0, self.kw, 1)  # [T, 3C, K]: taps of token t are full[t .. t+K-1]
        conv = F.silu((win * w).sum(-1)).to(x.dtype)
        q, k, v = (z.float().view(t, self.nh, self.dk) for z in conv.split(self.c, dim=-1))
        q = l2norm(q) * self.dk ** -0.5
        k = l2norm(k)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x)).float()

        record = max(1, min(record, t))
        head = t - record
        o, _, recs = kda_chunked(q, k, v, g, beta, rec_state.float(), keep_from=head)
        km1 = self.kw - 1
        states = [(full[head + i + 1: head + i + 1 + km1], recs[i]) for i in range(record)]

        gate = self.g_b_proj(self.g_a_proj(x)).view(t, self.nh, self.dk)
        y = self.o_norm(o.to(x.dtype), gate).reshape(t, self.c)
        return self.o_proj(y), states

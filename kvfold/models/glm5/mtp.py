"""GLM-5.3's multi-token-prediction (MTP, "NextN") layer, used as a speculative drafter.

The checkpoint stores it as layer `num_hidden_layers` (`model.layers.45.*` in GLM-5.3-Flash, or
under `model.language_model.`), which transformers' glm5_next ignores. It is the DeepSeek-V3 NextN
pattern, as SGLang's `glm5_next_nextn.py` (DeepseekModelNextN) and vLLM's GLM-5.3 MTP run it; the
release ships no formula beyond that, and transformers has no implementation to compare with.
At position t, with h_t the main model's final hidden state (the stream mean after the final
norm: the row its lm_head reads) and e the embedding of token t+1, it predicts token t+2:

    x   = eh_proj([enorm(e), hnorm(h_t)])              (the embedding first)
    a   = x + self_attn(input_layernorm(x))            one DSA layer: NoPE MLA + its own indexer
    out = a + mlp(post_attention_layernorm(a))         score-routed MoE
    y   = shared_head.norm(out);  logits = lm_head(y)  (the main model's lm_head and embedding)

Plain residuals: the layer carries no mHC tensors (no hc_*), so it runs on one stream. Draft steps
past the verified positions feed y back in place of h (SGLang and vLLM do the same). Its state is
one MLA latent cache and one `Glm5NextDsaState` (seed contract) over every position it has seen, in
a `Glm5State` of its own that rewinds by cursor like the main one.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import CapacityError
from ...layers.basic import Linear
from ...numerics.backend import Backend
from .indexer_state import Glm5NextDsaState, indexer_state_bytes
from .mla import GlmRMSNorm, IndexedMLA
from .state import Glm5State, MlaLayerState


class SharedHead(nn.Module):
    """`shared_head.norm`; the head itself is the main model's lm_head (`shared_head.head` is not read)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.norm = GlmRMSNorm(dim, eps, dtype, device)


class Glm5Mtp(nn.Module):
    """Weights named as under the checkpoint's `layers.<num_hidden_layers>.` (module docstring)."""

    def __init__(self, cfg, dtype: torch.dtype, device=None, tp=None):
        super().__init__()
        from .model import Glm5MoE  # sharded like the main DSA layers under tp (sharding.py)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.dtype, self.device = dtype, torch.device(device) if device is not None else torch.device("cpu")
        self.enorm = GlmRMSNorm(h, eps, dtype, device)
        self.hnorm = GlmRMSNorm(h, eps, dtype, device)
        self.eh_proj = Linear(2 * h, h, dtype, device)
        self.input_layernorm = GlmRMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = GlmRMSNorm(h, eps, dtype, device)
        self.self_attn = IndexedMLA(cfg, True, dtype, device, tp)
        self.mlp = Glm5MoE(cfg, dtype, device, tp)
        self.shared_head = SharedHead(h, eps, dtype, device)
        self.kv_lora, self.index_head_dim, self.kpool = cfg.kv_lora_rank, cfg.index_head_dim, max(cfg.index_kpool, 1)
        self.fingerprint = "mtp-" + cfg.fingerprint()[:12]

    def new_state(self, capacity: int, max_rewind: int) -> Glm5State:
        """One DSA layer's rows for `capacity` positions, allocated once (indexer rows rounded up to
        whole k-pools, as the main layers' are)."""
        if capacity < 1 or max_rewind < 0:
            raise CapacityError(f"capacity must be >= 1 and max_rewind >= 0 (got {capacity}, {max_rewind})")
        dsa_cap = -(-capacity // self.kpool) * self.kpool
        layer = MlaLayerState(
            latent=torch.zeros(capacity, self.kv_lora, dtype=self.dtype, device=self.device),
            dsa=Glm5NextDsaState(dsa_cap, self.index_head_dim, self.kpool, dtype=self.dtype, device=self.device))
        return Glm5State([layer], capacity=capacity, max_rewind=max_rewind, fingerprint=self.fingerprint,
                         device=self.device, dtype=self.dtype)

    def state_bytes(self, capacity: int, max_rewind: int) -> int:
        """`new_state(capacity, max_rewind).nbytes`, from the config: the latent rows and one
        indexer state (rewinding moves cursors only, so max_rewind costs nothing)."""
        dsa_cap = -(-capacity // self.kpool) * self.kpool
        return capacity * self.kv_lora * self.dtype.itemsize + indexer_state_bytes(
            dsa_cap, self.index_head_dim, self.dtype, self.dtype, index_kpool=self.kpool)

    @torch.inference_mode()
    def forward(self, h: torch.Tensor, next_ids: torch.Tensor, state: Glm5State, embed: nn.Module,
                lm_head: nn.Module, ops: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] (the main model's final hidden rows at positions pos..pos+T-1, or this layer's
        previous outputs), next_ids [T] (the tokens one position later) -> (logits [T, vocab]
        predicting two positions ahead, y [T, hidden]), with the kernels of `ops` (the model's
        Backend). Advances `state` by T; refuses, before writing, a call past its capacity."""
        state.check_usable(self.fingerprint, self.device, self.dtype)
        t, start = next_ids.numel(), state.pos
        if start + t > state.capacity:
            raise CapacityError(f"MTP state capacity {state.capacity} exceeded at pos {start} + {t}")
        state._dsa_sync(start, 0)
        ls = state.layers[0]
        x = self.eh_proj(torch.cat([self.enorm(embed(next_ids), ops), self.hnorm(h.to(self.dtype), ops)], dim=-1),
                         ops)
        a = x + self.self_attn(self.input_layernorm(x, ops), start, ls.latent, ls.dsa, None, ops)[0]
        out = a + self.mlp(self.post_attention_layernorm(a, ops), ops)
        state.pos = state.written_until = start + t
        y = self.shared_head.norm(out, ops)
        return lm_head(y, ops).float(), y

"""The built-in "tiny-random" model: a small random DeepSeek-V4 with every layer and routing kind,
so the tests and benches run in seconds on a laptop CPU. Its tokenizer is byte-level. (The
built-in "tiny" is a trained checkpoint directory, kvfold/assets/tiny, made by tools/train_tiny.py.)"""
from __future__ import annotations

import math

import torch

from .config import CSA, HCA, SLIDING, Dsv4Config, YarnParams

BYTE_VOCAB = 258  # 256 bytes + bos + eos


def tiny_config(**overrides) -> Dsv4Config:
    fields = dict(
        vocab_size=BYTE_VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=32,
        layer_types=(SLIDING, CSA, HCA, CSA), compress_ratios=(0, 4, 32, 4),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        index_n_heads=8, index_head_dim=32, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        compress_yarn=YarnParams(factor=16, original_max_position_embeddings=256),
        max_position_embeddings=65536, bos_token_id=256, eos_token_id=257, num_nextn_predict_layers=1,
    )
    fields.update(overrides)
    return Dsv4Config(**fields)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic random weights for every parameter and buffer, the zero-initialised ones
    (sinks, ape, hc bases, router bias, tid2eid) included, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            val = 1 + 0.1 * torch.randn(shape, generator=g)
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            val = 0.5 * torch.randn(shape, generator=g)
        elif leaf in ("scale", "hc_scale"):
            val = 1 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            val = torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1]
            val = torch.randn(shape, generator=g) / math.sqrt(fan_in)
        p.copy_(val.to(p.dtype))
    for name, b in sorted(model.named_buffers()):
        if name.endswith("tid2eid"):
            rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                for _ in range(cfg.vocab_size)])
            b.copy_(rows)
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))

"""Fold timing: entry w exists exactly from position w*r + r - 1 on, rotated at w*r, and only
entries j < (q+1)//r are visible to query q; hash layers follow tid2eid."""
import torch

from kvfold.models.deepseek_v4.config import CSA
from kvfold.numerics import apply_rope, pool_windows
from helpers import fp32_paths_bound, random_ids


def test_entries_appear_in_the_step_that_completes_their_window(tiny):
    cfg = tiny.config
    st = tiny.new_state(capacity=80)
    ids = random_ids(80, cfg.vocab_size, seed=11)
    for p in range(80):
        tiny.forward(ids[p:p + 1], st)
        for ls, r in zip(st.layers, cfg.compress_ratios):
            if not r:
                continue
            filled = (ls.compressor.pool[:].abs().sum(-1) != 0).nonzero().flatten().tolist()
            assert filled == list(range((p + 1) // r)), (p, r)


def test_entry_is_the_pooled_window_normed_and_rotated_at_its_first_position(tiny):
    cfg = tiny.config
    layer_idx = cfg.layer_types.index(CSA)
    attn = tiny.model.layers[layer_idx].self_attn
    comp, r = attn.compressor, cfg.compress_ratios[layer_idx]
    ops = tiny.backend(batch_invariant=False)  # the model's kernels, outside batch-invariant mode
    x = torch.randn(3 * r, cfg.hidden_size)
    st = tiny.new_state(capacity=64).layers[layer_idx].compressor
    for p in range(3 * r):  # token by token through the state
        comp.step(x[p:p + 1], p, st, tiny.rope_compress, ops)
    kv = x @ comp.kv_proj.weight.t()
    sc = x @ comp.gate_proj.weight.t() + comp.position_bias[torch.arange(3 * r) % r]
    pad_kv = torch.cat([torch.zeros(r, kv.shape[1]), kv])
    pad_sc = torch.cat([torch.full((r, kv.shape[1]), float("-inf")), sc])
    pooled = pool_windows(ops, pad_kv, pad_sc, r, overlap=True)
    normed = comp.kv_norm(pooled, ops)
    cos, sin = tiny.rope_compress.cos_sin(ops, torch.arange(3) * r)
    want = apply_rope(ops, normed, cos, sin)
    assert torch.allclose(st.pool[:3], want, atol=1e-5)


def test_hash_layer_routes_by_token_id_whatever_the_hidden_state(tiny):
    moe = tiny.model.layers[0].mlp
    assert moe.gate.is_hash
    tokens = torch.tensor([5, 5, 17])
    ops = tiny.backend(batch_invariant=False)  # the torch router: ids in tid2eid's order
    _, ids_a = moe.gate(torch.randn(3, tiny.config.hidden_size), tokens, ops)
    _, ids_b = moe.gate(torch.randn(3, tiny.config.hidden_size), tokens, ops)
    assert torch.equal(ids_a, ids_b) and torch.equal(ids_a, moe.gate.tid2eid[tokens])


def test_logits_at_position_t_do_not_depend_on_later_tokens(tiny):
    a = random_ids(70, tiny.config.vocab_size, seed=1)
    b = a.clone()
    b[40:] = random_ids(30, tiny.config.vocab_size, seed=2)
    la = tiny.forward(a, tiny.new_state(capacity=70))
    lb = tiny.forward(b, tiny.new_state(capacity=70))
    # same math, other matmul shapes: two fp32 paths to the same logits; a later token leaking into
    # an earlier position moves it by orders of magnitude more
    assert (la[:40] - lb[:40]).abs().max().item() < fp32_paths_bound(la[:40], tiny.config.num_hidden_layers)
    assert not torch.allclose(la[40:], lb[40:])

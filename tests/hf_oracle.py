"""Test oracle: tiny random Hugging Face DeepSeek-V4 checkpoints (transformers 5.23.0).

Everything here is offline: configs are built in code, models are random, nothing is downloaded.

API
---
- ``tiny_hf_config(**overrides)``      -> ``DeepseekV4Config`` (fp32, eager, every layer/MLP type present)
- ``build_hf_model(config=None, seed=0)`` -> ``DeepseekV4ForCausalLM`` (eval, fp32, every param and
  persistent buffer random, deterministic in ``seed``)
- ``save_hf_checkpoint(model, directory, max_shard_size=None, key_format="save_pretrained")`` -> ``Path``
- ``checkpoint_tensors(directory)``    -> ``{stored_name: Tensor}`` of every safetensors file there
- ``official_keys(module_key, n_routed_experts)`` -> release names holding an HF state-dict entry
- ``save_pretrained_key(official_key)`` -> the name ``save_pretrained`` (default) stores it under
- ``load_hf_checkpoint(directory)``    -> ``DeepseekV4ForCausalLM`` (eval, fp32, eager attention + eager experts)
- ``hf_logits(model, input_ids)``      -> ``Tensor[T, vocab]`` (fp32, no cache, no grad)
- ``random_input_ids(length, seed=0, vocab_size=300)`` -> ``list[int]`` (prefix-stable in ``length``)
- ``ORACLE_SEEDS``: build/input seeds validated tie-free with a comfortable top-k margin
- ``hf_indexer_scores(model, input_ids)`` -> ``{module_name: Tensor[T, n_entries]}`` (invisible = -inf)
- ``hf_indexer_topk(model, input_ids)`` -> ``{module_name: LongTensor[T, k]}`` HF's selected entries
  (ascending, ``-1`` padded)
- ``hf_indexer_topk_margin(model, input_ids)`` -> smallest relative gap at the top-k cut (``inf`` if no cut)
- ``hf_indexer_has_ties(model, input_ids, rel_tol=0.0)`` -> ``bool``
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

# Everything here is local; make any accidental hub access fail instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_dsv4

TINY_LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
TINY_MLP_LAYER_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]

# Build seeds whose fixtures are checked (tests/test_hf_oracle.py) to have no top-k tie and a top-k
# margin >= 5e-5 (see hf_indexer_topk_margin) with random_input_ids(L, seed) for every L <= 257.
# Margins at L=257: seed 0 7.8e-5, seed 4 1.8e-4. Exact ties are impossible by construction
# (_indexer_q_b_proj); near ties are statistical: some other seeds reach ~4e-6 at L=257.
ORACLE_SEEDS = (0, 4)

# YaRN for the compressed layers. HF's V4 config takes a *flat* rope_parameters dict here and
# builds {"main": default θ=rope_theta, "compress": yarn θ=compress_rope_theta, attention_factor=1.0}.
# original_max_position_embeddings=256 with max_position_embeddings=4096 keeps factor == 4096/256
# (no HF "implicit factor" warning) and, for the 8-dim rope at θ=160000, gives correction range
# low=0, high=2, i.e. ramp = [0, 0.5, 1, 1] over the 4 frequencies: one pure-extrapolation
# frequency, one genuinely blended, two fully interpolated (f/16).
TINY_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
}


def tiny_hf_config(**overrides) -> DeepseekV4Config:
    """A tiny fp32 DeepSeek-V4 config that has every layer type, hash + scored MoE, mHC and YaRN.

    ``overrides`` replace any keyword (e.g. ``num_hidden_layers=3, layer_types=[...]``).
    Passing ``rope_parameters`` replaces the YaRN dict (flat form, or nested {"main", "compress"}).
    """
    kwargs = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=5,
        layer_types=list(TINY_LAYER_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=list(TINY_MLP_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=8 / 32,  # rope dim 8 = trailing 8 of 32
        q_lora_rank=32,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        # Low enough that the SwiGLU clamps (gate max, up ±limit) actually bite on a few % of
        # the O(1) pre-activations of this fixture; the real models use 10.
        swiglu_limit=1.5,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters=dict(TINY_YARN),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        hidden_act="silu",
        attn_implementation="eager",
        experts_implementation="eager",
        dtype="float32",
        use_cache=False,
    )
    kwargs.update(overrides)
    if isinstance(kwargs.get("rope_parameters"), dict):
        kwargs["rope_parameters"] = _deepcopy_dict(kwargs["rope_parameters"])
    return DeepseekV4Config(**kwargs)


def _deepcopy_dict(d):
    return {k: _deepcopy_dict(v) if isinstance(v, dict) else v for k, v in d.items()}


# ----------------------------------------------------------------------------------------------
# Random initialisation
# ----------------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std + mean


def _uniform(gen: torch.Generator, shape, lo: float, hi: float) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=gen, dtype=torch.float32) * (hi - lo) + lo


def _random_value(name: str, t: torch.Tensor, config: DeepseekV4Config, gen: torch.Generator) -> torch.Tensor:
    """The random value for state-dict entry ``name`` (fully qualified)."""
    leaf = name.rsplit(".", 1)[-1]
    shape = t.shape
    if leaf == "tid2eid":  # [vocab, top_k] distinct expert ids per row
        n_exp = config.n_routed_experts
        rows = [torch.randperm(n_exp, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(t.dtype)
    if leaf == "e_score_correction_bias":  # shifts selection only; comparable to score spread
        return _randn(gen, shape, 0.2)
    if leaf == "sinks":  # raw per-head logit, same scale as q.k/sqrt(D) ~ N(0, 1)
        return _randn(gen, shape, 1.0)
    if leaf == "position_bias":  # gate bias per slot; gate logits are ~N(0, 1)
        return _randn(gen, shape, 0.5)
    if leaf in ("fn", "hc_fn"):  # applied to an RMS-normalised [hc*hidden] vector
        return _randn(gen, shape, 1.0 / math.sqrt(shape[-1]))
    if leaf in ("base", "hc_base"):
        return _randn(gen, shape, 0.5)
    if leaf in ("scale", "hc_scale"):
        return _uniform(gen, shape, 0.5, 1.5)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return _randn(gen, shape, 0.1, 1.0)
    if name == "model.embed_tokens.weight":
        return _randn(gen, shape, 1.0)
    if leaf == "gate_up_proj":  # [E, 2I, H]
        return _randn(gen, shape, 1.0 / math.sqrt(shape[-1]))
    if leaf == "down_proj":  # [E, H, I]
        return _randn(gen, shape, 1.0 / math.sqrt(shape[-1]))
    if name.endswith("indexer.q_b_proj.weight"):
        return _indexer_q_b_proj(gen, shape, config)
    if leaf == "weight" and t.dim() == 2:  # every nn.Linear (incl. grouped o_a_proj, routers, lm_head)
        return _randn(gen, shape, 1.0 / math.sqrt(shape[-1]))
    raise AssertionError(f"hf_oracle: no random init rule for {name} {tuple(shape)}; add one")


def _indexer_q_b_proj(gen: torch.Generator, shape, config: DeepseekV4Config) -> torch.Tensor:
    """Indexer query projection ``[n_heads * head_dim, q_lora_rank]`` with heads in +/- pairs.

    Index score = sum_h w_h * ReLU(q_h . k). With independent random heads, q_h . k <= 0 for *all*
    heads happens for ~1/2^n_heads of the (query, entry) pairs; each such pair scores exactly 0, and
    two exact zeros can land on the k-th/(k+1)-th place of a row (seen at L=257, seed 9). Giving
    head h + n/2 the negated rows of head h makes exactly one head of every pair see |q_h . k| > 0,
    so no score is exactly 0 (short of q_h . k == 0) while every head stays distinct and the
    sum over heads still mixes signs through w_h. Odd head counts keep one unpaired head.
    """
    n_heads, head_dim = config.index_n_heads, config.index_head_dim
    assert shape[0] == n_heads * head_dim, shape
    w = _randn(gen, shape, 1.0 / math.sqrt(shape[-1])).view(n_heads, head_dim, shape[-1])
    half = n_heads // 2
    w[half : 2 * half] = -w[:half]
    return w.reshape(shape)


def randomize_(model: DeepseekV4ForCausalLM, seed: int = 0) -> DeepseekV4ForCausalLM:
    """Overwrite every parameter and persistent buffer of ``model`` with seeded random values.

    Non-persistent buffers (the rotary ``*_inv_freq`` tables) are derived from the config and kept.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in model.state_dict():  # params + persistent buffers, deterministic order
            target = tensors[name]
            target.copy_(_random_value(name, target, model.config, gen))
    return model


def build_hf_model(config: DeepseekV4Config | None = None, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A random fp32 ``DeepseekV4ForCausalLM`` in eval mode. Deterministic in ``(config, seed)``."""
    if config is None:
        config = tiny_hf_config()
    torch_state = torch.random.get_rng_state()
    try:
        model = DeepseekV4ForCausalLM(config)
    finally:  # HF's own init draws from the global RNG; do not leak that into callers
        torch.random.set_rng_state(torch_state)
    model = model.to(torch.float32)
    randomize_(model, seed)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


KEY_FORMATS = ("save_pretrained", "module", "official")


def save_hf_checkpoint(
    model: DeepseekV4ForCausalLM,
    directory,
    max_shard_size: int | str | None = None,
    key_format: str = "save_pretrained",
) -> Path:
    """Write ``model`` as a safetensors checkpoint (config.json + generation_config.json + weights).

    ``max_shard_size`` (e.g. ``"20KB"`` or bytes): shard into ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.

    ``key_format`` picks the tensor names in the files (all three reload through
    ``DeepseekV4ForCausalLM.from_pretrained`` with identical weights):

    - ``"save_pretrained"``: exactly what ``model.save_pretrained(directory)`` writes in
      transformers 5.23 (``save_original_format=True``): HF's conversion mapping is *reverted*,
      giving a hybrid of official leaf names under HF's ``model.`` prefix, e.g.
      ``model.layers.1.attn.indexer.wq_b.weight``, per-expert ``ffn.experts.{e}.w1/w2/w3``,
      ``ffn.gate.bias``, ``head.weight``, but ``model.embed_tokens.weight``,
      ``model.hc_head.hc_fn``, ``model.norm.weight``.
    - ``"module"``: HF module names (``save_original_format=False``), e.g.
      ``model.layers.1.self_attn.compressor.indexer.q_b_proj.weight``, fused
      ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, ``lm_head.weight``.
    - ``"official"``: the DeepSeek release names, no ``model.`` prefix:
      ``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_fn``, ``layers.1.attn.wq_a.weight``, ...
      (the ``"save_pretrained"`` files with the prefix stripped and the four top-level names fixed).
    """
    if key_format not in KEY_FORMATS:
        raise ValueError(f"key_format must be one of {KEY_FORMATS}, got {key_format!r}")
    directory = Path(directory)
    kwargs = {"save_original_format": key_format != "module"}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    if key_format == "official":
        _rename_checkpoint_keys(directory, _official_key)
    return directory


_OFFICIAL_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def _official_key(key: str) -> str:
    key = key.removeprefix("model.")
    return _OFFICIAL_TOP_LEVEL.get(key, key)


def _rename_checkpoint_keys(directory: Path, rename) -> None:
    index_path = directory / "model.safetensors.index.json"
    files = sorted(directory.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            tensors = {rename(k): f.get_tensor(k).clone() for k in f.keys()}
        save_file(tensors, str(path), metadata=metadata)
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# HF module name -> DeepSeek release name. Applied in order, as substrings.
_MODULE_TO_OFFICIAL = (
    (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
    (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
    (".self_attn.", ".attn."),
    (".mlp.shared_experts.gate_proj.", ".ffn.shared_experts.w1."),
    (".mlp.shared_experts.down_proj.", ".ffn.shared_experts.w2."),
    (".mlp.shared_experts.up_proj.", ".ffn.shared_experts.w3."),
    (".mlp.gate.e_score_correction_bias", ".ffn.gate.bias"),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".kv_norm.", ".norm."),
    (".position_bias", ".ape"),
)


def official_keys(module_key: str, n_routed_experts: int) -> list[str]:
    """The DeepSeek release tensor name(s) that hold HF state-dict entry ``module_key``.

    Fused experts expand to per-expert names: ``gate_up_proj [E, 2I, H]`` is
    ``experts.{e}.w1`` (rows ``[:I]``) + ``experts.{e}.w3`` (rows ``[I:]``); ``down_proj [E, H, I]``
    is ``experts.{e}.w2``.
    """
    if module_key == "lm_head.weight":
        return ["head.weight"]
    key = module_key.removeprefix("model.")
    if key in _OFFICIAL_TOP_LEVEL:
        return [_OFFICIAL_TOP_LEVEL[key]]
    for suffix, leaves in ((".mlp.experts.gate_up_proj", ("w1", "w3")), (".mlp.experts.down_proj", ("w2",))):
        if key.endswith(suffix):
            base = key[: -len(suffix)]
            return [f"{base}.ffn.experts.{e}.{w}.weight" for e in range(n_routed_experts) for w in leaves]
    for old, new in _MODULE_TO_OFFICIAL:
        key = key.replace(old, new)
    return [key]


def save_pretrained_key(official_key: str) -> str:
    """Where ``save_pretrained`` (transformers 5.23, default ``save_original_format=True``) stores the
    tensor whose release name is ``official_key``: under ``model.``, except ``head.weight``; and the
    four top-level names it fails to revert (embed, hc_head_*) keep their HF module names."""
    if official_key == "head.weight":
        return official_key
    inverse = {v: k for k, v in _OFFICIAL_TOP_LEVEL.items()}
    return "model." + inverse.get(official_key, official_key)


def checkpoint_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor stored in the checkpoint's safetensors file(s), by stored name."""
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def load_hf_checkpoint(directory) -> DeepseekV4ForCausalLM:
    """Reload a checkpoint written by :func:`save_hf_checkpoint` (eval, fp32, eager attention/experts).

    ``experts_implementation`` is not stored in config.json; without it ``from_pretrained`` picks
    ``grouped_mm`` (same math, different float summation). Tensors are copied into fresh memory:
    safetensors hands back tensors at unaligned addresses (e.g. 12 mod 64) and CPU kernels then take
    other vector paths, which moves logits by ~1e-6; the copy makes the reload bitwise identical.
    """
    model = DeepseekV4ForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = buf.clone()
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------


def random_input_ids(length: int, seed: int = 0, vocab_size: int = 300) -> list[int]:
    """Deterministic token ids; ``random_input_ids(n, s)`` is a prefix of ``random_input_ids(m, s)``, n <= m."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


@contextlib.contextmanager
def _single_thread():
    """Run the (tiny) oracle on one intra-op thread: as fast as two for these shapes, independent
    of the machine's core count, and immune to OpenMP oversubscription (with 2 threads on 2 busy
    cores the file took 240 s instead of 12 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hf_logits(model: DeepseekV4ForCausalLM, input_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits ``[T, vocab]`` (fp32), one batch row, no KV cache, one CPU thread."""
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    with torch.no_grad(), _single_thread():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float()


def hf_indexer_scores(model: DeepseekV4ForCausalLM, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """Lightning-indexer scores of every CSA layer from a no-cache forward of ``input_ids``.

    Returns ``{scorer_module_name: scores[T, n_entries]}`` with entries a query may not see
    (``j >= (p+1)//r``) set to ``-inf``. Positions are ``0..T-1`` (no cache).
    """
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, hf_dsv4.DeepseekV4IndexerScorer):

            def hook(mod, args, output, _name=name):
                captured[_name] = output.detach().clone()

            handles.append(module.register_forward_hook(hook))
    try:
        hf_logits(model, input_ids)
    finally:
        for h in handles:
            h.remove()
    ratio = model.config.compress_rates["compressed_sparse_attention"]
    out = {}
    for name, scores in captured.items():
        scores = scores[0]  # [T, n_entries]
        t, n = scores.shape
        pos = torch.arange(t).unsqueeze(-1)
        visible = torch.arange(n).unsqueeze(0) < (pos + 1) // ratio
        out[name] = scores.masked_fill(~visible, float("-inf"))
    return out


def hf_indexer_topk(model: DeepseekV4ForCausalLM, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """The top-k entry sets HF's lightning indexer selects, per CSA layer, from a no-cache forward.

    Returns ``{indexer_module_name: LongTensor[T, k]}``, ``k = min(index_topk, n_entries)``; each row
    holds the selected entry indices ascending, then ``-1`` for unused slots (rows with fewer than
    k visible entries). Read from HF's own ``DeepseekV4Indexer`` output, so it is HF's choice
    (``torch.topk``), not a recomputation; only meaningful where ``hf_indexer_has_ties`` is False.
    """
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, hf_dsv4.DeepseekV4Indexer):

            def hook(mod, args, output, _name=name):
                captured[_name] = output.detach().clone()

            handles.append(module.register_forward_hook(hook))
    try:
        hf_logits(model, input_ids)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, idx in captured.items():
        idx = idx[0]  # [T, k], -1 = invalid
        big = torch.iinfo(idx.dtype).max
        idx = torch.where(idx < 0, big, idx).sort(dim=-1).values
        out[name] = torch.where(idx == big, -1, idx)
    return out


def _cut_gaps(model, input_ids):
    """Per CSA layer, for query rows with more visible entries than k: (gap at the cut, row scale)
    where gap = s_k - s_{k+1} of the sorted visible scores and scale = max |visible score|."""
    k_cfg = model.config.index_topk
    out = []
    for scores in hf_indexer_scores(model, input_ids).values():
        k = min(k_cfg, scores.shape[-1])
        n_visible = torch.isfinite(scores).sum(-1)
        rows = scores[n_visible > k]
        if rows.numel() == 0:
            continue
        top = rows.topk(k + 1, dim=-1).values
        scale = rows.masked_fill(~torch.isfinite(rows), 0.0).abs().amax(-1)
        out.append((top[:, k - 1] - top[:, k], scale))
    return out


def hf_indexer_topk_margin(model: DeepseekV4ForCausalLM, input_ids: list[int]) -> float:
    """Smallest gap at the top-k cut, ``(s_k - s_{k+1}) / max_j |s_j|`` (sorted visible scores of one
    query row, normalised by that row's largest visible |score|), over all CSA layers and all query
    rows that have a cut (more visible entries than k). ``inf`` when no row has a cut.

    fp32 recomputation of the scores is accurate to ~1e-7 of the row scale, so a margin well above
    that means kvfold's (differently ordered) fp32 scores select the same top-k set as HF's."""
    best = math.inf
    for gap, scale in _cut_gaps(model, input_ids):
        best = min(best, (gap / scale.clamp_min(1e-30)).min().item())
    return best


def hf_indexer_has_ties(model: DeepseekV4ForCausalLM, input_ids: list[int], rel_tol: float = 0.0) -> bool:
    """True when some CSA query row has a tie straddling the top-k cut: the k-th and (k+1)-th largest
    *visible* index scores are equal (``rel_tol=0``) or closer than ``rel_tol`` times the row's
    largest visible |score|. Rows with <= k visible entries have no cut (every visible entry is
    selected) and cannot tie."""
    return hf_indexer_topk_margin(model, input_ids) <= rel_tol

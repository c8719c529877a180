"""Parse and validate a DeepSeek-V4 `config.json` into one frozen dataclass.

Accepts the transformers layout (`layer_types`, `compress_rates`, `mlp_layer_types`, nested
`rope_parameters`) and the legacy/official keys (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`). The layer type always comes from the explicit schedule;
a config without one is refused rather than guessed (HF's fallback is wrong for V4-Pro).
Official `compress_ratios` read as the release's inference code reads them: 0 sliding window,
4 CSA, any other positive ratio HCA.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Dsv4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer; 0 for sliding layers
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnParams | None = None
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def fingerprint(self) -> str:
        """Hash of every field that shapes weights or state: two models with the same
        fingerprint can exchange states and snapshots."""
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def compress_rates(self) -> dict[str, int]:
        """The one compress rate of each compressed layer type present (the transformers layout's
        `compress_rates`). ConfigError when one type runs at several ratios (the official layout allows
        that, e.g. HCA layers at 16 and 128; the transformers layout cannot say it)."""
        rates: dict[str, set[int]] = {}
        for t, r in zip(self.layer_types, self.compress_ratios):
            if t != SLIDING:
                rates.setdefault(t, set()).add(r)
        mixed = {t: sorted(rs) for t, rs in rates.items() if len(rs) > 1}
        if mixed:
            raise ConfigError(f"the transformers layout has one compress rate per layer type; this config has "
                              f"{mixed} (keep it in the official layout)")
        return {t: rs.pop() for t, rs in rates.items()}

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-style `config.json` dictionary (used to save tiny checkpoints)."""
        rope_compress: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": self.compress_rope_theta,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
        }
        if self.compress_yarn is not None:
            rope_compress.update(
                rope_type="yarn", factor=self.compress_yarn.factor, attention_factor=1.0,
                original_max_position_embeddings=self.compress_yarn.original_max_position_embeddings,
                beta_fast=self.compress_yarn.beta_fast, beta_slow=self.compress_yarn.beta_slow,
            )
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "compress_rates": self.compress_rates(),
            "mlp_layer_types": list(self.mlp_layer_types),
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_shared_experts": self.n_shared_experts,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim},
                "compress": rope_compress,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }


def _require(d: dict, key: str, *alts: str) -> Any:
    for k in (key, *alts):
        if k in d and d[k] is not None:
            return d[k]
    raise ConfigError(f"config.json has no `{key}`; it is required for a DeepSeek-V4 model")


def _yarn_from(d: dict | None) -> YarnParams | None:
    if not d:
        return None
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type != "yarn":
        return None
    attention_factor = d.get("attention_factor")
    if attention_factor not in (None, 1.0, 1):
        # V4 has no YaRN mscale; a config that asks for one is not a V4 config we can honour.
        raise ConfigError(f"YaRN attention_factor={attention_factor} is not supported (DeepSeek-V4 uses 1.0)")
    return YarnParams(
        factor=float(d["factor"]),
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _official_schedule(compress_ratios: Any, n: int, csa_rate: int) -> tuple[list[str], tuple[int, ...]]:
    """The layer schedule of the official `compress_ratios` (one int per layer, then one per MTP block), read
    as the release's inference code reads it: 0 is a sliding-window-only layer, 4 a CSA layer (overlapping
    compressor plus lightning indexer), any other positive ratio an HCA layer (non-overlapping, no indexer).
    A config that also sets `compress_rate_csa` (or `compress_rates`' CSA entry) moves CSA to that ratio."""
    if not isinstance(compress_ratios, (list, tuple)):
        raise ConfigError(f"compress_ratios must be a list of integers, got {compress_ratios!r}")
    bad = [r for r in compress_ratios if not _is_int(r) or r < 0]
    if bad:
        raise ConfigError(f"compress_ratios {list(compress_ratios)} has entries that are not integers >= 0: {bad} "
                          f"(0 = sliding window, {csa_rate} = CSA, any other positive ratio = HCA)")
    if len(compress_ratios) < n:
        raise ConfigError(f"compress_ratios lists {len(compress_ratios)} entries; the model has {n} layers")
    ratios = tuple(compress_ratios[:n])
    types = [SLIDING if r == 0 else CSA if r == csa_rate else HCA for r in ratios]
    return types, ratios


def config_from_dict(d: dict[str, Any]) -> Dsv4Config:
    """Build a validated config from a `config.json` dictionary (HF or legacy keys)."""
    n = int(_require(d, "num_hidden_layers", "n_layers"))
    hidden = int(_require(d, "hidden_size", "dim"))
    head_dim = int(_require(d, "head_dim"))
    heads = int(_require(d, "num_attention_heads", "n_heads"))
    rope_dim = _rope_head_dim(d, head_dim)
    layer_types, ratios = _layer_schedule(d, n, _compress_rates(d))
    mlp_types = _mlp_schedule(d, n)
    main_theta, compress_theta, yarn = _rope_settings(d)
    cfg = Dsv4Config(
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        layer_types=tuple(layer_types),
        compress_ratios=ratios,
        mlp_layer_types=tuple(mlp_types),
        rope_theta=main_theta,
        compress_rope_theta=compress_theta,
        compress_yarn=yarn,
        eos_token_id=_eos_token_id(d),
        **_plain_fields(d),
    )
    _validate(cfg)
    return cfg


def _rope_head_dim(d: dict[str, Any], head_dim: int) -> int:
    """The rotary dims per head: given outright (HF or official key), as a fraction of head_dim, or 64."""
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("rope_head_dim") is not None:
        rope_dim = int(d["rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(d["partial_rotary_factor"])))
    else:
        rope_dim = 64
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ConfigError(f"rope dims {rope_dim} must be even and within head_dim {head_dim}")
    return rope_dim


def _compress_rates(d: dict[str, Any]) -> dict[str, int]:
    """The compress rate of each compressed layer type: `compress_rates`, overridden by the flat
    `compress_rate_csa` / `compress_rate_hca`, defaulting to 4 (CSA) and 128 (HCA)."""
    rates = dict(d.get("compress_rates") or {})
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = d["compress_rate_hca"]
    rates.setdefault(CSA, 4)
    rates.setdefault(HCA, 128)
    for t in (CSA, HCA):
        if not (_is_int(rates[t]) and rates[t] > 0):
            raise ConfigError(f"the compress rate of {t} must be a positive integer, got {rates[t]!r}")
    return rates


def _layer_schedule(d: dict[str, Any], n: int, rates: dict[str, int]) -> tuple[list[str], tuple[int, ...]]:
    """(attention type, compress ratio) of each layer, from `layer_types` or the official
    `compress_ratios`; a config with neither is refused, never guessed."""
    if d.get("layer_types") is not None:  # transformers layout: one compress rate per layer type
        layer_types = list(d["layer_types"])[:n]
        if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
            raise ConfigError(f"layer_types must list {n} entries from {LAYER_TYPES}; got {layer_types}")
        return layer_types, tuple(0 if t == SLIDING else rates[t] for t in layer_types)
    if d.get("compress_ratios") is not None:  # official layout: one ratio per layer
        return _official_schedule(d["compress_ratios"], n, rates[CSA])
    raise ConfigError("config.json has neither `layer_types` nor `compress_ratios`; "
                      "kvfold takes the layer schedule from the config and will not guess it")


def _mlp_schedule(d: dict[str, Any], n: int) -> list[str]:
    """Each layer's MLP kind: `mlp_layer_types`, or the first `num_hash_layers` (default 3) hash-routed."""
    if d.get("mlp_layer_types") is not None:
        mlp_types = list(d["mlp_layer_types"])[:n]
    else:
        n_hash = int(d.get("num_hash_layers", d.get("n_hash_layers", 3)))
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if len(mlp_types) != n or any(t not in ("hash_moe", "moe") for t in mlp_types):
        raise ConfigError(f"mlp_layer_types must list {n} entries of hash_moe/moe; got {mlp_types}")
    return mlp_types


def _rope_settings(d: dict[str, Any]) -> tuple[float, float, YarnParams | None]:
    """(main rope theta, compressed layers' rope theta, their YaRN scaling) from nested
    `rope_parameters` (main / compress), flat `rope_parameters` / `rope_scaling`, or the official keys."""
    rope_params = d.get("rope_parameters") or {}
    if isinstance(rope_params.get("compress"), dict):
        compress_rp = rope_params["compress"]
        main_theta = float(rope_params.get("main", {}).get("rope_theta", d.get("rope_theta", 10000.0)))
        compress_theta = float(compress_rp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
    else:
        compress_rp = rope_params or d.get("rope_scaling")
        main_theta = float(d.get("rope_theta", 10000.0))
        compress_theta = float(d.get("compress_rope_theta", 160000.0))
    if not compress_rp and d.get("rope_factor") is not None and int(d.get("original_seq_len") or 0) > 0:
        # official keys: YaRN on the compressed layers when original_seq_len > 0 (REF precompute_freqs_cis)
        compress_rp = {"rope_type": "yarn", "factor": d["rope_factor"],
                       "original_max_position_embeddings": d["original_seq_len"],
                       "beta_fast": d.get("beta_fast"), "beta_slow": d.get("beta_slow")}
    return main_theta, compress_theta, _yarn_from(compress_rp)


def _eos_token_id(d: dict[str, Any]) -> int | tuple[int, ...] | None:
    eos = d.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = tuple(int(e) for e in eos)
    return eos


def _plain_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The fields read straight from one key (or its official alias), with the release's defaults.
    Read after the schedule and rope keys, so a config missing several keys is told about those first."""
    return dict(
        vocab_size=int(_require(d, "vocab_size")),
        q_lora_rank=int(_require(d, "q_lora_rank")),
        o_groups=int(_require(d, "o_groups")),
        o_lora_rank=int(_require(d, "o_lora_rank")),
        sliding_window=int(d.get("sliding_window", d.get("window_size", 128))),
        index_n_heads=int(d.get("index_n_heads", 64)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        n_routed_experts=int(_require(d, "n_routed_experts")),
        num_experts_per_tok=int(_require(d, "num_experts_per_tok", "n_activated_experts")),
        moe_intermediate_size=int(_require(d, "moe_intermediate_size", "moe_inter_dim")),
        n_shared_experts=int(d.get("n_shared_experts", 1)),
        scoring_func=str(d.get("scoring_func", d.get("score_func", "sqrtsoftplus"))),
        routed_scaling_factor=float(d.get("routed_scaling_factor", d.get("route_scale", 1.5))),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        rms_norm_eps=float(d.get("rms_norm_eps", d.get("norm_eps", 1e-6))),
        max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", d.get("n_mtp_layers", 0))),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id", 0),
    )


def _validate(c: Dsv4Config) -> None:
    problems = []
    if c.num_attention_heads % c.o_groups:
        problems.append(f"num_attention_heads {c.num_attention_heads} not divisible by o_groups {c.o_groups}")
    if c.index_head_dim < c.qk_rope_head_dim and CSA in c.layer_types:
        problems.append(f"index_head_dim {c.index_head_dim} smaller than rope dims {c.qk_rope_head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        problems.append("num_experts_per_tok exceeds n_routed_experts")
    if c.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        problems.append(f"scoring_func {c.scoring_func!r} is not one of sqrtsoftplus, sigmoid, softmax")
    if c.n_shared_experts not in (0, 1):
        problems.append(f"n_shared_experts={c.n_shared_experts}: only 0 or 1 shared expert is supported")
    if c.sliding_window < 1:
        problems.append("sliding_window must be >= 1")
    if len(c.compress_ratios) != len(c.layer_types) or any(
            not _is_int(r) or (r != 0 if t == SLIDING else r < 1) for t, r in zip(c.layer_types, c.compress_ratios)):
        problems.append(f"compress ratios {c.compress_ratios} must be 0 on sliding layers and a positive integer "
                        f"on compressed ones ({c.layer_types})")
    if problems:
        raise ConfigError("invalid DeepSeek-V4 config: " + "; ".join(problems))


def load_config(path: str | Path) -> Dsv4Config:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if p.is_dir() and not f.exists() and (p / "inference" / "config.json").exists():
        f = p / "inference" / "config.json"  # where the official release keeps its config
    if not f.exists():
        raise ConfigError(f"{f} not found: a checkpoint directory needs a config.json")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    return config_from_dict(d)

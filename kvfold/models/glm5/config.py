"""Parse and validate a GLM-5.3 (`glm5_next`) `config.json` into one frozen dataclass.

Accepts a text-only config (`model_type` "glm5_next_text") and a `Glm5NextForConditionalGeneration`
config (`model_type` "glm5_next", the text fields nested under `text_config`; the vision config is
ignored). Schedules are derived as transformers' `Glm5NextTextConfig` does:

* `layer_types`: default `i % 4 == 3` -> "indexed_attention" (MLA + DSA), else "linear_attention"
  (KDA); the alias "full_attention" reads as "indexed_attention";
* `mlp_layer_types`: default the first 3 "dense", the rest "sparse" (MoE);
* `indexer_types`: from `index_topk_pattern` (F/S) when given, else "full" iff
  max(i - offset + 1, 0) % freq == 0 (`index_topk_freq` 1, `index_skip_topk_offset` 2);
* `linear_attn_config` {head_dim, num_heads, short_conv_kernel_size, gate_lower_bound, safe_gate}
  overrides the `linear_*` fields.

`fp8_weight_block` reads a block-FP8 checkpoint's `quantization_config` (kept out of `Glm5Config`:
the weights' storage does not change the model, its states or its fingerprint).

Validation (HF `validate_architecture` plus what kvfold needs): index_kpool >= 1, index_topk a
multiple of it, q_lora_rank set, qk_rope_head_dim == 0 (NoPE), as many KV heads as heads, schedules
of num_hidden_layers known values, and a "full" DSA layer before any "shared" one (kvfold carries
the most recent full layer's selection across KDA layers; HF hands it only to the next layer).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError

KDA = "linear_attention"
DSA = "indexed_attention"


@dataclass(frozen=True)
class Glm5Config:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = 154820
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    attention_bias: bool = False

    # ---- derived ------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """No compressed attention in GLM-5.3 (0 per layer): what `kvfold inspect` prints."""
        return (0,) * self.num_hidden_layers

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DSA]

    @property
    def full_dsa_layers(self) -> list[int]:
        """DSA layers that run their own indexer (and own a Glm5NextDsaState)."""
        return [i for i in self.dsa_layers if self.indexer_types[i] == "full"]

    def fingerprint(self) -> str:
        """Hash of every field that shapes weights or state (states and snapshots are exchangeable
        between models of equal fingerprint)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()
        return "g5" + hashlib.sha256(blob).hexdigest()[:14]

    def to_hf_dict(self) -> dict[str, Any]:
        """A text-only `config.json` dictionary that `glm5_config_from_dict` reads back as this config."""
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}
        # transformers' glm5_next requires num_key_value_heads; GLM-5.3 has one per query head
        return {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next_text",
                "num_key_value_heads": self.num_attention_heads, **d}

    def problems(self) -> list[str]:
        out = []
        n = self.num_hidden_layers
        if self.index_kpool < 1:
            out.append(f"index_kpool must be >= 1, got {self.index_kpool}")
        elif self.index_topk < 1 or self.index_topk % self.index_kpool:
            out.append(f"index_topk ({self.index_topk}) must be a positive multiple of index_kpool "
                       f"({self.index_kpool})")
        if not self.q_lora_rank:
            out.append("q_lora_rank is required (DSA layers use the q LoRA path)")
        if self.qk_rope_head_dim != 0:
            out.append(f"qk_rope_head_dim must be 0 (GLM-5.3 DSA layers are NoPE), got {self.qk_rope_head_dim}")
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                out.append(f"{name} has {len(getattr(self, name))} entries for {n} layers")
        if bad := sorted(set(self.layer_types) - {KDA, DSA}):
            out.append(f"unknown layer_types {bad}")
        if bad := sorted(set(self.mlp_layer_types) - {"dense", "sparse"}):
            out.append(f"unknown mlp_layer_types {bad}")
        if bad := sorted(set(self.indexer_types) - {"full", "shared"}):
            out.append(f"unknown indexer_types {bad}")
        dsa = [i for i, t in enumerate(self.layer_types) if t == DSA]
        if dsa and len(self.indexer_types) == n and self.indexer_types[dsa[0]] != "full":
            out.append(f"DSA layer {dsa[0]} is 'shared' but no full DSA layer precedes it")
        if self.hidden_act != "silu":
            out.append(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.n_group < 1 or self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            out.append(f"n_routed_experts ({self.n_routed_experts}) must split into n_group ({self.n_group}) groups "
                       f"with 1 <= topk_group ({self.topk_group}) <= n_group")
        if "sparse" in self.mlp_layer_types and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            out.append(f"num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.n_routed_experts}]")
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult", "vocab_size",
                     "index_head_dim", "index_n_heads"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        return out


_FIELDS = {f.name for f in dataclasses.fields(Glm5Config)}


def text_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The text part of a config.json dict (nested `text_config` for ConditionalGeneration)."""
    if isinstance(d.get("text_config"), dict):
        return d["text_config"]
    return d


def glm5_config_from_dict(d: dict[str, Any]) -> Glm5Config:
    t = dict(text_config_dict(d))
    mt = t.get("model_type", d.get("model_type", "glm5_next_text"))
    if not str(mt).startswith("glm5_next"):
        raise ConfigError(f"not a glm5_next config (model_type {mt!r})")
    n = int(t.get("num_hidden_layers", Glm5Config.num_hidden_layers))
    lt = t.get("layer_types") or [KDA if i % 4 != 3 else DSA for i in range(n)]
    lt = tuple(DSA if x == "full_attention" else x for x in lt)
    mlt = t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    it = t.get("indexer_types")
    if it is None:
        pattern = t.get("index_topk_pattern")
        if pattern is not None:
            try:
                it = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
            except KeyError as e:
                raise ConfigError(f"index_topk_pattern {pattern!r}: unknown letter {e}") from None
        else:
            freq = max(int(t.get("index_topk_freq", 1) or 1), 1)
            off = int(t.get("index_skip_topk_offset", 2))
            it = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
    kw = {k: v for k, v in t.items() if k in _FIELDS}
    if "n_routed_experts" not in kw and "num_local_experts" in t:
        kw["n_routed_experts"] = t["num_local_experts"]
    lac = t.get("linear_attn_config")
    if isinstance(lac, dict):
        kw["linear_head_dim"] = lac.get("head_dim", kw.get("linear_head_dim", Glm5Config.linear_head_dim))
        kw["linear_num_heads"] = lac.get("num_heads", kw.get("linear_num_heads", Glm5Config.linear_num_heads))
        kw["linear_conv_kernel_dim"] = lac.get("short_conv_kernel_size",
                                               kw.get("linear_conv_kernel_dim", Glm5Config.linear_conv_kernel_dim))
        lb = lac.get("gate_lower_bound", kw.get("linear_lower_bound", Glm5Config.linear_lower_bound))
        if lac.get("safe_gate", True) and lb is None:
            lb = -5.0
        kw["linear_lower_bound"] = lb
    eos = kw.get("eos_token_id")
    if isinstance(eos, list):
        kw["eos_token_id"] = tuple(int(e) for e in eos)
    if kw.get("q_lora_rank") is None and "q_lora_rank" in t:
        kw["q_lora_rank"] = 0  # refused by validation below
    kw.update(num_hidden_layers=n, layer_types=tuple(lt), mlp_layer_types=tuple(mlt), indexer_types=tuple(it))
    if t.get("num_key_value_heads") not in (None, kw.get("num_attention_heads", Glm5Config.num_attention_heads)):
        raise ConfigError("invalid glm5_next config: num_key_value_heads must equal num_attention_heads")
    try:
        cfg = Glm5Config(**kw)
    except TypeError as e:
        raise ConfigError(f"invalid glm5_next config: {e}") from None
    if problems := cfg.problems():
        raise ConfigError("invalid glm5_next config: " + "; ".join(problems))
    return cfg


def fp8_weight_block(d: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 checkpoint's weight scales, from config.json's
    `quantization_config` (at the top level, where transformers writes it, or under `text_config`):
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [br, bc]}.
    None when the config declares no quantization; ConfigError for one kvfold cannot load."""
    q = d.get("quantization_config") or text_config_dict(d).get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config quant_method {q.get('quant_method')!r} is not supported: kvfold "
                          f"loads float and block-FP8 (quant_method 'fp8') glm5_next checkpoints")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config fmt {q['fmt']!r} is not supported: FP8 weights must be e4m3")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"quantization_config activation_scheme {q['activation_scheme']!r} is not supported: "
                          f"kvfold decodes FP8 weights and computes activations in the model dtype, so it cannot "
                          f"apply static activation scales; only 'dynamic' checkpoints load")
    block = q.get("weight_block_size")
    if block is None:
        raise ConfigError("quantization_config declares FP8 without weight_block_size: kvfold loads block-scaled "
                          "FP8 (a `weight_scale_inv` per [rows, cols] block) only, not per-tensor scales")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block):
        raise ConfigError(f"quantization_config weight_block_size must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def read_config_json(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise ConfigError(f"{f} not found: a checkpoint directory needs a config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None


def is_glm5_config(d: dict[str, Any]) -> bool:
    mt = str(d.get("model_type", ""))
    archs = d.get("architectures") or []
    return mt.startswith("glm5_next") or any(str(a).startswith("Glm5Next") for a in archs)


def load_glm5_config(path: str | Path) -> Glm5Config:
    return glm5_config_from_dict(read_config_json(path))

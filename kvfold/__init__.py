"""kvfold: an inference runtime for compressed- and sparse-attention LLMs with exact per-sequence state."""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import (CapacityError, CheckpointError, ConfigError, EngineError, FreedStateError, InvalidInputError,
                     InvalidRequestError, KvfoldError, PlacementError, QueueFullError, RequestTooLongError, RewindError,
                     SnapshotError, StateError, StateMismatchError)

from .decoding.generate import GenerationResult, generate
from .engine import AsyncEngine, Engine, RequestOutput, SamplingParams

__version__ = "0.1.0"


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
               placement=None, gpu_layers: int | str | None = None, gpu_experts: int | str | None = None,
               gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
               gpu_reserve_gib: float | None = None, expert_policy: str = "static", virtual_devices=None,
               max_seq_len: int | None = None, sequences: int | None = None, kv_dtype: str | None = None,
               expert_counts=None, **kwargs):
    """Load a model: a DeepSeek-V4 or GLM-5.3 checkpoint directory, "tiny" (the built-in small
    DeepSeek-V4 trained on Python's documentation, kvfold/assets/tiny) or "tiny-random" (random
    weights, byte-level tokenizer). Keyword options: `numerics` ("hf" | "reference") and `weights`
    ("dequant", the default, decodes FP8 / FP4 weights at load; "quantized" keeps them as stored and
    decodes per matmul: FP8 weights take ~1/4 of their fp32 bytes, FP4 experts ~1/7.5), and with
    "quantized" `dot` ("fp32", or "bf16": activations and weights rounded to bf16 in those matmuls,
    about twice the prefill speed on CPUs with AVX512-BF16; `CausalLM.set_dot`).

    Split across one accelerator and host memory (kvfold/load_placed.py; none of these: the whole
    model on `device`, as always): `placement` (a kvfold.placement.Placement, or an accelerate-style
    device map {"model.layers.0": 0, ..., "lm_head": 0}), or the flags `gpu_layers` (N | "auto":
    layers 0..N-1 on the card) and `gpu_experts` (K | "all" | "auto": routed experts 0..K-1 of each
    card layer there, the rest on the host). Budgets in GiB, measured when None: `gpu_memory_gib`
    (free card memory), `host_memory_gib` (MemAvailable), `gpu_reserve_gib` (kept back, default 2);
    they hold `sequences` (default 1) states of `max_seq_len` (default 4096) tokens in `kv_dtype`
    beside the weights. `expert_policy`: "static" | "lru". `expert_counts`: the routing counts
    (`kvfold calibrate-experts`) whose K most picked experts a static pack holds (None: the
    checkpoint's expert_counts.json where present; a path; False: experts 0..K-1). `virtual_devices`: a
    kvfold.layers.virtual_devices.VirtualDevices test mode (every device the CPU, each side
    checked), entered around this call and every call that runs the model. Refusals:
    PlacementError, saying what fits."""
    from .load_placed import PlacementRequest, load_placed
    request = PlacementRequest(placement, gpu_layers, gpu_experts, gpu_memory_gib, host_memory_gib, gpu_reserve_gib,
                               expert_policy, virtual_devices, max_seq_len, sequences, kv_dtype, expert_counts)
    return load_placed(path, device, dtype, request, **kwargs)


__all__ = ["load_model", "generate", "GenerationResult", "KvfoldError", "StateError", "CapacityError", "StateMismatchError",
           "FreedStateError", "RewindError", "ConfigError", "CheckpointError", "Engine", "AsyncEngine", "SamplingParams",
           "RequestOutput", "EngineError", "InvalidRequestError", "RequestTooLongError", "QueueFullError",
           "InvalidInputError", "SnapshotError", "PlacementError"]

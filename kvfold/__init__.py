"""kvfold: an inference runtime for compressed- and sparse-attention LLMs with exact per-sequence state."""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import (CapacityError, CheckpointError, ConfigError, EngineError, FreedStateError, InvalidInputError,
                     InvalidRequestError, KvfoldError, QueueFullError, RequestTooLongError, RewindError, SnapshotError,
                     StateError, StateMismatchError)

from .decoding.generate import GenerationResult, generate
from .engine import AsyncEngine, Engine, RequestOutput, SamplingParams

__version__ = "0.1.0"


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs):
    """Load a model: a DeepSeek-V4 or GLM-5.3 checkpoint directory, "tiny" (the built-in small
    DeepSeek-V4 trained on Python's documentation, kvfold/assets/tiny) or "tiny-random" (random
    weights, byte-level tokenizer). Keyword options: `numerics` ("hf" | "reference") and `weights`
    ("dequant", the default, decodes FP8 / FP4 weights at load; "quantized" keeps them as stored and
    decodes per matmul: FP8 weights take ~1/4 of their fp32 bytes, FP4 experts ~1/7.5)."""
    from .models.registry import load
    return load(path, device=device, dtype=dtype, **kwargs)


__all__ = ["load_model", "generate", "GenerationResult", "KvfoldError", "StateError", "CapacityError", "StateMismatchError",
           "FreedStateError", "RewindError", "ConfigError", "CheckpointError", "Engine", "AsyncEngine", "SamplingParams",
           "RequestOutput", "EngineError", "InvalidRequestError", "RequestTooLongError", "QueueFullError",
           "InvalidInputError", "SnapshotError"]

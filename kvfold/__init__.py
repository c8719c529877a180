"""kvfold: an inference runtime for compressed- and sparse-attention LLMs with exact per-sequence state."""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import (CapacityError, CheckpointError, ConfigError, EngineError, FreedStateError, InvalidRequestError,
                     KvfoldError, QueueFullError, RequestTooLongError, RewindError, StateError, StateMismatchError)

from .generate import GenerationResult, generate
from .engine import AsyncEngine, Engine, RequestOutput, SamplingParams

__version__ = "0.1.0"


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs):
    """Load a DeepSeek-V4 model: a transformers checkpoint directory, or "tiny" (built-in tiny
    random model with a byte-level tokenizer)."""
    from .models.loader import load
    return load(path, device=device, dtype=dtype, **kwargs)


__all__ = ["load_model", "generate", "GenerationResult", "KvfoldError", "StateError", "CapacityError", "StateMismatchError",
           "FreedStateError", "RewindError", "ConfigError", "CheckpointError", "Engine", "AsyncEngine", "SamplingParams",
           "RequestOutput", "EngineError", "InvalidRequestError", "RequestTooLongError", "QueueFullError"]

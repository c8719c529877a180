"""Serving engine: continuous batching, prefix cache and admission control over per-sequence states.

    engine = kvfold.Engine(model, max_seq_len=4096)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():        # RequestOutput: new_token_ids, new_text, finished, ...
            ...
"""
from .async_engine import AsyncEngine, RequestStream
from .engine import BLOCK, Completion, Engine
from .prefix_cache import PrefixCache, block_hashes
from .sequence import RequestOutput, SamplingParams

__all__ = ["Engine", "AsyncEngine", "RequestStream", "SamplingParams", "RequestOutput", "Completion", "PrefixCache", "block_hashes",
           "BLOCK"]

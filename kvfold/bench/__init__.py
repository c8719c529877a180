"""`kvfold bench`: throughput and memory of kvfold (optionally against transformers) on random
checkpoints. Importing this package does not import torch; the work happens in subprocesses."""
from __future__ import annotations

from .runner import add_bench_parser, run_bench

__all__ = ["add_bench_parser", "run_bench"]

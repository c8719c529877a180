"""Tensor and expert parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA)."""
from .group import TensorParallel, check_divides, local_expert, skips_shared_expert

__all__ = ["TensorParallel", "check_divides", "local_expert", "skips_shared_expert"]

import os

# Triton's interpreter (tests/test_triton_ops.py runs the Triton kernels on the CPU): triton.jit
# reads this when it decorates a kernel, so it is set before anything imports triton. The kernels
# stay off everywhere else (a model runs them only where its KernelSet turns them on: backend.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kvfold


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model (fp32, CPU)."""
    return kvfold.load_model("tiny-random")


# The suite's models are tiny: one thread avoids OpenMP oversubscription on shared CI cores
# (a decode step went from ~25 ms to 0.5 s with two threads fighting another process).
torch.set_num_threads(1)

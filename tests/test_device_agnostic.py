"""What a CUDA model needs of the torch path, held on the CPU: every tensor the forward, a batched
forward, a rewind and a snapshot's restore create is made on the model's device. A factory call
without `device=` (torch.tensor, arange, zeros, ...) makes a CPU tensor, which on a GPU model is a
device-mismatch error or a silent host round trip; a TorchFunctionMode sees each such call and the
kvfold line that made it. The sites that build on the CPU on purpose and move the result at once
are named below, as is the engine's token choice, which runs on the host."""
import collections
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvfold.numerics.backend import KernelSet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (the GPU run's tiny models: the same weights it copies to a device)

FACTORIES = {torch.tensor, torch.arange, torch.empty, torch.zeros, torch.ones, torch.full, torch.randn,
             torch.rand, torch.randint, torch.linspace, torch.eye, torch.as_tensor, torch.from_numpy,
             torch.empty_strided, torch.scalar_tensor}
# parsed on the host and then moved: the token ids a caller passes, a snapshot's bytes, a paged
# view's row table; and a dtype's element size read off an empty tensor
MOVED_AT_ONCE = {("models/base.py", "as_token_ids"), ("state/blob.py", "_section_rows"),
                 ("state/pages.py", "__init__"), ("state/kv_rows.py", "kv_row_bytes")}
# the engine chooses tokens on the host, from cpu_logits' copy (decoding/logits.py), by design
ON_THE_HOST = {("decoding/logits.py", "__init__"), ("decoding/sampling.py", "draw")}
# graph decode: a step's tokens, positions, slots and plans, gathered on the host (with the rows
# of padding) and copied into the graph's device inputs at once
GRAPH_INPUTS = {("engine/graphs.py", "step"), ("engine/graphs.py", "_padding")}


class DevicelessFactories(TorchFunctionMode):
    def __init__(self, allowed=MOVED_AT_ONCE):
        super().__init__()
        self.sites, self.allowed = collections.Counter(), allowed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = traceback.extract_stack(limit=2)[0]
            if "/kvfold/" in caller.filename:
                where = caller.filename.split("/kvfold/", 1)[1]
                if (where, caller.name) not in self.allowed:
                    self.sites[f"{where}:{caller.lineno} ({caller.name}) {func.__name__}"] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_the_torch_path_makes_every_tensor_on_the_model_s_device(family):
    model, _ = gpu_check.tiny_pair(family, torch.float32, torch.device("cpu"))
    model.set_batch_invariant(False)  # the numerics a GPU model runs: torch's kernels, no native.c
    model.set_kernels(KernelSet(native=False))
    ids = gpu_check.prompt(model, 90)
    lint = DevicelessFactories()
    with torch.inference_mode(), lint:
        st = model.new_state(capacity=160, max_rewind=4)
        model.forward(ids[:70], st)
        for t in ids[70:75]:
            model.forward([t], st)
        st.rewind_to(st.pos - 2)
        other = model.new_state(capacity=160, max_rewind=4)
        other.restore(st.snapshot())
        model.forward_batch([(ids[75:78], other), (ids[:9], model.new_state(capacity=32))])
    assert not lint.sites, "tensors made off the model's device: " + ", ".join(lint.sites)


def test_the_engine_drives_a_model_without_making_tensors_off_its_device():
    from kvfold import Engine, SamplingParams
    model, _ = gpu_check.tiny_pair("deepseek_v4", torch.float32, torch.device("cpu"))
    model.set_batch_invariant(False)
    model.set_kernels(KernelSet(native=False))
    lint = DevicelessFactories(MOVED_AT_ONCE | ON_THE_HOST)
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1), SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=2, logprobs=2, logit_bias={5: 2.0})]
    with lint:
        engine = Engine(model, max_seq_len=256, max_running=4, batch_invariant=False)
        outs = engine.generate([gpu_check.prompt(model, 20, seed) for seed in range(3)], params)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert not lint.sites, "tensors made off the model's device: " + ", ".join(lint.sites)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_graph_decode_makes_every_tensor_on_the_model_s_device(family):
    """The engine's graph decode (engine/graphs.py, models/*/graph_step.py): the arena, the
    buckets' inputs and every step, on the torch path a CUDA model takes."""
    from kvfold import Engine, SamplingParams
    model, _ = gpu_check.tiny_pair(family, torch.float32, torch.device("cpu"))
    model.set_batch_invariant(False)
    model.tokenizer = __import__("kvfold").load_model("tiny-random").tokenizer
    model.set_kernels(KernelSet(native=False))
    lint = DevicelessFactories(MOVED_AT_ONCE | ON_THE_HOST | GRAPH_INPUTS)
    with lint:
        engine = Engine(model, max_seq_len=256, max_running=3, batch_invariant=False, decode_graphs=True)
        outs = engine.generate([gpu_check.prompt(model, 20 + 7 * seed, seed) for seed in range(3)],
                               SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6, 6] and engine.metrics()["graph_steps"] >= 5
    assert not lint.sites, "tensors made off the model's device: " + ", ".join(lint.sites)

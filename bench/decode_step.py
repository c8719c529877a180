"""Time one batched decode step: 8 sequences (prompts of 64-71 tokens) advanced by one token each in
one `forward_batch` call, on the built-in tiny model in batch-invariant mode, one thread.

    .venv/bin/python bench/decode_step.py

Run it with PYTHONPATH pointing at another checkout to compare two commits side by side.
"""
import statistics
import time

import torch

import kvfold

torch.set_num_threads(1)
model = kvfold.load_model("tiny-random")
model.set_batch_invariant(True)
v = model.config.vocab_size
states = []
for i in range(8):
    st = model.new_state(capacity=400)
    model.forward(torch.randint(0, v, (64 + i,), generator=torch.Generator().manual_seed(i)), st, last_only=True)
    states.append(st)
times = []
for step in range(200):
    t0 = time.perf_counter()
    model.forward_batch([([(step + i) % v], st) for i, st in enumerate(states)])
    times.append(time.perf_counter() - t0)
times = sorted(times[20:])
print(f"8-row decode step: median {statistics.median(times) * 1e3:.2f} ms, "
      f"p10 {times[len(times) // 10] * 1e3:.2f} ms, p90 {times[9 * len(times) // 10] * 1e3:.2f} ms")

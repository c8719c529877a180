"""Graph decode's step on the CPU, where it runs eagerly, beside the forward's decode step, in one run:
8 sequences (prompts of 64-71 tokens) of the built-in tiny model advanced by one token each, one
thread, numerics as graph decode runs them (no batch-invariant mode; the forward keeps its native
decode rows). Alternating the two, 20 warm-up steps each, then 200 timed.

    .venv/bin/python bench/graph_decode_cpu.py

What it shows: on the CPU the capturable step is for tests, not for speed (docs/backends.md, "Graph decode").
"""
import statistics
import time

import torch

import kvfold
from kvfold.engine.graphs import DecodeGraphs

torch.set_num_threads(1)
model = kvfold.load_model("tiny-random")
model.set_batch_invariant(False)
v = model.config.vocab_size
pool = model.new_page_pool(8 * 4 + 1)  # 8 states of 4 pages, and the scratch page
arena = model.new_decode_arena(8, 400, pool)
graphs = DecodeGraphs(model, arena, 8)
in_arena, private = [], []
for i in range(8):
    ids = torch.randint(0, v, (64 + i,), generator=torch.Generator().manual_seed(i))
    for group, kw in ((in_arena, {"pages": pool, "arena": arena}), (private, {})):
        st = model.new_state(capacity=400, **kw)
        model.forward(ids, st, last_only=True)
        group.append(st)
times = {"forward": [], "graph step (eager)": []}
with torch.inference_mode():
    for step in range(220):
        tokens = [(step + i) % v for i in range(8)]
        t0 = time.perf_counter()
        model.forward_batch([([t], st) for t, st in zip(tokens, private)])
        t1 = time.perf_counter()
        graphs.step(list(zip(tokens, in_arena)))
        t2 = time.perf_counter()
        if step >= 20:
            times["forward"].append(t1 - t0)
            times["graph step (eager)"].append(t2 - t1)
med = {k: statistics.median(t) for k, t in times.items()}
for name, t in times.items():
    t = sorted(t)
    print(f"{name:20s} median {med[name] * 1e3:6.2f} ms  p10 {t[len(t) // 10] * 1e3:6.2f}  "
          f"p90 {t[9 * len(t) // 10] * 1e3:6.2f}")
print(f"graph step / forward: {med['graph step (eager)'] / med['forward']:.2f}x")

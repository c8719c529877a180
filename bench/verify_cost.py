"""What a verify step of T rows costs against a decode step, with its rows as decode rows
(`forward(..., decode_rows=True)`: plain decoding's bits) and as one chunk.

    .venv/bin/python bench/verify_cost.py MODEL THREADS [WEIGHTS] [ROUNDS]

WEIGHTS: load_model's `weights` ("quantized": FP8 / FP4 held as stored; default "dequant").
At a 512-token context, each round times 8 steps of every kind in turn (a decode step, then
verifies of T = 2..5 as decode rows and as one chunk; each verify is rewound), after 2 warm-up
rounds; a kind's cost in a round is its median step, and the table gives, per kind, the median
over rounds of its cost divided by that round's decode step (min-max in brackets), so slow and
fast phases of the machine hit every kind alike.
"""
import statistics
import sys
import time

import torch

import kvfold

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
m = kvfold.load_model(sys.argv[1] if len(sys.argv) > 1 else "tiny",
                      weights=sys.argv[3] if len(sys.argv) > 3 else "dequant")
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 12
ids = torch.randint(0, m.config.vocab_size, (520,), generator=torch.Generator().manual_seed(0)).tolist()
st = m.new_state(capacity=600, max_rewind=8)
m.forward(ids[:512], st, last_only=True)
kinds = [(1, False)] + [(t, rows) for t in (2, 3, 4, 5) for rows in (True, False)]


def step_ms(t: int, rows: bool) -> float:
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        m.forward(ids[512:512 + t], st, decode_rows=rows)
        times.append(time.perf_counter() - t0)
        st.rewind_to(512)
    return statistics.median(times) * 1e3


ratios = {k: [] for k in kinds}
decode = []
for r in range(rounds + 2):
    cost = {k: step_ms(*k) for k in kinds}
    if r >= 2:
        decode.append(cost[(1, False)])
        for k in kinds:
            ratios[k].append(cost[k] / cost[(1, False)])
print(f"decode step {statistics.median(decode):.2f} ms (min {min(decode):.2f}, max {max(decode):.2f}), "
      f"{rounds} rounds, {torch.get_num_threads()} threads")
for t in (2, 3, 4, 5):
    a, b = ratios[(t, True)], ratios[(t, False)]
    print(f"T={t}: decode rows {statistics.median(a):.2f}x ({min(a):.2f}-{max(a):.2f}), "
          f"one chunk {statistics.median(b):.2f}x ({min(b):.2f}-{max(b):.2f})")

"""What a verify step of T rows costs against a decode step, with its rows as decode rows
(`forward(..., decode_rows=True)`: plain decoding's bits) and as one chunk.

    .venv/bin/python bench/verify_cost.py MODEL THREADS

Median of 25 steps after 5 warm-up ones, at a 512-token context; each verify is rewound.
"""
import statistics, time, torch, kvfold, sys
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
m = kvfold.load_model(sys.argv[1] if len(sys.argv) > 1 else "tiny")
ids = torch.randint(0, m.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
def cost(T, rows):
    st = m.new_state(capacity=700, max_rewind=8)
    m.forward(ids, st, last_only=True)
    ts = []
    for i in range(30):
        t0 = time.perf_counter()
        if T == 1:
            m.forward(ids[i:i+1], st)
        else:
            m.forward(ids[i:i+T], st, decode_rows=rows)
            st.rewind_to(st.pos - T + 1)
        ts.append(time.perf_counter() - t0)
    st.free()
    return statistics.median(ts[5:]) * 1000
d = cost(1, False)
print(f"decode step {d:.2f} ms")
for T in (2, 3, 5):
    a, b = cost(T, True), cost(T, False)
    print(f"T={T}: decode rows {a:.2f} ms ({a/d:.2f}x), one chunk {b:.2f} ms ({b/d:.2f}x)")

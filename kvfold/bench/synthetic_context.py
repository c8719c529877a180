"""A state at position n without prefilling n tokens: for timing decode at long contexts.

Decode's work at position n depends on n, not on the values in the state: it reads the window
ring, the compressed pools up to n / ratio, and scores every indexer entry before its top-k
(GLM-5.3: the KDA recurrences, the MLA latent rows and the DSA keys up to n). So decode at 65,536
tokens can be timed without the prefill that would take most of an hour on a small CPU. The state
starts at n (`start_at`: its cursors as if n tokens had been fed), and every floating buffer
it holds is then filled with small random values, so no softmax, top-k or recurrence sees a
degenerate all-zero input; validity flags (uint8) are set. Index tensors (page maps) are left alone.

The logits of such a state are meaningless: this is for timing only, and the bench says so
(`--context-fill synthetic`).
"""
from __future__ import annotations

import torch


def fill(state, n: int, seed: int = 0, scale: float = 0.1) -> int:
    """Advance the fresh `state` to position n with random rows; returns the bytes written."""
    state.start_at(n)
    g = torch.Generator().manual_seed(seed)
    written = 0
    for t in _buffers(state.layers):
        if t.dtype.is_floating_point:
            t.copy_((torch.randn(t.shape, generator=g) * scale).to(t.dtype))
        elif t.dtype == torch.uint8:
            t.fill_(1)
        else:
            continue
        written += t.nbytes
    return written


def _buffers(obj, seen: set | None = None, depth: int = 0):
    """Each distinct tensor reachable from `obj` through lists, dicts and attributes (a state's
    layers), once; not into shared page pools (their rows are the pool's, filled through views)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.shape, obj.dtype)
        if key not in seen:
            seen.add(key)
            yield obj
        return
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return
    if getattr(obj, "holds_every_layer", False):
        return
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    for item in items:
        yield from _buffers(item, seen, depth + 1)

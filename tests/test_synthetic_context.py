"""`kvfold bench --context-fill synthetic` (kvfold/bench/synthetic_context.py): decode timed at a long
context from a state filled with random rows instead of a prefill. The fill must put the state at
the position, give every buffer decode reads non-degenerate values, leave index tensors alone, and
the bench must say the prefill was not timed and refuse peers it cannot compare."""
import json
import sys
from pathlib import Path

import pytest
import torch

from kvfold.bench import synthetic_context
from kvfold.bench.runner import build_parser, run_bench
from kvfold.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (both families' tiny models)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_a_filled_state_sits_at_the_position_and_decodes(family):
    _, model = gpu_check.tiny_pair(family, torch.float32, torch.device("cpu"))
    state = model.new_state(600, kv_dtype=None)
    pages_before = [t.clone() for t in synthetic_context._buffers(state.layers) if not t.dtype.is_floating_point
                    and t.dtype != torch.uint8]
    written = synthetic_context.fill(state, 512, seed=3)
    assert state.pos == state.written_until == 512 and written > 0
    buffers = list(synthetic_context._buffers(state.layers))
    assert all(t.float().abs().sum() > 0 for t in buffers if t.dtype.is_floating_point and t.numel())
    assert all(bool((t == 1).all()) for t in buffers if t.dtype == torch.uint8)
    after = [t for t in buffers if not t.dtype.is_floating_point and t.dtype != torch.uint8]
    assert all(torch.equal(a, b) for a, b in zip(pages_before, after))
    logits = model.forward([5], state)
    assert state.pos == 513 and torch.isfinite(logits).all()


def test_synthetic_context_reports_no_prefill_and_refuses_peers(tmp_path):
    out = tmp_path / "bench.json"
    args = build_parser().parse_args(["--config", "bench", "--contexts", "300", "--context-fill", "synthetic",
                                      "--decode-tokens", "4", "--warmup", "2", "--threads", "1",
                                      "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert run_bench(args, log=None) == 0
    result = json.loads(out.read_text())
    (cell,) = result["cells"]
    assert result["settings"]["context_fill"] == "synthetic" and cell["context_fill"] == "synthetic"
    assert cell["prefill_status"].startswith("not timed") and cell.get("prefill_tok_s") is None
    assert cell["decode_status"] == "ok" and cell["decode_tok_s"] > 0
    args = build_parser().parse_args(["--config", "bench", "--context-fill", "synthetic", "--vs", "transformers",
                                      "--cache-dir", str(tmp_path / "cache")])
    with pytest.raises(ConfigError, match="leave out --vs"):
        run_bench(args, log=None)

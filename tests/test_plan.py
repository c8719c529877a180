"""`kvfold plan`: per-rank sizes of the real DeepSeek-V4-Flash and GLM-5.3-Flash from their
config.json (copies in tests/data), checked against arithmetic written out here from the configs."""
import json
from pathlib import Path

import pytest

from kvfold import ConfigError, cli
from kvfold.plan import plan

DATA = Path(__file__).parent / "data"
V4 = json.loads((DATA / "deepseek_v4_flash_config.json").read_text())
GLM = json.loads((DATA / "glm5_3_flash_config.json").read_text())
L = 65536


def test_deepseek_v4_flash_by_hand():
    family, total, (r0,) = plan(V4, tp=1, weights="bf16", max_seq_len=L)
    assert family == "deepseek_v4" and round(total / 1e9) == 284  # "284B parameters"
    # routed experts: 43 layers x 256 experts x (gate, up, down) of 4096 x 2048
    experts = 43 * 256 * 3 * 4096 * 2048
    assert experts == 277_025_390_592
    _, _, (q0,) = plan(V4, tp=1, weights="fp4", max_seq_len=L)
    # fp4 keeps 0.53125 of the 2 bf16 bytes of every routed-expert value (this config declares no MTP block)
    assert r0.weight_bytes - q0.weight_bytes >= experts * (2 - 0.53125)
    # state: per token, 21 CSA layers hold a 512-wide entry and a 128-wide indexer key per 4
    # tokens, 20 HCA layers a 512-wide entry per 128 tokens, all bf16: 6880 B per token
    per_token = 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128
    assert per_token == 6880
    _, _, (long,) = plan(V4, tp=1, weights="bf16", max_seq_len=2 * L)
    assert long.state_bytes - r0.state_bytes == L * per_token
    # tp = 8: the experts and the split attention matrices divide by 8; rank 0 also holds the shared experts
    _, _, (a, b) = plan(V4, tp=8, weights="fp4", max_seq_len=L)
    shared = 43 * 3 * 4096 * 2048 * (1 + 4 / 128 ** 2)  # one per layer, fp8
    assert a.weight_bytes - b.weight_bytes == pytest.approx(shared, rel=1e-9)
    assert b.weight_bytes < q0.weight_bytes / 6 and a.state_bytes == r0.state_bytes  # V4's state is replicated
    assert a.fits == (80 * 2 ** 30 - a.weight_bytes) // a.state_bytes
    with pytest.raises(ConfigError, match=r"o_groups \(8\).*\[1, 2, 4, 8\]"):
        plan(V4, tp=16)


def test_glm5_3_flash_by_hand():
    family, total, (r0,) = plan(GLM, tp=1, weights="bf16", max_seq_len=L)
    assert family == "glm5_next"
    # state: 11 DSA layers x (512-wide bf16 latent + 513 indexer bytes) per token, and per pool of
    # 4 tokens a pooled bf16 key of 128 and its validity byte; 34 KDA layers of [64, 128, 128] fp32
    # plus 3 conv rows of 3 x 8192 bf16
    dsa = 11 * (1024 + 513) * L + 11 * (L // 4) * (128 * 2 + 1)
    assert r0.state_bytes == dsa + 34 * (64 * 128 * 128 * 4 + 3 * 3 * 8192 * 2)
    _, _, (a, b) = plan(GLM, tp=16, weights="fp8", max_seq_len=L)
    kda = 34 * (64 * 128 * 128 * 4 + 3 * 3 * 8192 * 2)
    assert b.state_bytes == dsa + kda // 16  # the KDA state splits with its heads
    # the 288 routed experts of the 42 MoE layers, fp8, a sixteenth of them per rank
    experts = 42 * 288 * 3 * 4096 * 2048
    assert b.weight_bytes > experts / 16 * (1 + 4 / 128 ** 2)
    _, _, (c,) = plan(GLM, tp=1, weights="fp8", max_seq_len=L)
    assert c.weight_bytes < r0.weight_bytes * 0.55  # fp8 experts and MLA, bf16 KDA and embeddings


def test_plan_cli_prints_a_row_per_rank_kind(capsys):
    assert cli.main(["plan", "--config", str(DATA / "glm5_3_flash_config.json"), "--tp", "8", "--weights", "fp8",
                     "--max-running", "4"]) == 0
    out = capsys.readouterr().out
    assert "| 0 |" in out and "| 1..7 |" in out and "max-running 4" in out
    assert cli.main(["plan", "--config", str(DATA / "deepseek_v4_flash_config.json"), "--tp", "3"]) == 2

"""Progress lines (kvfold/progress.py) on loading, converting and writing checkpoints: drawn on a
terminal only, counting bytes up to the total, silent with --quiet or on a pipe."""
from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
from kvfold import cli, progress
from kvfold.models.deepseek_v4.checkpoint import CheckpointReader, save_checkpoint, write_safetensors
from kvfold.models.deepseek_v4.convert import convert
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from kvfold.models.glm5.config import glm5_config_from_dict
from kvfold.models.glm5.model import Glm5Model
from kvfold.progress import ByteProgress, format_bytes, progress_line, quieted

from test_gpu_check import _script

GLM_TINY = _script().GLM_TINY  # bench/gpu_check.py's: every GLM-5.3 layer kind, a few KiB

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_LINE = re.compile(r"kvfold: (?P<label>[a-z ]+?) +(?P<pct>[\d.]+)% \((?P<done>[\d.]+) (?P<du>\w+) / "
                   r"(?P<total>[\d.]+) (?P<tu>\w+), [\d.]+ MiB/s\)")


class FakeTerminal(io.StringIO):
    """What a terminal looks like to kvfold: a stream whose isatty() is True."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """A terminal for sys.stderr (`with redirect_stderr(terminal)`, in the test's body: pytest's
    capture reinstalls its own stream between setup and call), every update drawn (no throttle)
    and every advance recorded as (label, bytes done, total)."""
    term = FakeTerminal()
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)
    term.advances = []
    advance = ByteProgress.advance

    def recording(self, nbytes):
        advance(self, nbytes)
        term.advances.append((self.label, self.done, self.total))
    monkeypatch.setattr(ByteProgress, "advance", recording)
    return term


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory):
    model = Dsv4Model(tiny_config())
    init_random_(model, 0)
    return save_checkpoint(model, tmp_path_factory.mktemp("dsv4"), progress=False)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    model = Glm5Model(glm5_config_from_dict(GLM_TINY))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p.data, std=0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(GLM_TINY))
    return d


def drawn(text: str, label: str) -> list[tuple[float, int, int]]:
    """(percent, bytes done, bytes in all) of each line drawn with `label`, as printed (2 decimals)."""
    out = []
    for m in _LINE.finditer(text):
        if m["label"] == label:
            out.append((float(m["pct"]), round(float(m["done"]) * _UNITS[m["du"]]),
                        round(float(m["total"]) * _UNITS[m["tu"]])))
    return out


def assert_counts_up_to(term: FakeTerminal, label: str, total: int) -> None:
    """Exact counts rise strictly to `total`; the printed lines rise too and end on 100%."""
    counts = [done for lab, done, t in term.advances if lab == label and t == total]
    assert counts and counts == sorted(set(counts)) and counts[-1] == total
    lines = drawn(term.getvalue(), label)
    assert len(lines) == len(counts)
    assert [done for _, done, _ in lines] == sorted(done for _, done, _ in lines)
    assert lines[-1][0] == 100.0 and lines[-1][1] == lines[-1][2]
    assert term.getvalue().endswith("\n") and "\r" in term.getvalue()


# ---- the line itself ---------------------------------------------------------------------------

def test_the_line_names_bytes_done_total_and_rate():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB" and format_bytes(3 << 30) == "3.00 GiB"
    line = progress_line("loading weights", 1 << 20, 4 << 20, 0.5)
    assert line == "kvfold: loading weights  25.0% (1.00 MiB / 4.00 MiB, 2.0 MiB/s)"
    assert "100.0%" in progress_line("x", 0, 0, 0.0)  # an empty job is done


def test_drawn_only_on_a_terminal_outside_quiet():
    for stream, quiet, want in ((FakeTerminal(), False, True), (io.StringIO(), False, False),
                                (FakeTerminal(), True, False)):
        with quieted(quiet):
            bar = ByteProgress(10, "job", stream=stream)
        bar.advance(10)
        bar.close()
        assert bool(stream.getvalue()) is want
    forced = io.StringIO()
    with quieted(), ByteProgress(4, "job", stream=forced, enabled=True) as bar:  # an API caller's explicit ask
        bar.advance(4)
    assert "100.0%" in forced.getvalue()


def test_the_throttle_leaves_the_last_count_drawn():
    clock = iter([0.0, 0.01, 0.02, 0.03]).__next__
    stream = FakeTerminal()
    with ByteProgress(100, "job", stream=stream, clock=clock) as bar:
        bar.advance(10)  # drawn: the first
        bar.advance(10)  # within the interval: not drawn, but close() draws it
    assert [done for _, done, _ in drawn(stream.getvalue(), "job")] == [10, 20]


def test_quieted_nests_and_restores():
    with quieted():
        with quieted(False):  # an inner False does not lift an outer quiet
            assert progress.is_quiet()
        assert progress.is_quiet()
    assert not progress.is_quiet()


# ---- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["dsv4", "glm"])
def test_loading_counts_the_checkpoint_bytes_up_to_its_total(family, dsv4_dir, glm_dir, terminal):
    d = dsv4_dir if family == "dsv4" else glm_dir
    with redirect_stderr(terminal):
        kvfold.load_model(d)
    assert_counts_up_to(terminal, "loading weights", CheckpointReader(d).total_bytes)


def test_converting_counts_the_source_bytes(dsv4_dir, tmp_path, terminal):
    with redirect_stderr(terminal):
        convert(dsv4_dir, tmp_path / "official", "official")
    assert_counts_up_to(terminal, "converting", CheckpointReader(dsv4_dir).total_bytes)


def test_writing_a_checkpoint_counts_its_tensor_bytes(tmp_path, terminal):
    model = Dsv4Model(tiny_config())
    init_random_(model, 1)
    with redirect_stderr(terminal):
        d = save_checkpoint(model, tmp_path / "written")
    assert_counts_up_to(terminal, "writing checkpoint", CheckpointReader(d).total_bytes)
    loaded = kvfold.load_model(d)  # the streamed file is a checkpoint like any other
    for name, t in model.state_dict().items():
        if not name.startswith("mtp."):
            assert torch.equal(loaded.state_dict()[name], t), name


def test_the_streamed_safetensors_file_reads_back_bit_for_bit(tmp_path):
    tensors = {"scalar": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.ones(0, 3),
               "ids": torch.arange(5), "mask": torch.tensor([True, False, True]), "f16": torch.randn(7).half(),
               "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn), "w": torch.randn(3, 5)}
    write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"}, progress=False)
    back = load_file(str(tmp_path / "t.safetensors"))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else back[k],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), k


def test_nothing_when_stderr_is_not_a_terminal(dsv4_dir, monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    kvfold.load_model(dsv4_dir)
    assert pipe.getvalue() == ""


# ---- --quiet -----------------------------------------------------------------------------------

def test_quiet_silences_the_commands_that_load_models(dsv4_dir, terminal):
    with redirect_stderr(terminal):
        assert cli.main(["inspect", str(dsv4_dir)]) == 0
    assert "loading weights" in terminal.getvalue()
    quiet = FakeTerminal()
    with redirect_stderr(quiet):
        assert cli.main(["inspect", str(dsv4_dir), "--quiet"]) == 0
    assert quiet.getvalue() == ""
    assert not progress.is_quiet()  # main restores it for whatever runs next in the process


def test_quiet_is_on_every_command_that_loads_or_writes_a_checkpoint():
    parser = cli._build_parser()
    for argv in (["generate", "--prompt", "x", "--max-new-tokens", "1"], ["inspect", "tiny"], ["eval-ppl", "--text", "f"],
                 ["serve"], ["convert", "a", "b", "--to", "hf"], ["bench"], ["bench", "serve"]):
        assert parser.parse_args(argv + ["--quiet"]).quiet is True, argv
        assert parser.parse_args(argv).quiet is False, argv
    assert parser.parse_args(["bench", "--quiet", "serve"]).quiet is True  # the mode keeps bench's

"""`generate` and the CLI against a fake model that follows the model contract exactly."""

import re
from types import SimpleNamespace

import pytest
import torch

import kvfold.cli as cli
from kvfold.models.base import Capabilities
from kvfold.errors import CapacityError, ConfigError, FreedStateError
from kvfold.decoding.generate import GenerationResult, generate
from kvfold.tokenizer import ByteTokenizer

from helpers import ops_for

EOS = 257
VOCAB = 258


class FakeState:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.pos = 0
        self.freed = False

    @property
    def nbytes(self) -> int:
        return 16 * self.capacity

    def free(self) -> None:
        self.freed = True


class FakeModel:
    """Next id is `last id + 1`, except that EOS follows byte `eos_after`; logits are one-hot-ish."""

    def __init__(self, eos_after: int | None = None, fail_at_pos: int | None = None, eos_config=EOS):
        self.device = torch.device("cpu")
        self.capabilities = Capabilities()
        self.config = SimpleNamespace(eos_token_id=eos_config)
        self.tokenizer = ByteTokenizer()
        self.eos_after = eos_after
        self.fail_at_pos = fail_at_pos
        self.states: list[FakeState] = []
        self.calls: list[list[int]] = []
        self.last_only: list[bool] = []

    def new_state(self, capacity: int) -> FakeState:
        self.states.append(FakeState(capacity))
        return self.states[-1]

    def forward(self, ids, state: FakeState, last_only: bool = False) -> torch.Tensor:
        ids = [int(i) for i in ids]
        if state.freed:
            raise FreedStateError("freed")
        if state.pos + len(ids) > state.capacity:
            raise CapacityError("full")
        if self.fail_at_pos is not None and state.pos >= self.fail_at_pos:
            raise RuntimeError("boom")
        self.calls.append(ids)
        self.last_only.append(last_only)
        logits = torch.zeros(len(ids), VOCAB)
        for t, i in enumerate(ids):
            nxt = EOS if i == self.eos_after else (i + 1) % 256
            logits[t, nxt] = 10.0
        state.pos += len(ids)
        return logits[-1:] if last_only else logits


def test_greedy_counts_calls_and_frees():
    model = FakeModel()
    seen = []
    res = generate(model, [256, 65, 66], 5, on_token=seen.append)
    assert isinstance(res, GenerationResult)
    assert res.tokens == [67, 68, 69, 70, 71] == seen
    assert res.prompt_tokens == 3
    # Prefill is one forward of the whole prompt; each later token one forward of one id;
    # the last chosen token is not fed back.
    assert model.calls == [[256, 65, 66], [67], [68], [69], [70]]
    (state,) = model.states
    assert state.capacity == 3 + 5
    assert state.freed
    assert res.state_bytes == 16 * 8
    assert res.prefill_seconds >= 0 and res.decode_seconds >= 0
    assert res.prefill_tok_s > 0 and res.decode_tok_s > 0


def test_prefill_asks_only_for_the_last_logits():
    model = FakeModel()
    generate(model, list(range(50)), 3)
    assert model.last_only == [True, False, False]  # a long prompt never makes T x vocab logits


def test_stops_at_eos_and_includes_it():
    model = FakeModel(eos_after=68)
    res = generate(model, [65], 50)
    assert res.tokens == [66, 67, 68, EOS]
    assert model.states[0].freed


def test_eos_list_in_config_and_stop_override():
    model = FakeModel(eos_after=66, eos_config=[1, EOS])
    assert generate(model, [65], 10).tokens == [66, EOS]
    # Explicit stop ids replace the config's EOS; an empty list never stops early.
    assert generate(model, [65], 3, stop_ids=[]).tokens == [66, EOS, 2]
    assert generate(model, [65], 10, stop_ids=[3]).tokens == [66, EOS, 2, 3]
    assert generate(FakeModel(eos_after=66, eos_config=None), [65], 3).tokens == [66, EOS, 2]


def test_tensor_prompt_and_explicit_capacity():
    model = FakeModel()
    res = generate(model, torch.tensor([10, 11]), 2, capacity=100)
    assert res.tokens == [12, 13]
    assert model.states[0].capacity == 100


def test_zero_new_tokens_still_prefills():
    model = FakeModel()
    res = generate(model, [1, 2, 3], 0)
    assert res.tokens == []
    assert model.calls == [[1, 2, 3]]
    assert res.decode_tok_s == 0.0
    assert model.states[0].freed


def test_state_freed_on_model_error():
    model = FakeModel(fail_at_pos=4)
    with pytest.raises(RuntimeError, match="boom"):
        generate(model, [1, 2], 10)
    assert model.states[0].freed


def test_state_freed_when_callback_raises():
    model = FakeModel()

    def stop(_tok):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, [1], 10, on_token=stop)
    assert model.states[0].freed


def test_too_small_capacity_surfaces_model_error():
    model = FakeModel()
    with pytest.raises(CapacityError):
        generate(model, [1, 2, 3], 5, capacity=4)
    assert model.states[0].freed


@pytest.mark.parametrize("prompt,n", [([], 4), ([1], -1)])
def test_bad_arguments(prompt, n):
    model = FakeModel()
    with pytest.raises(ValueError):
        generate(model, prompt, n)
    assert model.states == []  # rejected before any state was allocated


def test_seeded_sampling_reproducible_through_generate():
    class Noisy(FakeModel):
        def forward(self, ids, state, last_only=False):
            super().forward(ids, state)
            return torch.zeros(1 if last_only else len(ids), VOCAB)  # uniform: every draw is up to the seed

    runs = [generate(Noisy(), [1], 20, temperature=1.0, seed=s, stop_ids=[]).tokens for s in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# --- CLI ------------------------------------------------------------------------------------


SUMMARY = re.compile(
    r"^\[kvfold\] prompt (\d+) tok \| generated (\d+) tok \| prefill [\d.]+ tok/s"
    r" \| decode [\d.]+ tok/s \| state [\d.]+ MiB$"
)


def patch_loader(monkeypatch, model):
    loaded = []

    def fake_load(path, device, dtype):
        loaded.append((path, device, dtype))
        return model

    monkeypatch.setattr(cli, "_load_model", fake_load)
    return loaded


def test_cli_generate_streams_text_and_summary(monkeypatch, capsys):
    model = FakeModel(eos_after=ord("e"))
    loaded = patch_loader(monkeypatch, model)
    rc = cli.main(["generate", "--prompt", "ab", "--max-new-tokens", "10", "--dtype", "bfloat16"])
    assert rc == 0
    assert loaded == [("tiny", "cpu", torch.bfloat16)]
    assert model.calls[0] == [256, ord("a"), ord("b")]  # BOS prepended
    text, summary = capsys.readouterr().out.splitlines()
    assert text == "cde"  # EOS decodes to nothing
    m = SUMMARY.match(summary)
    assert m, summary
    assert m.groups() == ("3", "4")


def test_cli_generate_streams_multibyte_output(monkeypatch, capsys):
    class Euro(FakeModel):
        # Emits the three bytes of "€" then EOS, whatever the prompt.
        script = [0xE2, 0x82, 0xAC, EOS]

        def forward(self, ids, state, last_only=False):
            super().forward(ids, state)
            logits = torch.zeros(1 if last_only else len(ids), VOCAB)
            logits[-1, self.script[len(self.calls) - 1]] = 10.0
            return logits

    patch_loader(monkeypatch, Euro())
    rc = cli.main(["generate", "--prompt", "x", "--max-new-tokens", "8"])
    assert rc == 0
    assert capsys.readouterr().out.splitlines()[0] == "€"


def test_cli_kvfold_error_exits_2(monkeypatch, capsys):
    def broken(path, device, dtype):
        raise ConfigError("config.json lacks num_hidden_layers")

    monkeypatch.setattr(cli, "_load_model", broken)
    rc = cli.main(["generate", "--model", "/nowhere", "--prompt", "x", "--max-new-tokens", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: config.json lacks num_hidden_layers"


def test_cli_rejects_bad_numbers(capsys):
    for bad in (["--max-new-tokens", "-1"], ["--max-new-tokens", "1", "--top-p", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--prompt", "x", *bad])
        assert exc.value.code == 2


def test_cli_inspect(monkeypatch, capsys):
    model = FakeModel()
    model.config = SimpleNamespace(
        eos_token_id=EOS,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_ratios=[0, 4, 128],
        mlp_layer_types=["hash_moe", "moe", "moe"],
    )
    model.num_parameters = lambda: 1234567
    model.state_bytes_per_token = lambda kv_dtype=None: 48.0 if kv_dtype == "fp8" else 96.5
    model.fixed_state_bytes = lambda: 3 * 1024 * 1024
    model.dtype, model.numerics = torch.float32, "hf"
    model.backend = lambda: ops_for(native=False)
    patch_loader(monkeypatch, model)
    assert cli.main(["inspect", "tiny-random"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 1,234,567" in out
    assert re.search(r"^\s+0\s+sliding_attention\s+-\s+hash_moe$", out, re.M)
    assert re.search(r"^\s+1\s+compressed_sparse_attention\s+4\s+moe$", out, re.M)
    assert re.search(r"^\s+2\s+heavily_compressed_attention\s+128\s+moe$", out, re.M)
    assert "state per token: 96.5 B" in out
    assert "fixed state per sequence: 3.00 MiB" in out
    # 3 MiB + 96.5 B * 4096 = 3 MiB + 386 KiB
    assert "state at 4096 tokens: 3.38 MiB" in out
    assert re.search(r"^\s+rms_norm\s+torch \(.*\)\s+native.c is off", out, re.M)  # each op's kernel, and why


@pytest.mark.parametrize("kw", [dict(max_new_tokens=-1), dict(max_new_tokens=2.5), dict(temperature=float("inf")),
                                dict(temperature=-1.0), dict(top_p=0.0), dict(seed=1 << 64), dict(stop_ids=[-1]),
                                dict(stop_ids=["a"])])
def test_bad_sampling_arguments_are_refused_before_allocating(kw):
    model = FakeModel()
    args = {"max_new_tokens": 3, **kw}
    with pytest.raises(ValueError):
        generate(model, [65], args.pop("max_new_tokens"), **args)
    assert model.states == []

"""`kvfold.load_model` with a placement (kvfold/load_placed.py) and the flags `kvfold generate` and
`kvfold serve` take for it: on this CPU-only machine a placement runs under the VirtualDevices
test mode (every device the CPU, each op checked to run on its own side), so these tests show
that a split model computes the one-device model's bits and that every request that cannot run
is refused with a kvfold error saying what to do."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import kvfold
import kvfold.cli as cli
import kvfold.models.registry as registry
import kvfold.server as server
from kvfold.errors import ConfigError, KvfoldError, PlacementError
from kvfold.layers.virtual_devices import VirtualDevices
from kvfold.load_placed import PlacementRequest, _budget_gib, device_map_arg, placement_options
from kvfold.models.split_experts import SplitExperts
from kvfold.placement import GIB, HOST, Placement
from test_resident_quant import official_dir, original  # noqa: F401  (a V4 checkpoint in FP8 / FP4)

PROMPT_TOKENS, DECODE_STEPS = 40, 8
BUDGET = dict(gpu_memory_gib=3.0, host_memory_gib=4.0)  # 1 GiB of card after the 2 GiB reserve: tiny fits whole
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def plain():
    return kvfold.load_model("tiny")


@pytest.fixture(scope="module")
def prompt(plain):
    text = (registry.TINY_DIR / "heldout.txt").read_text()
    ids = [plain.tokenizer.bos_id] + plain.tokenizer.encode(text)[:PROMPT_TOKENS - 1]
    assert len(ids) == PROMPT_TOKENS
    return ids


def greedy(model, ids):
    """(tokens, logits of the prefill and of each decode step) for greedy decoding."""
    state = model.new_state(capacity=PROMPT_TOKENS + DECODE_STEPS + 1)
    try:
        logits = [model.forward(ids, state)]
        tokens = []
        for _ in range(DECODE_STEPS):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(model.forward([tokens[-1]], state))
        return tokens, logits
    finally:
        state.free()


def load_virtual(**options):
    vd = VirtualDevices()
    with vd:
        model = kvfold.load_model("tiny", virtual_devices=vd, **options)
    return model, vd


# ---- (a) the split model computes the one-device model's bits -------------------------------------
@pytest.mark.parametrize("policy", ["static", "lru"])
def test_flags_split_the_model_and_keep_its_bits(plain, prompt, policy):
    want_tokens, want_logits = greedy(plain, prompt)
    vd = VirtualDevices()
    with vd:
        model = kvfold.load_model("tiny", gpu_layers=3, gpu_experts=4, expert_policy=policy, virtual_devices=vd,
                                  **BUDGET)
        got_tokens, got_logits = greedy(model, prompt)
    p = model.devices.placement
    assert p.flags() == "--gpu-layers 3 --gpu-experts 4"
    assert (p.embed_device, p.head_device) == (HOST, "cuda:0")  # the head fits the card; the embedding stays
    layers = model.model.layers
    assert [vd.device_of(b.input_layernorm.weight) for b in layers] == ["cuda:0"] * 3 + [HOST] * 2
    assert [isinstance(b.mlp.experts, SplitExperts) for b in layers] == [True] * 3 + [False] * 2
    assert vd.checked > 1000  # the mode saw the forward
    assert got_tokens == want_tokens
    assert len(got_logits) == DECODE_STEPS + 1
    for got, want in zip(got_logits, want_logits):
        assert torch.equal(got, want)


# ---- (b) a device map, a Placement and the flags give one placement --------------------------------
HEAD_ON_CARD = {"model.embed_tokens": "cpu", "model.norm": 0, "model.hc_head": 0, "lm_head": 0, "mtp": 0}


@pytest.mark.parametrize("device_map, flags, words", [
    ({**HEAD_ON_CARD, **{f"model.layers.{i}": 0 if i < 3 else "cpu" for i in range(5)}},
     dict(gpu_layers=3, gpu_experts="all"), "--gpu-layers 3 --gpu-experts all"),
    ({**HEAD_ON_CARD, **{f"model.layers.{i}": "cuda:0" if i < 2 else "cpu" for i in range(5)},
      "model.layers.0.mlp.experts": "cpu", "model.layers.1.mlp.experts": "cpu"},
     dict(gpu_layers=2, gpu_experts=0), "--gpu-layers 2 --gpu-experts 0"),
])
def test_a_device_map_gives_the_placement_its_flags_give(device_map, flags, words):
    by_map, _ = load_virtual(placement=device_map, **BUDGET)
    by_flags, _ = load_virtual(**flags, **BUDGET)
    assert by_map.devices.placement == by_flags.devices.placement
    assert by_map.devices.placement.flags() == words
    by_object, _ = load_virtual(placement=by_flags.devices.placement, **BUDGET)
    assert by_object.devices.placement == by_flags.devices.placement


def test_without_placement_options_the_load_is_todays(monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "load", lambda path, **kw: calls.append((path, kw)) or "model")
    assert kvfold.load_model("tiny", weights="quantized") == "model"
    assert calls == [("tiny", {"device": "cpu", "dtype": torch.float32, "weights": "quantized"})]


def test_a_plain_load_is_not_placed():
    assert kvfold.load_model("tiny").devices is None


# ---- (c) refusals: a kvfold error that says what to do --------------------------------------------
def test_more_layers_or_experts_than_the_model_has_are_refused():
    with pytest.raises(PlacementError, match=r"has 5 layers: --gpu-layers takes 0\.\.5 or auto, got 6"):
        load_virtual(gpu_layers=6, **BUDGET)
    with pytest.raises(PlacementError, match=r"has 8 routed experts per MoE layer: --gpu-experts takes 0\.\.8"):
        load_virtual(gpu_layers=2, gpu_experts=9, **BUDGET)


def test_a_budget_too_small_is_refused_saying_what_fits():
    small = dict(gpu_memory_gib=0.005, gpu_reserve_gib=0.0, host_memory_gib=4.0)  # 5 MiB of card
    with pytest.raises(PlacementError, match="of accelerator memory") as err:
        load_virtual(gpu_layers=3, gpu_experts="all", **small)
    fits = re.search(r"what fits 1 sequence of 4096 tokens: --gpu-layers (\d+) --gpu-experts (\d+|all)",
                     str(err.value))
    assert fits, str(err.value)
    layers, experts = int(fits[1]), fits[2]
    assert (layers, experts) != (3, "all")
    model, _ = load_virtual(gpu_layers=layers, gpu_experts=experts, **small)  # what it says fits, loads
    assert model.devices.placement.gpu_layers == layers
    with pytest.raises(PlacementError, match="nothing fits"):
        load_virtual(gpu_layers=0, gpu_experts=0, gpu_memory_gib=0.005, gpu_reserve_gib=0.0, host_memory_gib=0.001)


def test_a_device_map_the_budget_cannot_hold_is_refused():
    whole_on_card = {"": 0}
    with pytest.raises(PlacementError, match="what fits"):
        load_virtual(placement=whole_on_card, gpu_memory_gib=0.005, gpu_reserve_gib=0.0, host_memory_gib=4.0)


@pytest.fixture
def no_load(monkeypatch):
    """The checkpoint must not load: these requests are refused before it."""
    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the request was refused")
    monkeypatch.setattr(registry, "load", refuse)


@no_cuda
@pytest.mark.parametrize("options", [dict(gpu_layers=2), dict(gpu_layers=2, gpu_memory_gib=8.0, host_memory_gib=8.0),
                                     dict(placement={"": 0}, gpu_memory_gib=8.0, host_memory_gib=8.0)])
def test_the_accelerator_without_cuda_is_refused_before_the_load(no_load, options):
    with pytest.raises(PlacementError, match=r"torch\.cuda\.is_available\(\) is False"):
        kvfold.load_model("tiny", **options)


@pytest.mark.parametrize("options, error, words", [
    (dict(device="cuda", gpu_layers=2, **BUDGET), PlacementError, "device='cuda' with a placement"),
    (dict(placement={"": 0}, gpu_layers=2, **BUDGET), PlacementError, "not both"),
    (dict(placement=[0, 0], **BUDGET), PlacementError, "placement must be"),
    (dict(gpu_layers=2, tp=2, **BUDGET), PlacementError, "tp=2 with a placement"),
    (dict(gpu_layers=2, expert_policy="fifo", **BUDGET), PlacementError, "expert_policy must be one of"),
    (dict(gpu_layers=2, gpu_memory_gib=-1.0, host_memory_gib=4.0), PlacementError, "must be >= 0"),
    (dict(expert_policy="lru"), ConfigError, "expert_policy applies only to a model split"),
    (dict(kv_dtype="fp8", sequences=2), ConfigError, "sequences, kv_dtype apply only"),
    # tiny's checkpoint is 18 MB (0.017 GiB): it loads whole on the host before it is split
    (dict(gpu_layers=0, gpu_experts=0, gpu_memory_gib=0.0, host_memory_gib=0.01), PlacementError,
     "files hold 0.02 GiB"),
])
def test_bad_requests_are_refused_before_the_load(no_load, options, error, words):
    with pytest.raises(error, match=words) as err:
        kvfold.load_model("tiny", **options)
    assert isinstance(err.value, KvfoldError)


def test_virtual_devices_must_be_entered_and_given_a_card(no_load):
    vd = VirtualDevices()
    with pytest.raises(PlacementError, match="must be entered"):
        kvfold.load_model("tiny", gpu_layers=2, virtual_devices=vd, **BUDGET)
    with vd, pytest.raises(PlacementError, match="no accelerator memory to measure"):
        kvfold.load_model("tiny", gpu_layers=2, virtual_devices=vd, host_memory_gib=4.0)
    with vd, pytest.raises(ConfigError, match="virtual_devices applies only"):
        kvfold.load_model("tiny", virtual_devices=vd)


def test_a_placement_made_for_another_model_is_refused():
    four = Placement(("cuda:0",) + (HOST,) * 3, (frozenset(range(8)),) + (frozenset(),) * 3, 8, HOST, HOST)
    with pytest.raises(PlacementError, match="the placement has 4 layers, the model 5"):
        load_virtual(placement=four, **BUDGET)


def test_unmeasured_budgets_come_from_the_card_and_meminfo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: seen.append(device) or (6 * GIB, 8 * GIB))
    gpu, host = _budget_gib(PlacementRequest(gpu_layers="auto"))
    assert (gpu, seen) == (6.0, [torch.device("cuda:0")])
    meminfo = open("/proc/meminfo").read()
    available = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)[1]) * 1024 / GIB
    assert 0 < host and abs(host - available) < 1.0  # read a moment apart
    assert _budget_gib(PlacementRequest(placement={"": 1}, host_memory_gib=2.0)) == (6.0, 2.0)
    assert seen[-1] == torch.device("cuda:1")


# ---- (d) the command line ---------------------------------------------------------------------------
GENERATE = ["generate", "--model", "tiny", "--prompt", "The with statement is used to", "--max-new-tokens", "8",
            "--temperature", "0"]
# --gpu-reserve-gib: the default 2 GiB reserve is more than a 1 GiB card
SPLIT = ["--gpu-layers", "3", "--gpu-experts", "4", "--gpu-memory-gib", "1", "--gpu-reserve-gib", "0.5",
         "--host-memory-gib", "4"]


def test_cli_generate_on_virtual_devices_prints_the_plain_text(capsys):
    assert cli.main(GENERATE) == 0
    plain = capsys.readouterr()
    assert cli.main(GENERATE + SPLIT + ["--virtual-devices"]) == 0
    placed = capsys.readouterr()
    text = plain.out.splitlines()[:-1]  # the last line is the timing summary
    assert text and "".join(text).strip()
    assert placed.out.splitlines()[:-1] == text
    assert "[kvfold] placement: --gpu-layers 3 --gpu-experts 4, embedding on cpu, head on cuda:0" in placed.err
    assert "virtual devices" in placed.err
    assert "placement" not in plain.err


@no_cuda
def test_cli_generate_placed_without_cuda_fails_clearly():
    run = subprocess.run([sys.executable, "-m", "kvfold", *GENERATE[:-4], "--max-new-tokens", "1", "--gpu-layers",
                          "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "torch.cuda.is_available() is False" in run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_cli_flags_absent_add_no_placement_options():
    args = cli._build_parser().parse_args(GENERATE)
    assert placement_options(args, max_seq_len=64) == {}
    args = cli._build_parser().parse_args(["serve"])
    assert server._placement_options(args) == {}


def test_cli_device_map_takes_json_or_a_file(tmp_path):
    path = tmp_path / "map.json"
    path.write_text('{"model.layers.0": 0, "": "cpu"}')
    args = cli._build_parser().parse_args(GENERATE + ["--device-map", str(path), "--gpu-memory-gib", "3"])
    options = placement_options(args, max_seq_len=64)
    assert options["placement"] == {"model.layers.0": 0, "": "cpu"}
    assert (options["gpu_memory_gib"], options["max_seq_len"]) == (3.0, 64)
    assert device_map_arg('{"lm_head": "cuda:0"}') == {"lm_head": "cuda:0"}
    for bad in ("[0]", "{not json", str(tmp_path / "missing.json")):
        with pytest.raises(Exception, match="device map"):
            device_map_arg(bad)


def test_a_served_split_model_answers_the_openai_client_as_the_plain_server():
    """serve --virtual-devices: the load and the engine's worker thread both run under the check,
    and a real client gets the one-device server's completion."""
    import openai
    from helpers import serving
    answers = []
    for extra in ([], ["--gpu-layers", "3", "--gpu-experts", "4", "--gpu-memory-gib", "3", "--host-memory-gib", "4",
                       "--virtual-devices"]):
        args = cli._build_parser().parse_args(["serve", "--max-seq-len", "256", "--max-running", "2", *extra])
        app = server.build_app(args)
        vd = app.state.engine.engine.model.devices.virtual if extra else None
        before = vd.checked if extra else 0
        with serving(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x")
            out = client.completions.create(model="tiny", prompt="The with statement", max_tokens=12, temperature=0)
            answers.append((out.choices[0].text, out.choices[0].finish_reason))
            metrics = client.get(url + "/metrics", cast_to=str) if extra else ""
        checked = vd.checked - before if extra else 0
    assert answers[0] == answers[1] and answers[1][1] == "length"
    assert checked > 1000  # the engine's thread ran the model under the check
    hits = next(line for line in metrics.splitlines() if line.startswith("kvfold_expert_card_hits_total "))
    assert float(hits.split()[1]) > 0


@no_cuda
def test_serve_placed_without_cuda_is_refused():
    args = cli._build_parser().parse_args(["serve", "--gpu-layers", "2"])
    with pytest.raises(PlacementError, match=r"torch\.cuda\.is_available\(\) is False"):
        server.build_engine(args)


def test_serve_with_a_host_only_placement_runs_and_says_so():
    """With no card memory `auto` keeps everything on the host: a real (not virtual) placed model
    the engine serves on this machine, and the banner names the placement."""
    args = cli._build_parser().parse_args(["serve", "--gpu-memory-gib", "0", "--host-memory-gib", "4",
                                           "--max-seq-len", "64", "--max-running", "2"])
    engine = server.build_engine(args)
    assert engine.model.devices.placement.flags() == "--gpu-layers 0 --gpu-experts 0"
    assert "  placement:    --gpu-layers 0 --gpu-experts 0, embedding on cpu, head on cpu" in \
        server.startup_banner(args, engine)
    ids = [engine.model.tokenizer.bos_id] + engine.model.tokenizer.encode("The with statement")
    engine.add_request(ids, kvfold.SamplingParams(max_tokens=4, temperature=0.0))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].finish_reason != "error", outputs[-1]


def test_a_checkpoint_held_as_stored_loads_split_with_the_plain_bits(official_dir):
    """FP8 / FP4 weights and the bf16 embedding kept as the release stores them (a BF16
    QuantizedWeight has an empty scale: its bytes count, its rows are a lookup)."""
    from kvfold.layers.basic import QuantizedWeight
    ids = list(range(3, 40))
    plain = kvfold.load_model(official_dir, weights="quantized")
    assert isinstance(plain.model.embed_tokens.weight, QuantizedWeight)
    want = plain.forward(ids, plain.new_state(64))
    vd = VirtualDevices()
    with vd:
        model = kvfold.load_model(official_dir, weights="quantized", gpu_layers=2, gpu_experts=2, **BUDGET,
                                  virtual_devices=vd)
        got = model.forward(ids, model.new_state(64))
    assert model.devices.placement.flags() == "--gpu-layers 2 --gpu-experts 2"
    assert torch.equal(got, want)

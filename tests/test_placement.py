"""Placement on one accelerator plus host memory (issue 46, the plan): flags and device maps to a
Placement (a device prefix of layers with their attention, state and shared expert; a partial pack
of routed experts per card layer), the refusals, `auto` against the byte counts of `kvfold plan`,
the decode estimate, and the CLI on the shipped DeepSeek-V4-Flash and GLM-5.3-Flash configs. Meta
device only: nothing is loaded."""
import json
import math
from pathlib import Path

import pytest
import torch

from kvfold import cli
from kvfold.errors import ConfigError, PlacementError
from kvfold.placement import (GIB, HOST, Budget, Placement, check_devices_exist, check_fits, fits, max_sequences,
                              solve, split)
from kvfold.plan import plan
from kvfold.plan_placement import HOST_CORE_GB_S, Rates, decode_seconds, model_sizes

CONFIGS = Path(__file__).resolve().parents[1] / "kvfold" / "assets" / "configs"
V4_PATH, GLM_PATH = CONFIGS / "deepseek_v4_flash.json", CONFIGS / "glm5_3_flash.json"
V4, GLM = json.loads(V4_PATH.read_text()), json.loads(GLM_PATH.read_text())
L = 65536


@pytest.fixture(scope="module")
def v4():
    return model_sizes(V4, weights="fp4", kv_dtype="fp8", max_seq_len=L)


@pytest.fixture(scope="module")
def glm():
    return model_sizes(GLM, weights="fp8", kv_dtype="fp8", max_seq_len=L)


def _card_need(sizes, n, k, head, sequences=1):
    return split(Placement.prefix(sizes, n, k, head), sizes)[0].need(sequences)


def test_sizes_by_hand(v4, glm):
    # a routed expert: gate, up and down of 4096 x 2048, FP4 with a scale per 32 values (0.53125 B each)
    assert v4.layers[3].expert.weights == 3 * 4096 * 2048 * 0.53125
    assert glm.layers[3].expert.weights == 3 * 4096 * 2048 * (1 + 4 / 128 ** 2)  # FP8, a scale per 128x128
    assert [layer.expert is None for layer in glm.layers[:4]] == [True, True, True, False]  # 3 dense layers
    assert len(v4.layers) == 43 and v4.n_experts == 256 and v4.top_k == 6
    assert len(glm.layers) == 45 and glm.n_experts == 288 and glm.top_k == 8
    assert v4.head_modules == ("model.norm", "model.hc_head", "lm_head")
    assert glm.head_modules == ("model.norm", "lm_head")
    # the embedding stays bf16 in both releases (a token reads one row of it), and so do V4's
    # compressor projections (fp32 in the model, bf16 in the release): none of them count as FP8
    assert v4.embed.weights == 129280 * 4096 * 2 and v4.embed.reads["bf16"] == 4096 * 2
    assert glm.embed.weights == 154880 * 4096 * 2
    hca = v4.layers[3]  # compress ratio 128: one compressor of 2 x [512, 4096], no indexer
    fp8_attention = (1024 * 4096 + 32768 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192) * (1 + 4 / 128 ** 2)
    assert hca.dense.reads["bf16"] == 2 * 512 * 4096 * 2
    assert hca.dense.reads["fp8"] == fp8_attention + 3 * 4096 * 2048 * (1 + 4 / 128 ** 2)  # and the shared expert


@pytest.mark.parametrize("which", ["v4", "glm"])
def test_the_split_adds_up_to_kvfold_plan(which, v4, glm):
    sizes, config, weights = (v4, V4, "fp4") if which == "v4" else (glm, GLM, "fp8")
    _, _, (whole,) = plan(config, tp=1, weights=weights, kv_dtype="fp8", max_seq_len=L)
    n_layers, e = len(sizes.layers), sizes.n_experts
    for n, k in ((0, 0), (5, 7), (20, e), (n_layers, 0), (n_layers, 100), (n_layers, e)):
        for head, embed in ((False, False), (True, False), (True, True)):
            acc, host = split(Placement.prefix(sizes, n, k, head, embed), sizes)
            assert math.ceil(acc.weights + host.weights) == whole.weight_bytes
            assert acc.state + host.state == whole.state_bytes
            assert (acc.state == 0) == (n == 0) and (host.state == 0) == (n == n_layers)
    # everything on the card: the card holds what `kvfold plan` counts, the host nothing
    acc, host = split(Placement.prefix(sizes, n_layers, e, True, True), sizes)
    assert math.ceil(acc.weights) == whole.weight_bytes and host.weights == 0 and host.read_bytes == 0


def test_flags_give_a_device_prefix_and_partial_packs(glm):
    p = Placement.from_flags(glm, 8, 5, 80, 400)
    assert p.layer_devices == ("cuda:0",) * 8 + (HOST,) * 37
    assert p.device_experts[:3] == (None,) * 3  # the dense layers
    assert all(s == frozenset(range(5)) for s in p.device_experts[3:8])  # experts 0..4 of each card layer
    assert all(s == frozenset() for s in p.device_experts[8:])  # host layers keep every expert on the host
    assert (p.gpu_layers, p.gpu_experts, p.partial_layers) == (8, 5, (3, 4, 5, 6, 7))
    assert (p.embed_device, p.head_device, p.flags()) == (HOST, "cuda:0", "--gpu-layers 8 --gpu-experts 5")
    # the flags as the command line gives them; `all` is every expert, and no layer is partial then
    assert Placement.from_flags(glm, "8", "5", 80, 400) == p
    whole_moe = Placement.from_flags(glm, 4, "all", 80, 400)
    assert whole_moe.device_experts[3] == frozenset(range(288)) and whole_moe.partial_layers == ()
    assert whole_moe.flags() == "--gpu-layers 4 --gpu-experts all"
    # no accelerator at all
    none = Placement.from_flags(glm, 0, 0, 0, 400)
    assert set(none.layer_devices) == {HOST} and none.head_device == HOST and not any(none.device_experts)


@pytest.mark.parametrize("which,gib", [("v4", 24), ("v4", 48), ("v4", 80), ("glm", 48), ("glm", 80)])
def test_auto_takes_every_layer_then_the_head_then_the_most_experts(which, gib, v4, glm):
    sizes = v4 if which == "v4" else glm
    budget = Budget.of(gib, 256)
    p = Placement.from_flags(sizes, "auto", "auto", gib, 256)
    n_layers = len(sizes.layers)
    assert (p.gpu_layers, p.head_device, p.embed_device) == (n_layers, "cuda:0", HOST)
    acc, host = split(p, sizes)
    assert acc.need(1) + 2 * GIB <= gib * GIB and host.need(1) <= 256 * GIB
    k = p.gpu_experts
    assert 0 < k < sizes.n_experts and p.partial_layers == tuple(i for i, layer in enumerate(sizes.layers)
                                                                 if layer.expert is not None)
    assert _card_need(sizes, n_layers, k + 1, True) > budget.accelerator  # one more expert per layer would not fit


def test_auto_on_a_card_too_small_for_every_layer(v4):
    budget = Budget.of(6, 256)  # 4 GiB for weights and state
    p = Placement.from_flags(v4, "auto", "auto", 6, 256)
    n = p.gpu_layers
    assert 0 < n < 43 and p.head_device == HOST and p.gpu_experts == 0
    assert _card_need(v4, n, 0, False) <= budget.accelerator < _card_need(v4, n + 1, 0, False)
    assert _card_need(v4, n, 0, True) > budget.accelerator  # the head comes after the layers, and did not fit
    assert _card_need(v4, n, 1, False) > budget.accelerator  # nor did one expert per layer
    # the head, if required, is placed first: fewer layers then
    with_head = Placement.from_flags(v4, "auto", "auto", 6, 256, head_on_accelerator=True)
    assert with_head.head_device == "cuda:0" and with_head.gpu_layers < n
    assert _card_need(v4, with_head.gpu_layers + 1, 0, True) > budget.accelerator


def test_the_whole_model_on_a_card_that_holds_it(v4):
    p = Placement.from_flags(v4, "auto", "auto", 200, 16)
    assert (p.gpu_layers, p.gpu_experts, p.flags()) == (43, 256, "--gpu-layers 43 --gpu-experts all")
    assert p.embed_device == p.head_device == "cuda:0" and p.partial_layers == ()
    assert p.crossings(v4.top_k) == 0 and split(p, v4)[1].weights == 0
    d = decode_seconds(p, v4, Rates(gpu_read_gb_s=1000))
    assert d["tok_s"] == pytest.approx(1000e9 / split(p, v4)[0].read_bytes)


def _host_pick_chance_by_hand(k_card: int, e: int, top_k: int) -> float:
    # the chance that all top_k distinct picks land among the card's k_card, one pick after another
    all_on_card = 1.0
    for i in range(top_k):
        all_on_card *= (k_card - i) / (e - i)
    return 1 - max(all_on_card, 0.0)


def test_decode_estimate_and_crossings(v4):
    k, e = v4.top_k, v4.n_experts
    host_only = Placement.from_flags(v4, 0, 0, 0, 256)
    assert host_only.crossings(k) == 0
    acc, host = split(host_only, v4)
    assert acc.read_bytes == 0
    experts = sum(layer.expert.weights for layer in v4.layers) * k  # top-k of each layer's experts
    hash_tables = 3 * (129280 * 6 * 8 - 6 * 8)  # layers 0..2 route by token: a token reads one int64 row
    dense = sum(layer.dense.weights for layer in v4.layers) - hash_tables
    assert host.read_bytes == pytest.approx(experts + dense + v4.head.weights + 4096 * 2, rel=1e-12)
    bound = decode_seconds(host_only, v4, Rates(host_read_gb_s=100, host_cores=10 ** 6))  # memory, not cores
    assert bound["host"] == pytest.approx(host.read_bytes / 100e9)
    cores = decode_seconds(host_only, v4, Rates(host_read_gb_s=10 ** 6, host_cores=1))
    per_format = sum(b / (HOST_CORE_GB_S[f] * 1e9) for f, b in host.reads.items())  # one core: its kernel rates
    assert cores["host"] == pytest.approx(per_format) and cores["host"] > 6 * bound["host"]
    # every layer's attention on the card, 200 experts of each: two boundaries (the embedding row to
    # the card, the sampled token back) and, per layer, a trip to the host and back when a pick misses
    p = Placement.prefix(v4, 43, 200, True)
    assert p.crossings(k) == pytest.approx(2 + 43 * 2 * _host_pick_chance_by_hand(200, e, k))
    assert Placement.prefix(v4, 43, 0, True).crossings(k) == 2 + 43 * 2  # no expert on the card: every token
    # a prefix of 6 whole layers: four boundaries (embedding -> layer 0, layer 5 -> 6, layer 42 -> head,
    # head -> embedding); with 250 experts of each, six trips with a small chance
    assert Placement.prefix(v4, 6, e, True).crossings(k) == 4
    assert Placement.prefix(v4, 6, 250, True).crossings(k) == pytest.approx(
        4 + 6 * 2 * _host_pick_chance_by_hand(250, e, k))
    acc, host = split(p, v4)
    dense_all = sum(sum(layer.dense.reads.values()) for layer in v4.layers)
    card_picks = 43 * k * (200 / e) * v4.layers[10].expert.weights  # a pick lands on the card with chance K/E
    assert acc.read_bytes == pytest.approx(dense_all + v4.head.weights + card_picks, rel=1e-12)
    assert host.read_bytes == pytest.approx(43 * k * (56 / e) * v4.layers[10].expert.weights + 4096 * 2, rel=1e-12)
    rates = Rates(gpu_read_gb_s=2000, host_read_gb_s=50, host_cores=1000, hop_us=30)
    d = decode_seconds(p, v4, rates)
    expected = acc.read_bytes / 2000e9 + host.read_bytes / 50e9 + p.crossings(k) * 30e-6
    assert d["tok_s"] == pytest.approx(1 / expected, rel=1e-12)


def test_refusals_say_what_fits(v4, glm):
    best24 = r"what fits 1 sequence of 65536 tokens: --gpu-layers 43 --gpu-experts 26 \(the head on the accelerator\)"
    with pytest.raises(PlacementError, match=r"43 layers: --gpu-layers takes 0\.\.43 or auto, got 44; " + best24):
        Placement.from_flags(v4, 44, 0, 24, 256)
    with pytest.raises(PlacementError, match=r"256 routed experts per MoE layer: --gpu-experts takes 0\.\.256, all "
                                             r"or auto, got 257; " + best24):
        Placement.from_flags(v4, 0, 257, 24, 256)
    with pytest.raises(PlacementError, match=r"--gpu-layers takes a count or auto, got 'all'"):
        Placement.from_flags(v4, "all", 0, 24, 256)
    with pytest.raises(PlacementError, match=r"--gpu-experts takes a count, all or auto, got 'most'"):
        Placement.from_flags(v4, 0, "most", 24, 256)
    # 27 experts fit beside the layers only without the head, which then stays on the host; 30 do not fit at all
    assert Placement.from_flags(v4, 43, 27, 24, 256).head_device == HOST
    with pytest.raises(PlacementError, match=r"--gpu-layers 43 --gpu-experts 30 \(the head on the host\) needs "
                                             r"24\.70 GiB of accelerator memory .* 24 GiB given; " + best24):
        Placement.from_flags(v4, 43, 30, 24, 256)
    with pytest.raises(PlacementError, match=r"--gpu-experts all \(the head on the host\) needs 145\.70 GiB"):
        Placement.from_flags(v4, 43, "all", 24, 256)
    with pytest.raises(PlacementError, match=r"cannot hold the state of even one sequence of 10000000 tokens; "
                                             r"what fits 1 sequence of 10000000 tokens: --gpu-layers 14"):
        Placement.from_flags(model_sizes(V4, "fp4", None, 10_000_000), 43, 0, 24, 256)
    with pytest.raises(PlacementError, match=r"weights leave room for 54 sequences"):
        Placement.from_flags(v4, 43, 0, 24, 256, sequences=1000)
    with pytest.raises(PlacementError, match=r"needs 138\.05 GiB of host memory .* 100 GiB given; nothing fits .*"
                                             r"the host part needs 124\.13 GiB, 100 GiB given"):
        Placement.from_flags(v4, 43, 0, 24, 100)
    with pytest.raises(PlacementError, match=r"--gpu-layers 0 --gpu-experts 0 \(the head on the accelerator\) needs "
                                             r"2\.99 GiB of accelerator memory"):
        Placement.from_flags(v4, 0, 0, 2.5, 256, head_on_accelerator=True)
    # GLM-5.3-Flash in FP8 (296 GiB) does not fit a 24 GiB card and 256 GiB of host memory
    with pytest.raises(PlacementError, match=r"nothing fits .*with the most the accelerator holds \(--gpu-layers 45 "
                                             r"--gpu-experts 9, the head on the accelerator\) the host part needs "
                                             r"275\.89 GiB, 256 GiB given"):
        Placement.from_flags(glm, "auto", "auto", 24, 256)
    with pytest.raises(PlacementError, match=r">= 0 GiB"):
        Budget.of(-1, 256)
    with pytest.raises(PlacementError, match=r"at least one sequence"):
        Budget.of(24, 256, sequences=0)
    assert issubclass(PlacementError, ConfigError)


def _v4_map(on_card: int, head=0, embed=0) -> dict:
    m = {"model.embed_tokens": embed, "model.norm": head, "model.hc_head": head, "lm_head": head}
    m.update({f"model.layers.{i}": 0 if i < on_card else "cpu" for i in range(43)})
    return m


def test_device_maps(v4, glm):
    p = Placement.from_device_map(_v4_map(10, head="cpu"), v4)
    assert (p.gpu_layers, p.gpu_experts, p.embed_device, p.head_device) == (10, 256, "cuda:0", HOST)
    assert p == Placement.prefix(v4, 10, 256, False, embed_on_accelerator=True)
    # llama.cpp's -ngl 99 --n-cpu-moe 99: every layer on the card, every layer's experts on the host
    experts_home = {f"model.layers.{i}.mlp.experts": "cpu" for i in range(43)}
    p = Placement.from_device_map({**_v4_map(43, embed="cpu"), **experts_home}, v4)
    assert p == Placement.prefix(v4, 43, 0, True) and p.flags() == "--gpu-layers 43 --gpu-experts 0"
    # one layer's experts on the host: a pack no one flag gives
    p = Placement.from_device_map({"": 0, "model.embed_tokens": "cpu", "model.layers.5.mlp.experts": "cpu"}, v4)
    assert p.gpu_experts is None and p.partial_layers == (5,) and "as a device map gave them" in p.flags()
    assert p.crossings(v4.top_k) == 2 + 2
    # a key covers the modules under it, the longest key wins
    p = Placement.from_device_map({"": "cpu", "model.layers.0": "cuda:1", "model.layers.1": 1, "model.norm": 1,
                                   "lm_head": "cuda:1"}, glm)
    assert (p.gpu_layers, p.accelerator, p.head_device, p.embed_device) == (2, "cuda:1", "cuda:1", HOST)
    assert p.device_experts[5] == frozenset() and p.gpu_experts == 0  # no card MoE layer (0 and 1 are dense)
    with pytest.raises(PlacementError, match=r"model\.norm, lm_head run as one head"):
        Placement.from_device_map({"": "cpu", "lm_head": 0}, glm)
    assert Placement.from_device_map({"": "cpu", "model.norm": 0, "lm_head": 0}, glm).head_device == "cuda:0"


def test_device_map_refusals(v4, glm):
    with pytest.raises(PlacementError, match=r"puts 'model\.layers\.3\.mlp\.experts' on cuda:0 but model\.layers\.3 "
                                             r"on cpu: a host layer runs all its routed experts on the host"):
        Placement.from_device_map({"": "cpu", "model.layers.3.mlp.experts": 0}, v4)
    with pytest.raises(PlacementError, match=r"'model\.layers\.3\.mlp\.experts\.gate_up_proj', a part of "
                                             r"'model\.layers\.3\.mlp\.experts'.*is --gpu-experts K"):
        Placement.from_device_map({**_v4_map(43), "model.layers.3.mlp.experts.gate_up_proj": "cpu"}, v4)
    for part in ("mlp", "self_attn", "mlp.shared_experts"):
        with pytest.raises(PlacementError, match=rf"'model\.layers\.3\.{part}', a part of 'model\.layers\.3'.*"
                                                 r"'model\.layers\.3\.mlp\.experts' to cpu"):
            Placement.from_device_map({**_v4_map(3), f"model.layers.3.{part}": "cpu"}, v4)
    with pytest.raises(PlacementError, match=r"model\.layers\.0 has a dense MLP, no routed experts"):
        Placement.from_device_map({"": 0, "model.layers.0.mlp.experts": "cpu"}, glm)
    with pytest.raises(PlacementError, match=r"names 'model\.layers\.43', which this model does not have; its modules "
                                             r"are model\.embed_tokens, model\.layers\.0\.\.model\.layers\.42, "
                                             r"model\.norm, model\.hc_head, lm_head"):
        Placement.from_device_map({**_v4_map(3), "model.layers.43": 0}, v4)
    with pytest.raises(PlacementError, match=r"names cuda:0, cuda:1: kvfold runs one accelerator"):
        Placement.from_device_map({**_v4_map(3), "model.layers.1": 1}, v4)
    with pytest.raises(PlacementError, match=r"prefix 0\.\.N-1, but the map puts layer 3 on cpu and layers \[5, 7\] "
                                             r"on cuda:0; fits the rule: --gpu-layers 3"):
        Placement.from_device_map({**_v4_map(3), "model.layers.5": 0, "model.layers.7": "cuda:0"}, v4)
    with pytest.raises(PlacementError, match=r"places no device for 'model\.layers\.42'"):
        Placement.from_device_map({k: v for k, v in _v4_map(3).items() if k != "model.layers.42"}, v4)
    with pytest.raises(PlacementError, match=r"on 'disk'.*no disk or meta offload"):
        Placement.from_device_map({**_v4_map(3), "lm_head": "disk"}, v4)


def test_a_device_map_that_does_not_fit_says_what_does(v4):
    whole_layers = Placement.from_device_map(_v4_map(20), v4)
    check_fits(Placement.from_device_map(_v4_map(3), v4), v4, Budget.of(24, 256))
    with pytest.raises(PlacementError, match=r"--gpu-layers 20 --gpu-experts all \(the head on the accelerator\) "
                                             r"needs \d+\.\d\d GiB of accelerator memory.*what fits 1 sequence of "
                                             r"65536 tokens: --gpu-layers 43 --gpu-experts 26"):
        check_fits(whole_layers, v4, Budget.of(24, 256))
    assert not fits(whole_layers, v4, Budget.of(24, 256)) and max_sequences(whole_layers, v4, Budget.of(24, 256)) == 0


def test_devices_must_exist_at_load(v4, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_devices_exist(Placement.from_flags(v4, 0, 0, 0, 256))  # all on the host: nothing to check
    with pytest.raises(PlacementError, match=r"on cuda:0, but torch\.cuda\.is_available\(\) is False.*"
                                             r"what fits: everything on the host"):
        check_devices_exist(Placement.from_flags(v4, 2, 0, 24, 256))
    with pytest.raises(PlacementError, match=r"is_available"):  # the head alone still needs the card
        check_devices_exist(Placement.prefix(v4, 0, 0, True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_devices_exist(Placement.from_flags(v4, 2, 0, 24, 256))
    with pytest.raises(PlacementError, match=r"names cuda:1, but this process sees 1 CUDA device\(s\): "
                                             r"cuda:0\.\.cuda:0"):
        check_devices_exist(Placement.from_device_map({"": "cpu", "model.layers.0": 1}, v4))


def test_placement_rules_hold_for_direct_construction(v4):
    p = Placement.prefix(v4, 4, 3, True)
    with pytest.raises(PlacementError, match=r"must be a prefix 0\.\.N-1; fits: --gpu-layers 4"):
        Placement(p.layer_devices[:5] + ("cuda:0",) + p.layer_devices[6:], p.device_experts, 256, HOST, HOST)
    with pytest.raises(PlacementError, match=r"expert ids must be in 0\.\.255"):
        Placement(p.layer_devices, p.device_experts[:1] + (frozenset({256}),) + p.device_experts[2:], 256, HOST, HOST)
    with pytest.raises(PlacementError, match=r"layers \[4, 9\] run on cpu but hold routed experts on cuda:0: a "
                                             r"partial expert pack belongs to a layer whose attention is on the card"):
        experts = list(p.device_experts)
        experts[4] = experts[9] = frozenset({0})
        Placement(p.layer_devices, tuple(experts), 256, HOST, HOST)
    with pytest.raises(PlacementError, match=r"neither the accelerator cuda:0 nor cpu"):
        Placement(p.layer_devices, p.device_experts, 256, "mps", HOST)
    assert solve(v4, Budget.of(0, 10)) is None


def _plan(capsys, config: Path, weights: str, *extra: str) -> tuple[int, str, str]:
    rc = cli.main(["plan", "--config", str(config), "--weights", weights, "--kv-dtype", "fp8", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


# (model, card GiB) -> --gpu-experts that auto picks with 256 GiB of host memory (the README's table;
# test_auto_takes_every_layer_then_the_head_then_the_most_experts shows why these are the most); the tok/s printed is
# decode_seconds' (checked by hand in test_decode_estimate_and_crossings)
EXPECTED = {("v4", "24"): 26, ("v4", "48"): 71, ("v4", "80"): 131, ("glm", "48"): 33, ("glm", "80"): 66}


@pytest.mark.parametrize("gib", ["24", "48", "80"])
def test_cli_prints_the_placement_for_both_releases(gib, capsys, v4, glm):
    for name, path, weights, sizes in (("v4", V4_PATH, "fp4", v4), ("glm", GLM_PATH, "fp8", glm)):
        rc, out, err = _plan(capsys, path, weights, "--gpu-memory-gib", gib, "--host-memory-gib", "256")
        if (name, gib) not in EXPECTED:
            assert rc == 2 and "nothing fits" in err and "host part needs 275.89 GiB" in err
            continue
        k = EXPECTED[name, gib]
        n, e = len(sizes.layers), sizes.n_experts
        moe = sum(layer.expert is not None for layer in sizes.layers)
        assert rc == 0, err
        assert f"| layers (attention, state, router, shared or dense MLP) | 0..{n - 1} ({n}) | none |" in out
        assert f"| routed experts | {k} of {e} in each of {moe} layers | {e - k} of {e} in each of {moe} card " \
               f"layers |" in out
        assert f"flags: --gpu-layers {n} --gpu-experts {k};" in out
        p = Placement.from_flags(sizes, n, k, float(gib), 256)
        acc, host = split(p, sizes)
        assert f"| weights | {acc.weights / GIB:.2f} GiB | {host.weights / GIB:.2f} GiB |" in out
        assert "| embedding, head | head | embedding |" in out
        assert f"expected decode: {decode_seconds(p, sizes, Rates())['tok_s']:.1f} tok/s" in out
        assert f"1 - C({k}, {sizes.top_k})/C({e}, {sizes.top_k})" in out and "no split model has run on a GPU yet" in out


def test_cli_flags_and_their_refusals(capsys):
    rc, out, _ = _plan(capsys, V4_PATH, "fp4", "--gpu-memory-gib", "80", "--host-memory-gib", "256",
                       "--gpu-layers", "2", "--gpu-experts", "all", "--max-running", "4", "--host-cores", "8")
    assert rc == 0 and "flags: --gpu-layers 2 --gpu-experts all;" in out and "4 sequences of 65536 tokens" in out
    assert "| routed experts | all 256 in each of 2 layers | all 256 in each of 41 host layers |" in out
    assert "min(8 cores x per-core rate, 200 GB/s)" in out and "no card layer has experts on the host" in out
    rc, _, err = _plan(capsys, V4_PATH, "fp4", "--gpu-memory-gib", "24")
    assert rc == 2 and "--gpu-memory-gib needs --host-memory-gib" in err
    rc, _, err = _plan(capsys, V4_PATH, "fp4", "--host-memory-gib", "24")
    assert rc == 2 and "goes with --gpu-memory-gib" in err
    rc, _, err = _plan(capsys, V4_PATH, "fp4", "--gpu-memory-gib", "24", "--host-memory-gib", "256", "--tp", "2")
    assert rc == 2 and "use --tp 1" in err
    rc, _, err = _plan(capsys, V4_PATH, "fp4", "--gpu-memory-gib", "24", "--host-memory-gib", "256",
                       "--gpu-layers", "50")
    assert rc == 2 and "got 50; what fits" in err
    with pytest.raises(SystemExit):  # argparse: --gpu-layers takes no `all`
        _plan(capsys, V4_PATH, "fp4", "--gpu-memory-gib", "24", "--host-memory-gib", "256", "--gpu-layers", "all")

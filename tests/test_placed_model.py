"""A model split across an accelerator and the host (models/placed.py), checked on the CPU: with
every device virtual (layers/virtual_devices.py) each part runs on the CPU, so a split model must
compute the one-device model's bits, and the test mode raises where a tensor crosses without a
hop, a layer's state lives on the wrong side or an expert runs on the wrong side."""
import sys
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.errors import PlacementError, StateMismatchError
from kvfold.layers.basic import QuantizedWeight
from kvfold.layers.virtual_devices import VirtualDeviceError, VirtualDevices
from kvfold.models import placed
from kvfold.models.split_experts import SplitExperts
from kvfold.placement import Placement
from kvfold.server.metrics import render

from helpers import random_ids
from test_glm5_mtp import mtp_pair  # noqa: F401  (a GLM-5.3 checkpoint with its MTP layer)
from test_official_checkpoint import IDS
from test_resident_quant import official_dir, original  # noqa: F401  (a V4 checkpoint in FP8 / FP4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (the GPU run's tiny GLM-5.3 model)

CARD = "cuda:0"


def placement(model, gpu_layers: int, gpu_experts: int, head: str = CARD, embed: str = "cpu") -> Placement:
    """Layers 0..gpu_layers-1 on the card holding experts 0..gpu_experts-1; the rest on the host."""
    n, e = model.config.num_hidden_layers, model.config.n_routed_experts
    moe = [getattr(b.mlp, "gate", None) is not None for b in model.model.layers]
    return Placement(tuple(CARD if i < gpu_layers else "cpu" for i in range(n)),
                     tuple((frozenset(range(gpu_experts if i < gpu_layers else 0)) if m else None)
                           for i, m in enumerate(moe)), e, embed, head)


def v4_pair():
    return kvfold.load_model("tiny"), kvfold.load_model("tiny")


def glm_pair():
    return gpu_check.tiny_pair("glm5_next", torch.float32, torch.device("cpu"))


def decode(model, state, ids, steps=6):
    """Logits of a prompt (prefill in two chunks) and then of `steps` greedy decode steps."""
    out = [model.forward(ids[:len(ids) // 2], state), model.forward(ids[len(ids) // 2:], state)]
    for _ in range(steps):
        out.append(model.forward([int(out[-1][-1].argmax())], state))
    return out


FAMILIES = {"deepseek_v4": v4_pair, "glm5_next": glm_pair}
# (gpu_layers, gpu_experts, head, embed): a prefix with partial packs; every layer with no expert
# on the card; the layers on the card and the head on the host; one layer on the card
SPLITS = [(3, 2, CARD, "cpu"), (5, 0, CARD, "cpu"), (2, 3, "cpu", CARD), (1, 1, CARD, CARD)]


@pytest.mark.exactness
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", SPLITS)
def test_a_split_model_computes_the_one_device_models_bits(family, split):
    ref, model = FAMILIES[family]()
    vd = VirtualDevices()
    ids = random_ids(50, model.config.vocab_size, seed=3)
    with vd:
        model.place(placement(model, *split), virtual=vd)
        got = decode(model, model.new_state(128), ids)
    want = decode(ref, ref.new_state(128), ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert vd.checked > 1000  # the mode saw the forward (every op of it, each checked)
    assert len(vd.tags) > 0


def _run_tiny(patch):
    ref, model = v4_pair()
    vd = VirtualDevices()
    with vd:
        model.place(placement(model, 3, 4), virtual=vd)
        patch(model)
        decode(model, model.new_state(128), random_ids(40, model.config.vocab_size, seed=1), steps=2)


def test_negative_control_a_missing_hop_is_caught():
    def no_hop(model):
        model.devices.hop = lambda x, name: x
    with pytest.raises(VirtualDeviceError, match="wrong side|hop is missing"):
        _run_tiny(no_hop)


def test_negative_control_state_on_the_wrong_side_is_caught():
    def wrong_state(model):
        tag = model._tag_layers
        model._tag_layers = lambda items, layer_of: tag(items, lambda key: 4)  # every layer's state on the host
    with pytest.raises(VirtualDeviceError):
        _run_tiny(wrong_state)


def test_negative_control_an_expert_on_the_wrong_side_is_caught():
    def host_experts_on_the_card(model):
        for m in model.modules():
            if isinstance(m, SplitExperts):  # the host's rows never cross: they run with the card's tensors
                m.devmap = placed.DeviceMap(m.devmap.placement, m.devmap.virtual)
                m.devmap.hop = lambda x, name: x
    with pytest.raises(VirtualDeviceError):
        _run_tiny(host_experts_on_the_card)


def test_state_lives_with_its_layer_and_a_foreign_device_set_is_refused_unchanged():
    ref, model = v4_pair()
    vd = VirtualDevices()
    ids = random_ids(30, model.config.vocab_size, seed=2)
    with vd:
        model.place(placement(model, 2, 4), virtual=vd)
        st = model.new_state(64)
        for i, layer in enumerate(st.layers):
            assert {vd.device_of(t) for t in (layer.window.store.data,)} == {CARD if i < 2 else "cpu"}
        assert st.dev_set == (CARD, CARD, "cpu", "cpu", "cpu")
        foreign = ref.new_state(64)
        ref.forward(ids, foreign)
        before = foreign.snapshot()
        with pytest.raises(StateMismatchError, match="device-layer set is fixed"):
            model.forward([5], foreign)
        with pytest.raises(StateMismatchError, match="device-layer set is fixed"):
            ref.forward([5], st)
        assert foreign.pos == len(ids) and foreign.snapshot() == before


@pytest.mark.parametrize("family", FAMILIES)
def test_snapshots_move_between_placements_bit_identically(family):
    ref, model = FAMILIES[family]()
    vd = VirtualDevices()
    ids = random_ids(45, model.config.vocab_size, seed=4)
    with vd:
        model.place(placement(model, 3, 2), virtual=vd)
        split = model.new_state(128)
        model.forward(ids, split)
        blob = split.snapshot()
        one = ref.new_state(128)
        one.restore(blob)  # split -> one device
        assert one.snapshot() == blob
        again = model.new_state(128)
        again.restore(one.snapshot())  # one device -> split
        a = [model.forward([7, 8, 9], again), model.forward([10], again)]
    b = [ref.forward([7, 8, 9], one), ref.forward([10], one)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_lru_packs_move_experts_and_change_no_bit():
    ref, model = v4_pair()
    vd = VirtualDevices()
    ids = random_ids(60, model.config.vocab_size, seed=6)
    with vd:
        model.place(placement(model, 5, 2), virtual=vd, expert_policy="lru")
        packs = [m for m in model.modules() if isinstance(m, SplitExperts)]
        start = [list(p.card_ids) for p in packs]
        st = model.new_state(128)
        got = [model.forward([t], st) for t in ids]
    st = ref.new_state(128)
    assert all(torch.equal(a, ref.forward([t], st)) for a, t in zip(got, ids))
    assert [p.card_ids for p in packs] != start  # experts moved onto the card
    hits, slots = model.expert_hits()
    assert slots == 60 * 5 * model.config.num_experts_per_tok and 0 < hits < slots


def test_bad_placements_are_refused_before_anything_moves():
    _, model = v4_pair()
    weight = model.model.layers[0].self_attn.kv_proj.weight
    with pytest.raises(PlacementError, match="torch.cuda.is_available"):  # no virtual devices, no CUDA here
        model.place(placement(model, 2, 4))
    other = placement(model, 2, 4)
    with pytest.raises(PlacementError, match="layers"):
        model.place(Placement(other.layer_devices[:4], other.device_experts[:4], 8, "cpu", CARD),
                    virtual=VirtualDevices())
    with pytest.raises(PlacementError, match="expert_policy"):
        model.place(other, virtual=VirtualDevices(), expert_policy="fifo")
    assert model.devices is None and model.model.layers[0].self_attn.kv_proj.weight is weight


@pytest.mark.exactness
@pytest.mark.parametrize("family", FAMILIES)
def test_an_engine_on_a_split_model_batches_hits_its_prefix_cache_and_speculates_as_on_one_device(family):
    ref, model = FAMILIES[family]()
    vocab = model.config.vocab_size
    long = random_ids(200, vocab, seed=8).tolist()
    prompts = [long, long[:140] + random_ids(9, vocab, seed=9).tolist(), random_ids(5, vocab, seed=10).tolist()]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    drafts = [{}, {"speculative": "ngram", "num_draft": 3}] + \
        ([{"speculative": "mtp", "num_draft": 2}] if model.supports_mtp else [])

    def outputs(m, **kw):
        engine = Engine(m, max_seq_len=512, **kw)
        engine.generate([long], greedy)  # fills the prefix cache
        out = [(c.token_ids, c.finish_reason) for c in engine.generate(prompts, greedy)]
        rids = engine.add_choices(prompts[2], [sampled] * 3)  # n = 3 from one prompt
        got = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out + [got[r] for r in rids], engine

    vd = VirtualDevices()
    with vd:
        model.place(placement(model, 3, 2), virtual=vd)
        for kw in drafts:
            got, engine = outputs(model, **kw)
            want, plain = outputs(ref, **kw)
            assert got == want and all(reason == "length" for _, reason in got[:3])
            m = engine.metrics()
            assert m["prefix_cache_hits"] == plain.metrics()["prefix_cache_hits"] > 0
            assert 0 < m["expert_card_hits"] < m["expert_routed_slots"]
            ratio = next(line for line in render(m).splitlines() if line.startswith("kvfold_expert_card_hit_ratio "))
            assert float(ratio.split()[1]) == pytest.approx(m["expert_card_hits"] / m["expert_routed_slots"])


@pytest.mark.exactness
def test_glm_mtp_speculation_on_a_split_model_decodes_as_on_one_device(mtp_pair):
    """GLM-5.3's MTP layer sits with the head; it reads the embedding from the host side."""
    *_, directory = mtp_pair
    ref, model = kvfold.load_model(directory), kvfold.load_model(directory)
    prompts = [random_ids(30, model.config.vocab_size, seed=s).tolist() for s in (1, 2)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    vd = VirtualDevices()
    with vd:
        model.place(placement(model, 2, 1), virtual=vd)
        engine = Engine(model, max_seq_len=256, speculative="mtp", num_draft=2)
        got = [c.token_ids for c in engine.generate(prompts, params)]
    want = [c.token_ids for c in Engine(ref, max_seq_len=256, speculative="mtp", num_draft=2).generate(prompts, params)]
    assert got == want and engine.metrics()["spec_draft_tokens"] > 0


@pytest.mark.exactness
@pytest.mark.parametrize("policy", ["static", "lru"])
def test_a_quantized_split_model_reads_its_host_experts_as_stored_with_the_one_device_bits(official_dir, monkeypatch,
                                                                                           policy):
    """FP8 / FP4 weights kept as the checkpoint stores them: a partial pack's experts on either side
    run through native.c on those bytes (nothing decoded into memory), with the one-device bits."""
    ref = kvfold.load_model(official_dir, weights="quantized")
    model = kvfold.load_model(official_dir, weights="quantized")
    ids = IDS[:40]
    want = decode(ref, ref.new_state(64), ids, steps=3)
    decoded = []
    real = QuantizedWeight.dequant
    monkeypatch.setattr(QuantizedWeight, "dequant", lambda self, *a, **k: decoded.append(self) or real(self, *a, **k))
    vd = VirtualDevices()
    with vd:
        model.place(placement(model, model.config.num_hidden_layers, 1), virtual=vd, expert_policy=policy)
        got = decode(model, model.new_state(64), ids, steps=3)
    packs = [m for m in model.modules() if isinstance(m, SplitExperts)]
    assert packs and all(isinstance(p.host.gate_up_proj, QuantizedWeight) for p in packs)
    assert decoded == [] and all(torch.equal(a, b) for a, b in zip(got, want))

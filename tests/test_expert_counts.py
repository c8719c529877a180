"""Routing counts over a calibration text (models/expert_counts.py, `kvfold calibrate-experts`) and
the partial packs they choose: each card layer holds the experts the text picked most."""
import json

import pytest
import torch

import kvfold
from kvfold.cli import main
from kvfold.errors import PlacementError
from kvfold.layers.virtual_devices import VirtualDevices
from kvfold.models import expert_counts
from kvfold.models.registry import TINY_DIR
from kvfold.models.split_experts import SplitExperts

from helpers import random_ids

TEXT = (TINY_DIR / "heldout.txt").read_text(encoding="utf-8")
HALF = len(TEXT) // 2
PLACED = dict(gpu_layers=5, gpu_experts=3, gpu_memory_gib=1.0, host_memory_gib=4.0, gpu_reserve_gib=0.0)


@pytest.fixture(scope="module")
def counts_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("counts")
    text = d / "calibration.txt"
    text.write_text(TEXT[:HALF], encoding="utf-8")
    assert main(["calibrate-experts", "--model", "tiny", "--text", str(text), "--out", str(d),
                 "--max-tokens", "2000"]) == 0
    return d


def test_counts_add_up_to_every_routed_pair(counts_dir):
    doc = json.loads((counts_dir / expert_counts.FILE).read_text())
    model = kvfold.load_model("tiny")
    assert doc["tokens"] == 2000 and set(doc["layers"]) == {"0", "1", "2", "3", "4"}
    assert all(sum(c) == 2000 * model.config.num_experts_per_tok for c in doc["layers"].values())


def _packs(model):
    return [m for m in model.modules() if isinstance(m, SplitExperts)]


def test_packs_hold_the_most_picked_experts_and_change_no_bit(counts_dir):
    counts = expert_counts.load(counts_dir, kvfold.load_model("tiny"))
    ref = kvfold.load_model("tiny")
    ids = random_ids(40, ref.config.vocab_size, seed=12)
    vd = VirtualDevices()
    with vd:
        model = kvfold.load_model("tiny", **PLACED, expert_counts=counts_dir / expert_counts.FILE, virtual_devices=vd)
        got = model.forward(ids, model.new_state(64))
    for pack, c in zip(_packs(model), counts):
        assert sorted(pack.card_ids) == sorted(expert_counts.top_experts(c, 3)) != [0, 1, 2]
    assert torch.equal(got, ref.forward(ids, ref.new_state(64)))


def test_calibrated_packs_serve_more_held_out_routing_than_the_first_experts(counts_dir):
    """Measured on the trained tiny's held-out text (bench/expert_hits.py has the full table): the
    counts come from the first half, the hits from the second."""
    held = kvfold.load_model("tiny").tokenizer.encode(TEXT[HALF:])[:1500]
    rates = {}
    for name, counts in (("first", False), ("calibrated", counts_dir / expert_counts.FILE)):
        vd = VirtualDevices()
        with vd:
            model = kvfold.load_model("tiny", **PLACED, expert_counts=counts, virtual_devices=vd)
            model.forward(held, model.new_state(len(held)))
        hits, slots = model.expert_hits()
        assert slots == len(held) * 5 * model.config.num_experts_per_tok
        rates[name] = hits / slots
    assert rates["calibrated"] > rates["first"]


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(fingerprint="0123456789abcdef"), "another model"),
    (lambda d: d["layers"]["2"].pop(), "must count"),
    (lambda d: d["layers"].pop("4"), "must count"),
    (lambda d: d.update(format="something"), "is not a"),
])
def test_counts_for_another_model_or_malformed_are_refused(counts_dir, tmp_path, change, match):
    doc = json.loads((counts_dir / expert_counts.FILE).read_text())
    change(doc)
    bad = tmp_path / expert_counts.FILE
    bad.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=match):
        expert_counts.load(bad, kvfold.load_model("tiny"))
    bad.write_text("{not json")
    with pytest.raises(PlacementError, match="cannot read"):
        expert_counts.load(bad, kvfold.load_model("tiny"))

"""The draft length chosen by measurement (decoding/draft_length.py, issue 45 item 3): each step
a sequence drafts the k (0 .. its most) with the most expected tokens per second, from its
measured acceptance per draft position and the measured cost of a step by its rows; k = 0 when
drafting does not pay; under load a verify's rows cost what they add to the step. Drafts never
change a token, so generate and the engine give plain greedy output whatever is chosen."""
import itertools
import random

import pytest

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.decoding import draft_length as dl
from kvfold.decoding.draft_length import Acceptance, StepCosts, plan_drafts


def costs(forward: dict[int, float], draft: dict[int, float] | None = None) -> StepCosts:
    c = StepCosts()
    for rows, s in forward.items():
        c.record_forward(rows, s)
    for k, s in (draft or {}).items():
        c.record_draft(k, s)
    return c


def accepting(rates: list[float], n: int = 40) -> Acceptance:
    """An Acceptance that measured these conditional rates over n verifies (exact fractions)."""
    acc = Acceptance(len(rates))
    acc.reached = [float(n)] * len(rates)
    acc.kept = [r * n for r in rates]
    return acc


def expected_rate(acc: Acceptance, c: StepCosts, k: int) -> float:
    """E(k) / cost(k) written out: 1 + sum of the products of the first j rates."""
    tokens = 1 + sum(acc.reach(k))
    return tokens / (c.forward_seconds(k + 1) + c.draft_seconds(k))


def test_no_drafts_where_a_verify_costs_what_its_rows_do():
    # compute-bound: T rows cost T decode steps, and no draft is always accepted
    c = costs({t: 0.01 * t for t in range(1, 6)})
    assert plan_drafts([(accepting([0.9, 0.9, 0.9, 0.9]), 4)], c) == [0]


def test_all_drafts_where_a_verify_costs_a_decode_step():
    # memory-bound: every row count costs the same, so every draft with a chance adds tokens free
    c = costs({t: 0.01 for t in range(1, 6)})
    assert plan_drafts([(accepting([0.5, 0.4, 0.3, 0.2]), 4)], c) == [4]


def test_one_sequence_gets_the_best_k_of_all():
    """For one sequence the plan is the argmax over k of E(k) / cost(k), found by trying every k."""
    rnd = random.Random(5)
    for _ in range(300):
        forward = dict(zip(range(1, 6), itertools.accumulate(rnd.uniform(0.0, 0.01) for _ in range(5))))
        forward = {t: 0.01 + s for t, s in forward.items()}
        draft = {k: rnd.uniform(0, 0.004) * k for k in range(1, 5)}
        c, acc = costs(forward, draft), accepting([rnd.uniform(0, 1) for _ in range(4)])
        rates = [expected_rate(acc, c, k) for k in range(5)]
        got = plan_drafts([(acc, 4)], c)[0]
        assert rates[got] == pytest.approx(max(rates), rel=1e-12)


def test_under_load_a_verify_costs_what_its_rows_add_to_the_step():
    # a step reads every weight once up to 8 rows (flat), then pays per row: 4 decoding
    # sequences leave 4 rows free, and drafts fill those, not more (a fifth row costs 1/8 of a
    # step and its gain, at these rates, is less than 1/8 of the step's 4+ tokens)
    c = costs({r: 0.008 * max(r, 8) for r in range(1, 30)})
    seqs = [(accepting([0.6, 0.6, 0.6, 0.6]), 4) for _ in range(4)]
    ks = plan_drafts(seqs, c)
    assert sum(ks) == 4
    alone = plan_drafts(seqs[:1], c)
    assert alone == [4]  # the same sequence alone drafts all it may: its rows are free
    # rows of other sequences count: with 8 other decode rows no draft is free, and none pays
    assert plan_drafts(seqs[:1], c, other_rows=8) == [0]


def test_nothing_is_drafted_before_a_plain_step_is_measured_then_sizes_are_tried_one_by_one():
    acc = accepting([0.7, 0.7, 0.7, 0.7])
    c = StepCosts()
    assert plan_drafts([(acc, 4)], c) == [0]
    # a step one row larger than any measured costs what the largest did (tried), larger ones in
    # proportion to their rows (not yet): where every size then measures flat, k grows a row a step
    for k in range(1, 5):
        c.record_forward(k, 0.01)
        assert plan_drafts([(acc, 4)], c) == [k]
    assert c.forward_seconds(5) == 0.01 and c.forward_seconds(8) == pytest.approx(0.01 * 8 / 4)
    c.record_forward(9, 0.03)
    assert c.forward_seconds(7) == pytest.approx(0.01 + 0.02 * 3 / 5)  # between measured sizes: linear


def test_an_idle_sequence_probes_and_the_wait_doubles_while_drafting_does_not_pay():
    c = costs({t: 0.01 * t for t in range(1, 6)})
    acc = accepting([0.9, 0.9, 0.9, 0.9])
    waits, probes, idle = [], [], 0
    for step in range(2000):
        (k,) = plan_drafts([(acc, 4)], c)
        acc.record(k, 0)
        if k:
            waits.append(idle)
            probes.append(k)
            idle = 0
        else:
            idle += 1
    assert set(probes) == {1}  # a probe drafts one token
    assert waits[:5] == [dl.PROBE_EVERY * 2 ** i for i in range(5)]
    assert max(waits) == dl.PROBE_MAX
    # a sequence at k = 0 is planned again every REPLAN steps; a plan that drafts resets the wait
    acc.idle = dl.REPLAN + 1
    assert plan_drafts([(acc, 4)], costs({t: 0.01 for t in range(1, 6)})) == [0]
    acc.idle = dl.REPLAN
    assert plan_drafts([(acc, 4)], costs({t: 0.01 for t in range(1, 6)})) == [4]
    assert acc.probe_every == dl.PROBE_EVERY


def test_acceptance_counts_positions_reached_and_forgets_slowly():
    acc = Acceptance(3)
    acc.record(3, 1)  # draft 1 kept, draft 2 reached and rejected, draft 3 never reached
    assert acc.reached == [1, 1, 0] and acc.kept == [1, 0, 0]
    assert acc.rate(2) == 0.5  # the prior where nothing was measured
    for _ in range(200):
        acc.record(3, 3)
    # the counts stay between MEMORY / 2 and MEMORY + 1; the prior's one rejection (of the + 2)
    # and the early one (halved at every trim) together weigh under 2 / (MEMORY / 2)
    assert dl.MEMORY / 2 <= acc.reached[0] <= dl.MEMORY + 1 and acc.rate(0) > 1 - 2 / (dl.MEMORY / 2)


def test_generate_adapts_and_keeps_plain_greedy_output(monkeypatch):
    """With frozen costs: where a verify is as cheap as a decode step generate drafts every step;
    where it costs its rows it drafts only to probe; the tokens are plain greedy decoding's."""
    model = kvfold.load_model("tiny")
    prompt = model.tokenizer.encode("The engine keeps one state per sequence and")
    plain = kvfold.generate(model, prompt, 40, ignore_eos=True).tokens

    class Frozen(StepCosts):
        def record_forward(self, rows, seconds):
            pass

        def record_draft(self, k, seconds):
            pass

    for forward, drafts_often in (({t: 0.01 for t in range(1, 6)}, True), ({t: 0.01 * t for t in range(1, 6)}, False)):
        frozen = Frozen()
        frozen.forward = dict(forward)
        monkeypatch.setattr("kvfold.decoding.generate.shared_costs", lambda *a: frozen)
        monkeypatch.setattr("kvfold.decoding.generate.shared_acceptance", lambda *a: Acceptance(4))
        r = kvfold.generate(model, prompt, 40, speculative="mtp", num_draft=4, adaptive_draft=True,
                            ignore_eos=True)
        assert r.tokens == plain
        if drafts_often:  # every step drafts its 4, but the last few (max_new_tokens bounds them)
            assert r.drafted >= 4 * (r.verify_steps - 4)
        else:  # probes only: one in the first PROBE_EVERY + 1 steps
            assert r.drafted == 1


def test_the_engine_plans_each_step_and_keeps_plain_greedy_output():
    model = kvfold.load_model("tiny")
    prompts = [model.tokenizer.encode(t) for t in ("The engine keeps", "A state is explicit data and", "Snapshots")]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def run(engine):
        outs = {engine.add_request(p, params): [] for p in prompts}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
        return list(outs.values())

    plain = run(Engine(model, max_seq_len=256))
    engine = Engine(model, max_seq_len=256, speculative="mtp", num_draft=3, adaptive_draft=True)
    assert run(engine) == plain
    spec = engine.spec
    assert spec.costs.forward  # steps were timed by their rows
    assert 1 in spec.costs.forward or 3 in spec.costs.forward
    fixed = Engine(model, max_seq_len=256, speculative="mtp", num_draft=3)
    assert run(fixed) == plain
    assert fixed.spec.costs is None and fixed.spec.drafted >= 3 * 20  # every step drafts its 3

"""Speculative decoding in the engine (kvfold/engine/speculation.py): every decoding sequence drafts
(n-gram or the checkpoint's MTP layer) and verifies in the batched step. Drafts change speed only:
outputs equal those of the same engine without speculation, request by request, batched."""
import openai
import pytest

import kvfold
from kvfold import Engine, SamplingParams
from kvfold.decoding import drafters
from kvfold.errors import MtpUnavailableError
from kvfold.server.app import create_app

from bounds import log_softmax_rounding
from helpers import fp32_paths_bound, serving

PROMPTS = ["The with statement is used to", "Return the number of items in a container.",
           "abab abab abab abab", "x"]


@pytest.fixture(scope="module")
def trained():
    """The built-in trained model: its MTP block is accepted often enough to exercise acceptance."""
    return kvfold.load_model("tiny")


def ids_of(model, text):
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def run(model, prompts, params, **kw):
    engine = Engine(model, max_seq_len=512, **kw)
    out = engine.generate(prompts, params)
    m = engine.metrics()
    assert m["live_states"] == 0 and m["running"] == 0
    return out, engine


def same(a, b):
    return [(c.token_ids, c.text, c.finish_reason) for c in a] == [(c.token_ids, c.text, c.finish_reason) for c in b]


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_engine_greedy_equals_the_plain_engine(trained, kind, k, monkeypatch):
    closed = []
    real_close = drafters.MtpDrafter.close
    monkeypatch.setattr(drafters.MtpDrafter, "close", lambda self: (closed.append(self), real_close(self)))
    prompts = [ids_of(trained, t) for t in PROMPTS]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = run(trained, prompts, params)
    spec, engine = run(trained, prompts, params, speculative=kind, num_draft=k)
    assert same(spec, plain)
    m = engine.metrics()
    assert m["spec_draft_tokens"] > 0 and 0 < m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
    assert m["generation_tokens"] == 24 * len(prompts)
    # fewer steps than tokens: accepted drafts came out of the verify rows
    assert m["steps"] < sum(len(p) // 128 + 24 for p in prompts)
    assert engine.spec.dropped == 0
    assert len(closed) == (len(prompts) if kind == "mtp" else 0)  # every MTP drafter's state was freed


def test_long_prompts_prefix_hits_and_choices_under_speculation(trained):
    """Prefill in 128-token chunks feeds the MTP drafter chunk by chunk; a prefix-cache hit and the
    further choices of n > 1 start their drafters where their sequence starts computing."""
    text = " ".join(f"Item {i}: a context manager defines __enter__ and __exit__." for i in range(30))
    long = ids_of(trained, text)[:300]
    prompts = [long, long[:200] + ids_of(trained, "The with statement")[1:]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = Engine(trained, max_seq_len=512)
    spec = Engine(trained, max_seq_len=512, speculative="mtp", num_draft=2)
    for engine in (plain, spec):
        engine.generate([long], params)  # fills the prefix cache
    assert same(spec.generate(prompts, params), plain.generate(prompts, params))
    assert spec.metrics()["prefix_cache_hits"] == plain.metrics()["prefix_cache_hits"] > 0
    outs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        rids = engine.add_choices(ids_of(trained, "Return the"), [params] * 3)
        got = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs[name] = [got[r] for r in rids]
    assert outs["spec"] == outs["plain"] and len(set(map(tuple, outs["spec"]))) == 1


def test_logprobs_stop_strings_and_lengths_follow_the_plain_engine(trained):
    prompts = [ids_of(trained, t) for t in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=20, logprobs=2), SamplingParams(max_tokens=30, stop=[" the"]),
              SamplingParams(max_tokens=5)]
    results = {}
    for name, kw in (("plain", {}), ("spec", dict(speculative="ngram", num_draft=3))):
        engine = Engine(trained, max_seq_len=512, **kw)
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs = {r: [] for r in rids}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id].append(o)
        results[name] = [outs[r] for r in rids]
    for a, b in zip(results["plain"], results["spec"]):
        toks = [[t for o in x for t in o.new_token_ids] for x in (a, b)]
        assert toks[0] == toks[1]
        assert "".join(o.new_text for o in a) == "".join(o.new_text for o in b)
        assert a[-1].finish_reason == b[-1].finish_reason
    lp_plain = [lp for o in results["plain"][0] for lp in o.logprobs]
    lp_spec = [lp for o in results["spec"][0] for lp in o.logprobs]
    assert len(lp_spec) == len(lp_plain) == 20
    # verify rows and one-token rows: two fp32 paths to the same logits (helpers.fp32_paths_bound),
    # which move a logprob x_t - logsumexp(x) by at most twice as much, plus each side's own
    # log_softmax rounding; the logits' scale from a plain forward over the same tokens
    toks = [t for o in results["plain"][0] for t in o.new_token_ids]
    logits = trained.forward(prompts[0] + toks[:-1], trained.new_state(capacity=len(prompts[0]) + len(toks)))
    bound = 2 * fp32_paths_bound(logits, trained.config.num_hidden_layers) + 2 * log_softmax_rounding(logits)
    for x, y in zip(lp_plain, lp_spec):
        assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
        assert abs(x.logprob - y.logprob) < bound


def test_seeded_sampling_under_speculation_is_reproducible_and_batch_independent(trained):
    p = ids_of(trained, "The with statement")
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    alone, _ = run(trained, [p], sp, speculative="mtp", num_draft=3)
    again, _ = run(trained, [p], sp, speculative="mtp", num_draft=3)
    batched, _ = run(trained, [ids_of(trained, "abc"), p, ids_of(trained, "x y z")],
                     [SamplingParams(max_tokens=7, temperature=1.0, seed=1), sp,
                      SamplingParams(max_tokens=9, ignore_eos=True)], speculative="mtp", num_draft=3)
    assert alone[0].token_ids == again[0].token_ids == batched[1].token_ids
    assert len(alone[0].token_ids) == 20


def test_state_bytes_count_the_drafter_state(trained, tiny):
    for model in (trained, tiny):
        engine = Engine(model, max_seq_len=512, speculative="mtp", num_draft=3)
        for cap in (1, 40, 300):
            st = model.new_state(capacity=cap, max_rewind=3)
            ms = model.new_mtp_state(capacity=cap, max_rewind=3)
            assert engine.state_bytes(cap) == st.nbytes + ms.nbytes
            st.free()
            ms.free()


def test_refusals_before_anything_runs(trained):
    bare = kvfold.load_model("tiny")
    bare.mtp = None
    with pytest.raises(MtpUnavailableError):
        Engine(bare, speculative="mtp")
    for kw in (dict(speculative="medusa"), dict(speculative="ngram", num_draft=0)):
        with pytest.raises(ValueError):
            Engine(trained, **kw)


def test_openai_client_gets_the_same_completion_with_speculation(trained):
    answers = []
    for kw in ({}, dict(speculative="mtp", num_draft=3)):
        app = create_app(Engine(trained, max_seq_len=256, **kw), model_name="tiny")
        with serving(app) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            r = c.completions.create(model="tiny", prompt="The with statement is used to", max_tokens=20,
                                     temperature=0)
            answers.append((r.choices[0].text, r.usage.completion_tokens))
    assert answers[0] == answers[1] and answers[0][1] > 0

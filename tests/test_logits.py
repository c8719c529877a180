"""Each sampling parameter against a hand computation on given logits (kvfold.decoding.logits),
and the ways they compose with `kvfold.generate` and speculative decoding."""
import math

import pytest
import torch

import kvfold
from kvfold.decoding.logits import Sampler, SamplingRule, token_logprobs
from kvfold.decoding.sampling import nucleus, sample_next

# small binary fractions: every hand computation below is exact in float32
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.25, 1.0])


def processed(rule: SamplingRule, output=(), prompt=(), stop_ids=()) -> list[float]:
    return Sampler(rule, prompt=prompt, stop_ids=stop_ids).process(LOGITS, list(output)).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # seen: 0 (prompt), 1 (prompt), 4 (output); 2 is positive and unseen; 3 unseen
    got = processed(SamplingRule(repetition_penalty=2.0), output=[4], prompt=[0, 1, 0])
    assert got == [1.0, -2.0, 0.5, 3.0, -0.5, 1.0]


def test_frequency_penalty_counts_output_tokens_only():
    got = processed(SamplingRule(frequency_penalty=0.5), output=[3, 3, 5], prompt=[0])
    assert got == [2.0, -1.0, 0.5, 3.0 - 2 * 0.5, -0.25, 1.0 - 0.5]


def test_presence_penalty_counts_each_output_token_once():
    got = processed(SamplingRule(presence_penalty=1.5), output=[3, 3, 5], prompt=[0])
    assert got == [2.0, -1.0, 0.5, 1.5, -0.25, -0.5]


def test_penalties_apply_in_vllms_order():
    # repetition first (3 -> 1.5), then frequency (-2 * 0.25), then presence (-0.5)
    got = processed(SamplingRule(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5),
                    output=[3, 3])
    assert got[3] == 3.0 / 2 - 0.5 - 0.5 and got[0] == 2.0


def test_logit_bias_adds_to_the_named_tokens():
    got = processed(SamplingRule(logit_bias={1: 5.0, 3: -100.0}))
    assert got == [2.0, 4.0, 0.5, -97.0, -0.25, 1.0]
    assert Sampler(SamplingRule(logit_bias={1: 5.0})).choose(LOGITS, []) == 1  # greedy now picks it


def test_min_tokens_masks_the_stop_ids_until_enough_tokens_are_out():
    rule = SamplingRule(min_tokens=2)
    assert processed(rule, output=[0], stop_ids=[3, 5]) == [2.0, -1.0, 0.5, -math.inf, -0.25, -math.inf]
    assert processed(rule, output=[0, 0], stop_ids=[3, 5]) == LOGITS.tolist()


def test_top_k_keeps_the_k_most_likely():
    ids, probs = nucleus(LOGITS, 1.0, 1.0, top_k=2)
    assert ids.tolist() == [3, 0]
    full = torch.softmax(LOGITS.double(), -1)
    assert torch.allclose(probs, full[[3, 0]], rtol=1e-6)


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    # p_i / p_max = exp(l_i - 3): 0 -> e^-1 = 0.37, 5 -> e^-2 = 0.135, 2 -> e^-2.5 = 0.082
    ids, _ = nucleus(LOGITS, 1.0, 1.0, min_p=0.1)
    assert ids.tolist() == [3, 0, 5]
    ids, _ = nucleus(LOGITS, 1.0, 1.0, min_p=0.5)
    assert ids.tolist() == [3]


def test_top_p_measures_the_mass_min_p_and_top_k_left():
    # top_k=2 leaves {3, 0} with renormalised probs 1/(1+e^-1) = 0.731 and 0.269
    assert nucleus(LOGITS, 1.0, 0.7, top_k=2)[0].tolist() == [3]
    assert nucleus(LOGITS, 1.0, 0.75, top_k=2)[0].tolist() == [3, 0]


def test_sampling_draws_only_from_what_the_rules_leave():
    g = torch.Generator().manual_seed(0)
    s = Sampler(SamplingRule(temperature=1.0, top_k=3, logit_bias={3: -100.0}), generator=g)
    picks = {s.choose(LOGITS, []) for _ in range(300)}
    assert picks == {0, 5, 2}  # 3 biased away; then the three most likely


def test_sample_next_takes_top_k_and_min_p_too():
    g = torch.Generator().manual_seed(1)
    assert {sample_next(LOGITS, 1.0, 1.0, g, top_k=1) for _ in range(50)} == {3}
    assert {sample_next(LOGITS, 1.0, 1.0, g, min_p=0.3) for _ in range(200)} == {3, 0}


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    got = token_logprobs(rows, [1, 2], top=2)
    want = torch.log_softmax(rows, -1)
    assert got[0].token == 1 and got[0].logprob == float(want[0, 1])
    assert got[0].top == ((3, float(want[0, 3])), (0, float(want[0, 0])))
    assert got[1].top[0][0] == 2  # the flipped row's best is id 5 - 3 = 2
    assert token_logprobs(rows[:1], [4], top=0)[0].top == ()


@pytest.mark.parametrize("kw", [dict(top_k=-2), dict(min_p=1.5), dict(presence_penalty=2.5),
                                dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
                                dict(logit_bias={-1: 1.0}), dict(logit_bias={1: 101.0}), dict(min_tokens=-1),
                                dict(min_tokens=5), dict(ignore_eos=1)])
def test_generate_refuses_each_bad_shaping_argument(tiny, kw):
    with pytest.raises(ValueError):
        kvfold.generate(tiny, [1, 2, 3], 4, **kw)


def test_generate_applies_min_tokens_and_ignore_eos(tiny):
    """With the EOS pushed up by a bias, min_tokens holds it off for that many tokens (vLLM: the
    minimum generated before a stop id may be); ignore_eos drops it as a stop."""
    eos = tiny.config.eos_ids[0]
    res = kvfold.generate(tiny, [1, 2, 3], 6, logit_bias={eos: 100.0}, min_tokens=3)
    assert eos not in res.tokens[:3] and res.tokens[3:] == [eos]
    res = kvfold.generate(tiny, [1, 2, 3], 5, logit_bias={eos: 100.0}, ignore_eos=True)
    assert res.tokens == [eos] * 5


def reference_penalised_greedy(model, prompt, n, rule: SamplingRule):
    """Plain greedy decoding with the penalties applied by hand, one forward per token."""
    state = model.new_state(capacity=len(prompt) + n)
    logits = model.forward(prompt, state)[-1]
    out = []
    for _ in range(n):
        x = logits.float().clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel())
        x = x - rule.frequency_penalty * counts - rule.presence_penalty * (counts > 0).float()
        out.append(int(torch.argmax(x)))
        logits = model.forward([out[-1]], state)[-1]
    state.free()
    return out


def test_penalised_greedy_is_the_same_with_and_without_drafts(tiny):
    """Speculative decoding judges each draft by the processed distribution after the drafts
    before it: greedy output with penalties equals the one-token-at-a-time output."""
    prompt = list(b"abcabcabcabc")
    rule = dict(frequency_penalty=0.7, presence_penalty=0.3)
    plain = kvfold.generate(tiny, prompt, 24, stop_ids=[], **rule).tokens
    assert plain == reference_penalised_greedy(tiny, prompt, 24, SamplingRule(**rule))
    assert plain != kvfold.generate(tiny, prompt, 24, stop_ids=[]).tokens  # the penalties did something
    for spec in ("ngram", "mtp"):
        res = kvfold.generate(tiny, prompt, 24, stop_ids=[], speculative=spec, num_draft=3, **rule)
        assert res.tokens == plain, spec
        assert res.drafted > 0


def test_grammar_output_is_the_same_with_and_without_drafts(tiny):
    """The matcher moves only over kept tokens: a rejected draft never reaches it, so under
    speculative decoding it stays where the emitted tokens put it, and greedy constrained output
    equals the one-token-at-a-time output (which parses)."""
    import json

    from kvfold.decoding.grammar import GrammarMatcher, GrammarSpec, compile_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"enum": ["ab", "abc"]}},
              "required": ["n", "s"], "additionalProperties": False}
    compiled = compile_grammar(GrammarSpec("json_schema", schema), tiny.tokenizer, tiny.config.vocab_size)
    prompt = [tiny.tokenizer.bos_id] + list(b'{"n": 1, "s": "ab"} {"n": 2, "s": "abc"} ')
    plain = kvfold.generate(tiny, prompt, 60, grammar=GrammarMatcher(compiled)).tokens
    assert plain[-1] in tiny.config.eos_ids
    json.loads(tiny.tokenizer.decode(plain[:-1]))
    for spec in ("ngram", "mtp"):
        res = kvfold.generate(tiny, prompt, 60, grammar=GrammarMatcher(compiled), speculative=spec, num_draft=3)
        assert res.tokens == plain and res.drafted > 0, spec


def test_a_grammar_ending_on_an_accepted_draft_ends_the_output(tiny):
    """stop_ids=[]: only the grammar ends the output. A drafter proposing the grammar's own
    output (its end included) gets it all accepted; nothing after the end reaches the matcher."""
    from kvfold.decoding.grammar import GrammarMatcher, GrammarSpec, compile_grammar
    compiled = compile_grammar(GrammarSpec("regex", "abcabc"), tiny.tokenizer, tiny.config.vocab_size)
    prompt = [tiny.tokenizer.bos_id] + list(b"abcabc")
    plain = kvfold.generate(tiny, prompt, 20, stop_ids=[], grammar=GrammarMatcher(compiled)).tokens
    assert plain[:6] == list(b"abcabc") and len(plain) == 7  # then the EOS the grammar ends on

    class Oracle:
        needs_hidden = False

        def propose(self, context, k):
            done = len(context) - len(prompt)
            return (plain + [65] * 8)[done:done + k], None

        def update(self, *a):
            pass

        def close(self):
            pass
    res = kvfold.generate(tiny, prompt, 20, stop_ids=[], grammar=GrammarMatcher(compiled), speculative=Oracle(),
                          num_draft=4)
    assert res.tokens == plain and res.accepted >= 5


def test_repetition_penalty_keeps_every_logit_finite():
    for bad in (5e-324, 0.001, 1000.0):
        with pytest.raises(ValueError, match="repetition_penalty"):
            from kvfold.decoding.sampling import check_sampling
            check_sampling(repetition_penalty=bad)
    x = Sampler(SamplingRule(repetition_penalty=0.01), prompt=[0]).process(torch.tensor([3e36, 1.0]), [])
    assert torch.isfinite(x).all()


def test_speculative_verify_draws_from_the_processed_distribution():
    """Rejection sampling against the request's processed p (top-k 3 and a presence penalty on
    the token already out): the first emitted token's frequencies match that p, not the raw
    softmax, whatever the drafter's q."""
    from kvfold.decoding.speculative import verify_drafts
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0], [0.0] * 5])
    rule = SamplingRule(temperature=1.0, top_k=3, presence_penalty=1.0)
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(rule, generator=g)
    p = sampler.probs(logits[0], [0])  # token 0 is out already: penalised; top-3 of the rest
    assert p[4] == 0 and p[3] == 0 and p[0] < torch.softmax(logits[0].double(), -1)[0]
    q = torch.tensor([0.1, 0.1, 0.1, 0.6, 0.1], dtype=torch.float64)
    n, counts = 6000, torch.zeros(5)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        acc, nxt = verify_drafts(logits, [d], q[None], sampler, [0])
        counts[d if acc else nxt] += 1
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= 5 * sigma + 1e-12).all(), (counts / n, p)

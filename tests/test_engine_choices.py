"""The engine's per-request choice: every sampling parameter as `kvfold.generate` applies it, n
choices from one prefill (their pages shared), and logprobs as the model gives them."""
import pytest
import torch

import kvfold
from kvfold import Engine
from kvfold.engine import SamplingParams
from kvfold.errors import InvalidRequestError, RequestTooLongError

from helpers import fp32_paths_bound

SHAPED = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, presence_penalty=0.4, frequency_penalty=0.3,
              repetition_penalty=1.2, logit_bias={65: 2.0, 101: -1.5})


def ids_of(model, text: str) -> list[int]:
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def long_prompt(model, n: int, tag: str) -> list[int]:
    text = (tag + " the cache keeps what it folds; ") * (n // 10 + 1)
    return ids_of(model, text)[:n]


def run(engine: Engine, prompt, params_list) -> dict[str, list[int]]:
    rids = engine.add_choices(prompt, params_list)
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r] for r in rids]


def test_engine_applies_every_sampling_parameter_as_generate_does(tiny):
    prompt = ids_of(tiny, "The fold of a page")
    want = kvfold.generate(tiny, prompt, 20, seed=11, min_tokens=4, **SHAPED).tokens
    (got,) = run(Engine(tiny, max_seq_len=256), prompt,
                 [SamplingParams(max_tokens=20, seed=11, min_tokens=4, **SHAPED)])
    assert got == want
    assert got != kvfold.generate(tiny, prompt, 20, seed=11, temperature=0.9, top_p=0.95).tokens


def test_stop_token_ids_add_to_eos_and_ignore_eos_drops_it(tiny):
    prompt = ids_of(tiny, "abc")
    eos = tiny.config.eos_ids[0]
    engine = Engine(tiny, max_seq_len=64)
    (out,) = run(engine, prompt, [SamplingParams(max_tokens=8, logit_bias={eos: 100.0}, stop_token_ids=[7])])
    assert out == [eos]  # the EOS still stops, beside the extra id
    (out,) = run(engine, prompt, [SamplingParams(max_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)])
    assert out == [eos] * 5
    (out,) = run(engine, prompt, [SamplingParams(max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3)])
    assert eos not in out[:3] and out[3:] == [eos]


def test_a_stop_string_in_the_text_of_the_first_min_tokens_does_not_stop(tiny):
    prompt = ids_of(tiny, "x")
    engine = Engine(tiny, max_seq_len=64)
    ref = kvfold.generate(tiny, prompt, 12, stop_ids=[]).tokens
    first = tiny.tokenizer.decode(ref[:2])
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=[first], min_tokens=4))
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            text += o.new_text
    assert text.startswith(first) and len(text) >= len(tiny.tokenizer.decode(ref[:4]))
    assert rid


@pytest.mark.parametrize("paged", [True, False])
def test_n_choices_equal_single_requests_with_the_derived_seeds(tiny, paged):
    """Choice i with seed s + i: the same tokens as a lone request with that seed. The prompt
    (3 pages and a part) is prefilled once; a paged engine's choices hold its 2 whole pages by
    reference."""
    prompt = long_prompt(tiny, 300, "N")
    params = [SamplingParams(max_tokens=10, seed=5 + i, ignore_eos=True, **SHAPED) for i in range(3)]
    kw = dict(max_seq_len=512, prefix_cache_bytes=0, **({} if paged else {"kv_page_bytes": 0}))
    want = [run(Engine(tiny, **kw), prompt, [p])[0] for p in params]
    engine = Engine(tiny, **kw)
    tables = []
    real_step = engine.step

    def step():
        outs = real_step()
        if not tables and len(engine.scheduler.running) == 3:
            tables.extend(s.state.page_table for s in engine.scheduler.running if s.state.paged)
        return outs
    engine.step = step
    assert run(engine, prompt, params) == want
    assert engine.metrics()["prefill_tokens"] == len(prompt)  # once, for all three
    assert len({tuple(t[:2]) for t in tables}) == (1 if paged else 0) and len({t[2] for t in tables}) == len(tables)
    assert engine.metrics()["live_states"] == 0
    if paged:
        assert engine.pages.free_pages == engine.pages.num_pages


def test_cancelling_the_first_choice_during_its_prefill_keeps_the_others(tiny):
    prompt = long_prompt(tiny, 300, "C")
    params = [SamplingParams(max_tokens=6, seed=i, temperature=1.0, ignore_eos=True) for i in range(3)]
    want = [run(Engine(tiny, max_seq_len=512), prompt, [p])[0] for p in params]
    engine = Engine(tiny, max_seq_len=512, prefix_cache_bytes=0)
    rids = engine.add_choices(prompt, params)
    engine.step()  # the first 128 prompt tokens
    assert engine.cancel(rids[0]) and engine.cancel(rids[2])
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert list(outs) == [rids[1]] and outs[rids[1]] == want[1]
    assert engine.metrics()["live_states"] == 0 and engine.pages.free_pages == engine.pages.num_pages


def test_cancelling_every_choice_before_the_fork_frees_everything(tiny):
    engine = Engine(tiny, max_seq_len=512, prefix_cache_bytes=0)
    rids = engine.add_choices(long_prompt(tiny, 300, "X"), [SamplingParams(max_tokens=4)] * 2)
    engine.step()
    assert all(engine.cancel(r) for r in rids)
    assert not engine.has_unfinished() and engine.metrics()["live_states"] == 0
    assert engine.pages.free_pages == engine.pages.num_pages and engine.scheduler.reserved_bytes == 0


def test_n_choices_are_refused_together_when_they_cannot_fit(tiny):
    engine = Engine(tiny, max_seq_len=512, max_running=2, max_batch_tokens=512)
    with pytest.raises(InvalidRequestError, match="n=3"):
        engine.add_choices([1, 2, 3], [SamplingParams()] * 3)
    one = engine.state_bytes(3 + 16)
    small = Engine(tiny, max_seq_len=512, max_state_bytes=2 * one)
    with pytest.raises(RequestTooLongError):
        small.add_choices([1, 2, 3], [SamplingParams()] * 3)
    assert not engine.has_unfinished() and not small.has_unfinished()
    assert engine.metrics()["requests_rejected"] == 3


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over `ids` (an independent path: no engine, one call)."""
    state = model.new_state(capacity=len(ids))
    logits = model.forward(ids, state)
    state.free()
    return torch.log_softmax(logits.float(), -1), logits


def test_logprobs_are_the_models_log_softmax_before_any_processing(tiny):
    prompt = long_prompt(tiny, 140, "L")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True, presence_penalty=1.0, logit_bias={66: 5.0})
    engine = Engine(tiny, max_seq_len=256)
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    gen = [lp for o in outs for lp in o.logprobs]
    prompt_lps = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    tokens = [t for o in outs for t in o.new_token_ids]
    want, logits = forward_logprobs(tiny, prompt + tokens[:-1])
    tol = 2 * fp32_paths_bound(logits, tiny.config.num_hidden_layers)  # log_softmax moves at most 2x the logits
    assert [lp.token for lp in gen] == tokens and prompt_lps[0] is None
    assert [lp.token for lp in prompt_lps[1:]] == prompt[1:]
    for pos, lp in list(enumerate(prompt_lps))[1:] + [(len(prompt) + i, lp) for i, lp in enumerate(gen)]:
        row = want[pos - 1]
        assert abs(lp.logprob - row[lp.token].item()) <= tol, pos
        k = len(lp.top)
        assert k == (2 if pos < len(prompt) else 3)
        kth = torch.sort(row, descending=True).values[k - 1].item()
        assert all(abs(v - row[i].item()) <= tol and row[i].item() >= kth - 2 * tol for i, v in lp.top)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_a_request_for_prompt_logprobs_never_reads_the_prefix_cache(tiny):
    prompt = long_prompt(tiny, 260, "P")
    engine = Engine(tiny, max_seq_len=512)
    run(engine, prompt, [SamplingParams(max_tokens=2)])  # caches the prompt's first 2 blocks
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].cached_tokens == 0 and len(outs[0].prompt_logprobs) == len(prompt)
    assert engine.metrics()["prefix_cache_hits"] == 0 and rid
    run(engine, prompt, [SamplingParams(max_tokens=2)])
    assert engine.metrics()["prefix_cache_hits"] == 1  # the cache itself still serves the others


@pytest.mark.parametrize("bad", [dict(logprobs=21), dict(prompt_logprobs=-1), dict(logit_bias={10 ** 6: 1.0}),
                                 dict(top_k=-3), dict(min_tokens=17), dict(ignore_eos="yes")])
def test_bad_choice_parameters_are_refused_before_any_work(tiny, bad):
    engine = Engine(tiny, max_seq_len=64)
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2], SamplingParams(**bad))
    assert not engine.has_unfinished() and engine.metrics()["requests_rejected"] == 1


def test_a_grammar_that_ends_ends_the_request_whatever_the_stop_rules(tiny):
    """With ignore_eos, or min_tokens past what the grammar allows, the request still ends where
    the grammar does (finish "stop"), and never asks the grammar for a token after its end."""
    from kvfold.decoding.grammar import GrammarSpec
    engine = Engine(tiny, max_seq_len=64)
    prompt = ids_of(tiny, "x")
    for extra in (dict(ignore_eos=True), dict(min_tokens=10), dict(ignore_eos=True, min_tokens=10)):
        (c,) = engine.generate([prompt], SamplingParams(max_tokens=20, grammar=GrammarSpec("regex", "ab"), **extra))
        assert (c.text, c.finish_reason) == ("ab", "stop"), extra
        assert c.token_ids[:2] == [ord("a"), ord("b")] and len(c.token_ids) == 3  # and the EOS the grammar ends on
    assert engine.metrics()["finished_error"] == 0

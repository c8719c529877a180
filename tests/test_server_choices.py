"""`kvfold serve` with the real openai client: sampling parameters, n choices, logprobs and echo,
checked against `kvfold.generate` and the model's own forward."""
import math

import openai
import pytest
import torch

import kvfold
from kvfold.server.app import create_app
from kvfold.server.context import derived_seed

from helpers import fp32_paths_bound, serving


@pytest.fixture(scope="module")
def url(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=16, max_queue=64)
    with serving(create_app(engine, model_name="tiny-random")) as u:
        yield u


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def prompt_ids(model, text):
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def forward_logprobs(model, ids):
    state = model.new_state(capacity=len(ids))
    logits = model.forward(ids, state)
    state.free()
    return torch.log_softmax(logits.float(), -1), 2 * fp32_paths_bound(logits, model.config.num_hidden_layers)


def test_every_sampling_parameter_reaches_the_engine(url, tiny):
    shaped = dict(top_k=20, min_p=0.05, repetition_penalty=1.3, min_tokens=3, ignore_eos=True)
    bias = {66: 3.0, 101: -2.0}
    want = kvfold.generate(tiny, prompt_ids(tiny, "hello"), 12, temperature=0.8, top_p=0.9, seed=4,
                           presence_penalty=0.5, frequency_penalty=0.25, logit_bias=bias, **shaped).tokens
    r = client(url).completions.create(model="tiny-random", prompt="hello", max_tokens=12, temperature=0.8, top_p=0.9, seed=4,
                                       presence_penalty=0.5, frequency_penalty=0.25,
                                       logit_bias={str(k): v for k, v in bias.items()},
                                       extra_body={"return_token_ids": True, **shaped})
    assert r.choices[0].token_ids == want


def test_n_choices_are_reproducible_and_equal_single_requests_with_derived_seeds(url):
    c = client(url)
    kw = dict(model="tiny-random", max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    r = c.completions.create(prompt=["once", "upon"], n=3, seed=10, **kw)
    assert [ch.index for ch in r.choices] == list(range(6))
    again = c.completions.create(prompt=["once", "upon"], n=3, seed=10, **kw)
    assert [ch.token_ids for ch in r.choices] == [ch.token_ids for ch in again.choices]
    for i, ch in enumerate(r.choices):
        single = c.completions.create(prompt=["once", "upon"][i // 3], seed=derived_seed(10, i % 3), **kw)
        assert ch.token_ids == single.choices[0].token_ids
    assert len({tuple(ch.token_ids) for ch in r.choices[:3]}) > 1  # the seeds differ
    assert r.usage.prompt_tokens == 2 * 3 * 5  # per choice, as OpenAI counts
    chat = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], n=2, seed=-1,
                                     **{**kw, "extra_body": {"return_token_ids": True}})
    assert [ch.index for ch in chat.choices] == [0, 1]
    single = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], seed=0,
                                       **{**kw, "extra_body": {"return_token_ids": True}})
    assert derived_seed(-1, 1) == 0 and chat.choices[1].token_ids == single.choices[0].token_ids


def test_derived_seeds_wrap_into_the_64_bit_range():
    assert derived_seed(None, 3) is None and derived_seed(7, 2) == 9
    assert derived_seed((1 << 64) - 1, 1) == -(1 << 63)


def test_streamed_n_choices_carry_their_index(url):
    c = client(url)
    kw = dict(model="tiny-random", max_tokens=6, temperature=1.0, seed=3, n=2, extra_body={"return_token_ids": True})
    whole = c.chat.completions.create(messages=[{"role": "user", "content": "hey"}], **kw)
    got = {0: [], 1: []}
    for chunk in c.chat.completions.create(messages=[{"role": "user", "content": "hey"}], stream=True, **kw):
        for ch in chunk.choices:
            got[ch.index] += getattr(ch, "token_ids", None) or []
    assert [got[0], got[1]] == [ch.token_ids for ch in whole.choices]


def test_completion_logprobs_with_echo_are_the_models_log_softmax(url, tiny):
    """lm-eval's request: echo + logprobs over the prompt ids, scored against one plain forward."""
    ids = prompt_ids(tiny, "The cat sat on the mat")
    r = client(url).completions.create(model="tiny-random", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                       extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs
    out = r.choices[0].token_ids
    want, tol = forward_logprobs(tiny, ids + out[:-1])
    n = len(ids) + len(out)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos, tok in list(enumerate(ids + out))[1:]:
        assert abs(lp.token_logprobs[pos] - want[pos - 1, tok].item()) <= tol, pos
        assert len(lp.top_logprobs[pos]) <= 2  # (two ids may share a text: "\ufffd")
    assert lp.tokens[1:len(ids)] == [tiny.tokenizer.decode([t]) for t in ids[1:]]
    assert r.choices[0].text.startswith(tiny.tokenizer.decode(ids))
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and offsets[-1] == sum(len(t) for t in lp.tokens[:-1])


def test_streamed_completion_logprobs_add_up_to_the_whole(url):
    c = client(url)
    kw = dict(model="tiny-random", prompt="abc", max_tokens=6, temperature=0, logprobs=1, echo=True)
    whole = c.completions.create(**kw).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in c.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            values += ch.logprobs.token_logprobs
            offsets += ch.logprobs.text_offset
    assert (tokens, values, offsets, text) == (whole.logprobs.tokens, whole.logprobs.token_logprobs,
                                               whole.logprobs.text_offset, whole.text)


def test_chat_logprobs_follow_openais_shape(url, tiny):
    c = client(url)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=3, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tiny.tokenizer.decode([t]) for t in r.choices[0].token_ids]
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob and e.logprob <= 0
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob)  # greedy: the chosen one is the best
    streamed = [e for chunk in c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=5, temperature=0,
                                                          logprobs=True, top_logprobs=3, stream=True)
                for ch in chunk.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


@pytest.mark.parametrize("kw,param", [
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"999999": 1}), "logit_bias"),
    (dict(logit_bias={"5": 200}), "logit_bias"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(n=0), "n"), (dict(extra_body={"top_k": -5}), "top_k"), (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens"), (dict(logprobs=6), "logprobs"),
])
def test_out_of_range_choice_parameters_are_400s_naming_them(url, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny-random", prompt="hi", max_tokens=4, **kw)
    assert e.value.response.json()["error"]["param"] == param, e.value.response.json()


def test_chat_top_logprobs_needs_logprobs(url):
    c = client(url)
    for kw in (dict(top_logprobs=2), dict(top_logprobs=21, logprobs=True)):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)
        assert e.value.response.json()["error"]["param"] == "top_logprobs"


def post(url, path, body):
    import json
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_as_vllm_serves_them(url, tiny):
    status, body = post(url, "/tokenize", {"model": "tiny-random", "prompt": "héllo"})
    assert status == 200 and body["tokens"] == prompt_ids(tiny, "héllo") and body["count"] == 7
    assert body["max_model_len"] == 512
    assert post(url, "/tokenize", {"prompt": "hi", "add_special_tokens": False})[1]["tokens"] == [104, 105]
    status, chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    r = client(url).chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert status == 200 and chat["count"] == r.usage.prompt_tokens
    assert post(url, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "héllo"})
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                             ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens"),
                             ("/tokenize", {"prompt": "a", "model": "gpt"}, "model")):
        status, err = post(url, path, bad)
        assert status in (400, 404) and err["error"]["param"] == param, (path, bad, err)

"""`kvfold serve`: the real `openai` client against a live uvicorn server on 127.0.0.1 (a free
port picked by the OS), serving the tiny model from a background thread of the test process."""
import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

import kvfold
from kvfold.server import add_serve_parser, build_app
from kvfold.server.app import create_app
from kvfold.chat.template import ChatTemplate
from kvfold.server.metrics import parse as parse_metrics

from helpers import chunked_reference, serving

KEY = "test-key"




@pytest.fixture(scope="module")
def server(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=16, max_queue=64)
    app = create_app(engine, model_name="tiny-random", api_key=KEY)
    with serving(app) as url:
        yield url, app.state.engine


def client(url, key=KEY, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def metrics(url) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(r.read().decode())


def wait_idle(url, timeout=20.0) -> dict[str, float]:
    """Metrics once nothing is queued, running or allocated (cancels land between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kvfold_live_states"] == 0 and m["kvfold_running_sequences"] == 0 and m["kvfold_queue_depth"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def _error(call, status=400) -> dict:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def prompt_ids(model, text):
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def test_health_models_and_auth(server):
    url, _ = server
    with urllib.request.urlopen(url + "/health") as r:
        assert json.load(r) == {"status": "ok"}
    assert [m.id for m in client(url).models.list().data] == ["tiny-random"]
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, key="wrong-key").completions.create(model="tiny-random", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    # no Authorization header at all (the openai client always sends one)
    req = urllib.request.Request(url + "/v1/completions", data=b'{"model": "tiny-random", "prompt": "hi"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401 and json.load(e.value)["error"]["code"] == "invalid_api_key"


def test_completion_greedy_equals_generate(server, tiny):
    url, _ = server
    ref = kvfold.generate(tiny, prompt_ids(tiny, "Once upon a time"), 16).tokens
    c = client(url)
    r = c.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=16, temperature=0,
                             extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == ref and choice.text == tiny.tokenizer.decode(ref)
    assert choice.finish_reason == ("stop" if ref[-1] in tiny.config.eos_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (17, len(ref))

    ids, text = [], ""
    chunks = c.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=16, temperature=0,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"return_token_ids": True})
    finish, usage = None, None
    for ch in chunks:
        if ch.choices:
            ids += ch.choices[0].token_ids
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        usage = ch.usage or usage
    assert ids == ref and text == choice.text and finish == choice.finish_reason
    assert usage.completion_tokens == len(ref)

    # token-id prompts and seeded sampling
    sampled = kvfold.generate(tiny, prompt_ids(tiny, "abc"), 8, temperature=0.8, top_p=0.9, seed=3).tokens
    r = c.completions.create(model="tiny-random", prompt=prompt_ids(tiny, "abc"), max_tokens=8, temperature=0.8, top_p=0.9,
                             seed=3, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == sampled


def test_chat_greedy_equals_generate(server, tiny):
    url, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = prompt_ids(tiny, "<|system|>\nBe brief.\n<|user|>\nHello there\n<|assistant|>\n")
    ref = kvfold.generate(tiny, ids, 12).tokens
    c = client(url)
    r = c.chat.completions.create(model="tiny-random", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tiny.tokenizer.decode(ref)
    assert r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model="tiny-random", messages=messages, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    got, content, roles = [], "", []
    for ch in stream:
        d = ch.choices[0]
        roles.append(d.delta.role)
        content += d.delta.content or ""
        got += getattr(d, "token_ids", None) or []
    assert got == ref and content == r.choices[0].message.content and roles[0] == "assistant"


def test_concurrent_streams_with_cancellation(server, tiny):
    """32 concurrent streamed requests of mixed prompt and output lengths; every 4th is closed by
    its client after two chunks. The rest must equal their solo runs; nothing stays allocated."""
    url, _ = server
    n = 32
    texts = [f"req {i}: " + "lorem ipsum dolor sit amet " * (i % 7 * 2) for i in range(n)]  # 9 to 334 tokens
    max_toks = [2 + (i * 5) % 7 for i in range(n)]  # 2 to 8
    cancel = {i for i in range(n) if i % 4 == 1}

    async def one(c, i):
        stream = await c.completions.create(
            model="tiny-random", prompt=texts[i], max_tokens=64 if i in cancel else max_toks[i], temperature=0,
            stream=True, extra_body={"return_token_ids": True})
        ids, chunks = [], 0
        async for ch in stream:
            ids += ch.choices[0].token_ids
            chunks += 1
            if i in cancel and chunks == 2:
                await stream.close()  # hang up mid-stream
                break
        return ids

    async def main():
        async with client(url, cls=openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    before = metrics(url)
    results = asyncio.run(main())
    m = wait_idle(url)
    for i, got in enumerate(results):
        p = prompt_ids(tiny, texts[i])
        if i in cancel:
            assert 1 <= len(got) < 64 and got == chunked_reference(tiny, p, len(got))
        else:
            assert got == chunked_reference(tiny, p, max_toks[i]), i
    assert m["kvfold_requests_cancelled_total"] - before["kvfold_requests_cancelled_total"] == len(cancel)
    assert m["kvfold_state_bytes"] == 0 and server[1].engine.metrics()["live_states"] == 0
    # cancelled and finished requests gave their pages back: only the prefix cache holds some
    assert m["kvfold_kv_pages_used"] == m["kvfold_prefix_cache_pages"] and m["kvfold_kv_pages"] > 0
    assert m["kvfold_batch_sequences_total"] > m["kvfold_engine_steps_total"]  # requests shared steps


def test_prefix_cache_hit_over_http(server, tiny):
    url, _ = server
    c = client(url)
    base = "".join(f"Prefix test sentence number {i}, long enough to span blocks. " for i in range(6))
    a, b = base + "First ending.", base[:300] + " a different ending"
    before = metrics(url)
    ra = c.completions.create(model="tiny-random", prompt=a, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    rb = c.completions.create(model="tiny-random", prompt=b, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert ra.usage.prompt_tokens_details.cached_tokens == 0
    assert rb.usage.prompt_tokens_details.cached_tokens == 256
    # a cold run: the same prompt through a fresh engine with no prefix cache, and the chunked reference
    cold = kvfold.Engine(tiny, max_seq_len=512, prefix_cache_bytes=0)
    (cb,) = cold.generate([prompt_ids(tiny, b)], kvfold.SamplingParams(max_tokens=8))
    assert rb.choices[0].token_ids == cb.token_ids == chunked_reference(tiny, prompt_ids(tiny, b), 8)
    m = metrics(url)
    assert m["kvfold_prefix_cache_hit_tokens_total"] - before["kvfold_prefix_cache_hit_tokens_total"] == 256
    assert m["kvfold_prefix_cache_request_hits_total"] - before["kvfold_prefix_cache_request_hits_total"] == 1
    assert 0 < m["kvfold_prefix_cache_hit_rate"] <= 1 and m["kvfold_prefix_cache_bytes"] > 0
    assert m["kvfold_prefix_cache_pages"] >= 2 and m["kvfold_kv_page_bytes_used"] > 0


def test_request_errors(server):
    url, _ = server
    c = client(url)

    def error_of(exc_type, status, **kw):
        with pytest.raises(exc_type) as e:
            c.completions.create(**{"model": "tiny-random", "prompt": "hi", "max_tokens": 2, **kw})
        assert e.value.status_code == status
        err = e.value.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    err = error_of(openai.BadRequestError, 400, prompt="x" * 500, max_tokens=20)  # 501 + 20 > 512
    assert err["code"] == "context_length_exceeded" and "max_seq_len" in err["message"]
    assert err["param"] == "max_tokens"  # the prompt fits alone: the limit set is what passes the context
    # a prompt that fills the context alone: no max_tokens would help, so the prompt is named
    assert error_of(openai.BadRequestError, 400, prompt="x" * 600, max_tokens=2)["param"] == "prompt"
    for limit in ({"max_tokens": 2}, {"max_completion_tokens": 2}, {}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x" * 600}], **limit)
        assert (e.value.response.json()["error"]["param"], e.value.response.json()["error"]["code"]) == \
            ("messages", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x" * 400}],
                                  max_tokens=200)
    assert e.value.response.json()["error"]["param"] == "max_tokens"
    assert error_of(openai.BadRequestError, 400, temperature=3.0)["param"] == "temperature"
    assert error_of(openai.BadRequestError, 400, prompt=[1, 2, 100000])["type"] == "invalid_request_error"
    assert error_of(openai.BadRequestError, 400, n=200)["param"] == "n"
    assert error_of(openai.NotFoundError, 404, model="gpt-4")["code"] == "model_not_found"
    err = error_of(openai.APIStatusError, 413, prompt="x" * (1 << 20))
    assert err["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x" * 600}])
    m = wait_idle(url)
    assert m['kvfold_http_errors_total{status="413"}'] >= 1


def test_inputs_that_crashed_a_request_get_a_400_and_keep_the_connection(server):
    """A lone surrogate in a completion prompt (no UTF-8 form) and a body nested 100,000 levels deep
    (past the JSON parser's stack) are the client's errors: 400s in OpenAI's shape, and the same
    keep-alive connection serves the next request. (The openai client cannot send a lone surrogate
    at all: it fails to encode its own body, so the requests are written by hand.)"""
    import http.client
    import urllib.parse
    url, _ = server
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def post(body: str) -> tuple[int, dict]:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    try:
        status, body = post('{"model": "tiny-random", "prompt": "\\ud800x", "max_tokens": 2}')  # JSON escape, ASCII body
        assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
        status, body = post("[" * 100_000 + "]" * 100_000)
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        status, body = post(json.dumps({"model": "tiny-random", "prompt": "hi", "max_tokens": 2}))
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        conn.close()


def test_queue_full_is_503(tiny):
    """One running sequence, one waiting: the third request is refused with 503, the others complete."""
    # the long runner must still be running when the third request arrives and when it hangs up:
    # 8000 tokens past any EOS take seconds, where 400 (greedy, EOS allowed) sometimes finished first
    engine = kvfold.Engine(tiny, max_seq_len=8192, max_running=1, max_queue=1)
    with serving(create_app(engine, model_name="tiny-random")) as url:
        c = client(url)
        first = c.completions.create(model="tiny-random", prompt="long runner", max_tokens=8000, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
        next(iter(first))  # its first token: it is running now
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(
            r=c.completions.create(model="tiny-random", prompt="queued", max_tokens=2, temperature=0)))
        t.start()
        deadline = time.monotonic() + 20
        while metrics(url)["kvfold_queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny-random", prompt="one too many", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.json()["error"]["code"] == "queue_full"
        first.close()  # hang up: frees the slot for the queued request
        t.join(timeout=30)
        assert waiting["r"].choices[0].finish_reason in ("length", "stop")
        m = wait_idle(url)
        assert m["kvfold_requests_cancelled_total"] == 1 and m["kvfold_requests_rejected_total"] == 1


def test_serve_cli_and_checkpoint_chat_template(tmp_path, tiny):
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "tiny-random", "--max-seq-len", "256"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    app = build_app(args)
    assert app.state.engine.engine.max_seq_len == 256
    assert app.state.engine.engine.pages.num_pages == 16 * 2  # default: max-running sequences of max-seq-len
    assert app.state.engine.engine.batch_invariant  # the serving default
    args = parser.parse_args(["serve", "--model", "tiny-random", "--max-seq-len", "256", "--kv-page-bytes", "0",
                              "--no-batch-invariant"])
    app = build_app(args)
    assert app.state.engine.engine.pages is None  # private per-sequence pools
    assert not app.state.engine.engine.batch_invariant
    args = parser.parse_args(["serve", "--model", "tiny-random", "--max-seq-len", "256", "--batch-invariant"])
    assert args.batch_invariant is True  # asked for (CUDA's way to turn it on)
    assert build_app(args).state.engine.engine.batch_invariant

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    tpl = ChatTemplate.for_model(tiny.tokenizer, tmp_path)
    ids = tpl.render([{"role": "user", "content": "hi"}])
    assert tiny.tokenizer.decode(ids) == "<s>[user] hi\n[assistant] "
    plain = ChatTemplate.for_model(tiny.tokenizer, None).render([{"role": "user", "content": "hi"}])
    assert plain == prompt_ids(tiny, "<|user|>\nhi\n<|assistant|>\n")


def test_models_retrieve(server):
    c = client(server[0])
    m = c.models.retrieve("tiny-random")
    assert (m.id, m.object, m.owned_by) == ("tiny-random", "model", "kvfold") and m.max_model_len == 512
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    err = e.value.response.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.AuthenticationError):
        client(server[0], key="wrong").models.retrieve("tiny-random")


def test_batched_prompts(server, tiny):
    """A list of prompts (texts, or token-id lists) runs as one engine request per prompt, side by
    side: one choice per prompt at its index, each the prompt's solo run; usage is the sum."""
    url, _ = server
    c = client(url)
    texts = ["Once upon a time", "abc", "The quick brown fox jumps", "x"]
    refs = [kvfold.generate(tiny, prompt_ids(tiny, t), 10).tokens for t in texts]
    before = metrics(url)
    r = c.completions.create(model="tiny-random", prompt=texts, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    m = wait_idle(url)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.token_ids for ch in r.choices] == refs
    assert [ch.text for ch in r.choices] == [tiny.tokenizer.decode(t) for t in refs]
    assert r.usage.prompt_tokens == sum(len(prompt_ids(tiny, t)) for t in texts)
    assert r.usage.completion_tokens == sum(map(len, refs))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    steps = m["kvfold_engine_steps_total"] - before["kvfold_engine_steps_total"]
    rows = m["kvfold_batch_sequences_total"] - before["kvfold_batch_sequences_total"]
    assert m["kvfold_requests_total"] - before["kvfold_requests_total"] == 4 and rows > steps  # side by side

    # one prompt in a list is a batch of one; a prompt the context cannot hold refuses the batch
    r = c.completions.create(model="tiny-random", prompt=["abc"], max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    assert [ch.token_ids for ch in r.choices] == [refs[1]]
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=["abc", "x" * 600], max_tokens=4))
    assert (err["param"], err["code"]) == ("prompt.1", "context_length_exceeded")
    err = _error(lambda: c.completions.create(model="tiny-random", prompt="y" * 200, max_tokens=400))
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    err = _error(lambda: c.completions.create(model="tiny-random", prompt="y" * 600))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=["x" * 600], max_tokens=4))
    assert (err["param"], err["code"]) == ("prompt.0", "context_length_exceeded")
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=["a"] * 65, max_tokens=4))  # max_queue 64
    assert err["param"] == "prompt" and "queues at once" in err["message"]
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=[[1, 2], []], max_tokens=4))
    assert err["param"] == "prompt.1"
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=[[1, 2], [5, 100000]], max_tokens=4))
    assert err["param"] == "prompt.1" and "vocabulary" in err["message"]
    assert wait_idle(url)["kvfold_live_states"] == 0  # the refused batches left nothing behind


def test_batched_prompts_streamed(server, tiny):
    """Token-id lists, streamed: each chunk's choice carries its prompt's index; hanging up cancels
    every prompt of the batch."""
    url, _ = server
    c = client(url)
    texts = ["Once upon a time", "abc", "The quick brown fox jumps"]
    refs = [kvfold.generate(tiny, prompt_ids(tiny, t), 10).tokens for t in texts]
    id_prompts = [prompt_ids(tiny, t) for t in texts]
    got, finish, usage = {}, {}, None
    for ch in c.completions.create(model="tiny-random", prompt=id_prompts, max_tokens=10, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"return_token_ids": True}):
        for choice in ch.choices:
            got.setdefault(choice.index, []).extend(choice.token_ids)
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = ch.usage or usage
    assert got == dict(enumerate(refs)) and set(finish.values()) <= {"stop", "length"}
    assert usage.completion_tokens == sum(map(len, refs))
    assert usage.prompt_tokens == sum(map(len, id_prompts))

    before = metrics(url)  # hang up after a few chunks
    stream = c.completions.create(model="tiny-random", prompt=["lorem ipsum " * 4, "dolor sit amet", "consectetur"],
                                  max_tokens=200, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            stream.close()
            break
    m = wait_idle(url)
    assert m["kvfold_requests_cancelled_total"] - before["kvfold_requests_cancelled_total"] >= 1
    assert m["kvfold_live_states"] == 0 and m["kvfold_state_bytes"] == 0


def test_metrics_read_right_after_a_streamed_answer_count_all_its_tokens(server):
    """Metrics are published at most every 50 ms while requests stream, but always after the step
    that finished a request and before its last chunk goes out (engine/async_engine.py)."""
    url, _ = server
    before = metrics(url)
    chunks = list(client(url).completions.create(model="tiny-random", prompt="count me", max_tokens=40,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    n = sum(len(ch.choices[0].token_ids or []) for ch in chunks if ch.choices)
    m = metrics(url)
    assert n == 40
    assert m["kvfold_generation_tokens_total"] - before["kvfold_generation_tokens_total"] == 40


def test_serving_threads_leave_the_http_front_end_a_core(monkeypatch):
    """kvfold serve's kernel threads: torch's count, but at most one fewer than the usable CPUs (at
    least 1), the same on a second call; an explicit --threads wins."""
    import os
    import torch
    from kvfold.server import serving_threads
    for cpus, torch_threads, want in ((2, 2, 1), (1, 1, 1), (8, 4, 4), (8, 8, 7), (16, 1, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        monkeypatch.setattr(torch, "get_num_threads", lambda t=torch_threads: t)
        assert serving_threads() == want
        monkeypatch.setattr(torch, "get_num_threads", lambda t=want: t)  # as if it had been applied
        assert serving_threads() == want
    assert serving_threads(3) == 3
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--threads", "3", "--weights", "quantized"])
    assert (args.threads, args.weights) == (3, "quantized")
    assert parser.parse_args(["serve"]).threads is None


def test_serve_with_decode_graphs_answers_the_openai_client_as_the_forward_does(tiny):
    """`kvfold serve --decode-graphs`: a streamed greedy completion through the real OpenAI client
    gives generate()'s tokens, and /metrics counts the graph-decode steps."""
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    app = build_app(parser.parse_args(["serve", "--model", "tiny-random", "--max-seq-len", "256", "--decode-graphs",
                                       "--api-key", KEY]))
    engine = app.state.engine.engine
    assert engine.graphs is not None and not engine.batch_invariant
    ref = kvfold.generate(tiny, prompt_ids(tiny, "Once upon a time"), 16).tokens
    with serving(app) as url:
        ids = []
        for ch in client(url).completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=16,
                                                 temperature=0, stream=True, extra_body={"return_token_ids": True}):
            if ch.choices:
                ids += ch.choices[0].token_ids
        m = wait_idle(url)
    assert ids == ref
    assert m["kvfold_graph_steps_total"] >= len(ref) - 1 and m["kvfold_graph_recaptures_total"] == 0

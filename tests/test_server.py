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
from kvfold.server.chat_template import ChatTemplate
from kvfold.server.metrics import parse as parse_metrics

from helpers import chunked_reference, serving

KEY = "test-key"




@pytest.fixture(scope="module")
def server(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=16, max_queue=64)
    app = create_app(engine, model_name="tiny", api_key=KEY)
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


def prompt_ids(model, text):
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def test_health_models_and_auth(server):
    url, _ = server
    with urllib.request.urlopen(url + "/health") as r:
        assert json.load(r) == {"status": "ok"}
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, key="wrong-key").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    # no Authorization header at all (the openai client always sends one)
    req = urllib.request.Request(url + "/v1/completions", data=b'{"model": "tiny", "prompt": "hi"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401 and json.load(e.value)["error"]["code"] == "invalid_api_key"


def test_completion_greedy_equals_generate(server, tiny):
    url, _ = server
    ref = kvfold.generate(tiny, prompt_ids(tiny, "Once upon a time"), 16).tokens
    c = client(url)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                             extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == ref and choice.text == tiny.tokenizer.decode(ref)
    assert choice.finish_reason == ("stop" if ref[-1] in tiny.config.eos_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (17, len(ref))

    ids, text = [], ""
    chunks = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
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
    r = c.completions.create(model="tiny", prompt=prompt_ids(tiny, "abc"), max_tokens=8, temperature=0.8, top_p=0.9,
                             seed=3, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == sampled


def test_chat_greedy_equals_generate(server, tiny):
    url, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = prompt_ids(tiny, "<|system|>\nBe brief.\n<|user|>\nHello there\n<|assistant|>\n")
    ref = kvfold.generate(tiny, ids, 12).tokens
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tiny.tokenizer.decode(ref)
    assert r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
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
            model="tiny", prompt=texts[i], max_tokens=64 if i in cancel else max_toks[i], temperature=0,
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
    ra = c.completions.create(model="tiny", prompt=a, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    rb = c.completions.create(model="tiny", prompt=b, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert ra.usage.prompt_tokens_details.cached_tokens == 0
    assert rb.usage.prompt_tokens_details.cached_tokens == 256
    # a cold run: the same prompt through a fresh engine with no prefix cache, and the chunked reference
    cold = kvfold.Engine(tiny, max_seq_len=512, prefix_cache_bytes=0)
    (cb,) = cold.generate([prompt_ids(tiny, b)], kvfold.SamplingParams(max_tokens=8))
    assert rb.choices[0].token_ids == cb.token_ids == chunked_reference(tiny, prompt_ids(tiny, b), 8)
    m = metrics(url)
    assert m["kvfold_prefix_cache_hit_tokens_total"] - before["kvfold_prefix_cache_hit_tokens_total"] == 256
    assert m["kvfold_prefix_cache_hits_total"] - before["kvfold_prefix_cache_hits_total"] == 1
    assert 0 < m["kvfold_prefix_cache_hit_rate"] <= 1 and m["kvfold_prefix_cache_bytes"] > 0
    assert m["kvfold_prefix_cache_pages"] >= 2 and m["kvfold_kv_page_bytes_used"] > 0


def test_request_errors(server):
    url, _ = server
    c = client(url)

    def error_of(exc_type, status, **kw):
        with pytest.raises(exc_type) as e:
            c.completions.create(**{"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw})
        assert e.value.status_code == status
        err = e.value.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    err = error_of(openai.BadRequestError, 400, prompt="x" * 500, max_tokens=20)  # 501 + 20 > 512
    assert err["code"] == "context_length_exceeded" and "max_seq_len" in err["message"]
    assert error_of(openai.BadRequestError, 400, temperature=3.0)["param"] == "temperature"
    assert error_of(openai.BadRequestError, 400, prompt=[1, 2, 100000])["type"] == "invalid_request_error"
    assert error_of(openai.BadRequestError, 400, n=2)["param"] == "n"
    assert error_of(openai.NotFoundError, 404, model="gpt-4")["code"] == "model_not_found"
    err = error_of(openai.APIStatusError, 413, prompt="x" * (1 << 20))
    assert err["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 600}])
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
        status, body = post('{"model": "tiny", "prompt": "\\ud800x", "max_tokens": 2}')  # JSON escape, ASCII body
        assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
        status, body = post("[" * 100_000 + "]" * 100_000)
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        status, body = post(json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        conn.close()


def test_queue_full_is_503(tiny):
    """One running sequence, one waiting: the third request is refused with 503, the others complete."""
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=1, max_queue=1)
    with serving(create_app(engine, model_name="tiny")) as url:
        c = client(url)
        first = c.completions.create(model="tiny", prompt="long runner", max_tokens=400, temperature=0, stream=True)
        next(iter(first))  # its first token: it is running now
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(
            r=c.completions.create(model="tiny", prompt="queued", max_tokens=2, temperature=0)))
        t.start()
        deadline = time.monotonic() + 20
        while metrics(url)["kvfold_queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="one too many", max_tokens=2)
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
    args = parser.parse_args(["serve", "--model", "tiny", "--max-seq-len", "256"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    app = build_app(args)
    assert app.state.engine.engine.max_seq_len == 256
    assert app.state.engine.engine.pages.num_pages == 16 * 2  # default: max-running sequences of max-seq-len
    assert app.state.engine.engine.model.batch_invariant  # the serving default
    args = parser.parse_args(["serve", "--model", "tiny", "--max-seq-len", "256", "--kv-page-bytes", "0",
                              "--no-batch-invariant"])
    app = build_app(args)
    assert app.state.engine.engine.pages is None  # private per-sequence pools
    assert not app.state.engine.engine.model.batch_invariant

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    tpl = ChatTemplate.for_model(tiny.tokenizer, tmp_path)
    ids = tpl.render([{"role": "user", "content": "hi"}])
    assert tiny.tokenizer.decode(ids) == "<s>[user] hi\n[assistant] "
    plain = ChatTemplate.for_model(tiny.tokenizer, None).render([{"role": "user", "content": "hi"}])
    assert plain == prompt_ids(tiny, "<|user|>\nhi\n<|assistant|>\n")

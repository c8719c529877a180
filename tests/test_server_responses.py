"""OpenAI's Responses API (/v1/responses) with the real `openai` client against a live server of
the tiny model: the response object, its storage (retrieve, delete, input_items, LRU eviction),
exact resumption with previous_response_id (turn 2 from the stored snapshot equals the same
conversation sent whole, and a cold run, token for token and logprob for logprob), streaming
events, structured output, a forced function-call round trip in DeepSeek-V4's format, reasoning
items, background responses and cancel, and the refusals.
"""
import json
from array import array

import httpx
import jsonschema
import openai
import pytest

import kvfold
from kvfold.chat.template import ChatTemplate
from kvfold.engine import Engine, SamplingParams
from kvfold.engine.checkpoint import Checkpoint
from kvfold.engine.response_store import ResponseStore, StoredResponse
from kvfold.server.app import create_app

from helpers import random_ids, serving

MODEL = "tiny-random"
KEY = "test-key"
LONG = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 4  # > 256 tokens
GREEDY = {"temperature": 0, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def plain(tiny):
    """The plain template, an API key, no prefix cache: only the response store resumes."""
    engine = kvfold.Engine(tiny, max_seq_len=2048, max_running=8, prefix_cache_bytes=0)
    app = create_app(engine, model_name=MODEL, api_key=KEY)
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def dsv4(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=4096, max_running=8)
    app = create_app(engine, model_name=MODEL, chat_template=ChatTemplate.deepseek_v4(tiny.tokenizer))
    with serving(app) as url:
        yield url, app


def client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def logprobs(resp):
    return [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
            for item in resp.output if item.type == "message" for lp in item.content[0].logprobs]


def sent_back(resp):
    """A response's output items as a client sends them back in `input`."""
    return [item.model_dump(exclude_none=True) for item in resp.output]


def events(url, body, key=KEY):
    """A streamed response's (event name, data) pairs, read off the wire."""
    out, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


# ---- the engine's checkpoints -----------------------------------------------------------------------

def _run(engine, prompt, checkpoint=None, n=6):
    rid = engine.add_choices(prompt, [SamplingParams(max_tokens=n, logprobs=2, ignore_eos=True)],
                             checkpoint=checkpoint)[0]
    toks, lps, cached = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                lps += [(e.token, e.logprob, e.top) for e in o.logprobs or []]
                cached = o.cached_tokens
    return toks, lps, cached


@pytest.mark.parametrize("kv_page_bytes", [None, 0], ids=["paged", "private"])
def test_a_checkpoint_resumes_bit_identically_and_a_bad_one_changes_nothing(tiny, kv_page_bytes):
    p1 = random_ids(300, tiny.config.vocab_size, seed=3).tolist()
    engine = Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0, kv_page_bytes=kv_page_bytes)
    first = Checkpoint(capture=True)
    out1, _, _ = _run(engine, p1, first)
    ids, blob = first.taken
    assert list(ids) == p1[:256]  # the prompt's last block boundary, taken as its prefill passed it
    p2 = p1 + out1 + random_ids(40, tiny.config.vocab_size, seed=4).tolist()
    cold = _run(Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0, kv_page_bytes=kv_page_bytes), p2)
    second = Checkpoint(ids, blob, capture=True)
    assert _run(engine, p2, second) == (cold[0], cold[1], 256) and second.used
    assert list(second.taken[0]) == p2[:256]  # its last boundary is the same one: handed on
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    third = Checkpoint(ids, bytes(bad))
    assert _run(engine, p2, third) == (cold[0], cold[1], 0)  # prefilled again, same bits
    assert third.refused.startswith("SnapshotChecksumError") and not third.used
    other = Checkpoint(array("q", p2[:255]) + array("q", [0]), blob)  # ids that are not the prompt's
    assert _run(engine, p2, other)[2] == 0 and not other.used and other.refused is None


def test_the_store_is_lru_under_its_budget():
    store = ResponseStore(max_bytes=3000)
    blob = (array("q", range(10)), b"x" * 1000)
    recs = [StoredResponse(f"resp_{i}", {"i": i}, [], (), blob) for i in range(3)]
    assert store.put(recs[0]) and store.put(recs[1])
    store.get("resp_0")  # now the most recently used
    recs[1].running = object()  # a running background response is never evicted
    assert store.put(recs[2])
    assert store.get("resp_0") is None and store.get("resp_1") is recs[1] and store.evictions == 1
    big = StoredResponse("resp_big", {}, [], (), (array("q"), b"x" * 5000))
    assert store.put(big) and big.checkpoint is None  # kept without a snapshot over the whole budget
    store.drop_checkpoint("resp_2")
    assert store.get("resp_2").checkpoint is None and store.refused_checkpoints == 1
    assert store.nbytes == sum(r.nbytes for r in store._records.values()) <= store.max_bytes


# ---- the response object and its storage ------------------------------------------------------------

def test_create_retrieve_list_input_items_and_delete(plain):
    url, _ = plain
    c = client(url)
    r = c.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."},
                                               {"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "More?"}]}],
                           instructions="Be brief.", max_output_tokens=5, temperature=0,
                           metadata={"k": "v"}, user="u1", prompt_cache_key="p", safety_identifier="s")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.store
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    u = r.usage
    assert (u.output_tokens, u.total_tokens, u.input_tokens_details.cached_tokens) == (5, u.input_tokens + 5, 0)
    assert (r.instructions, r.metadata, r.user, r.temperature, r.tool_choice) == \
        ("Be brief.", {"k": "v"}, "u1", 0, "auto")
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = c.responses.input_items.list(r.id)
    assert [i.role for i in listed.data] == ["user", "assistant", "user"]  # newest first
    assert listed.data[0].content[0].text == "More?" and all(i.id for i in listed.data)
    asc = [i.id for i in c.responses.input_items.list(r.id, order="asc")]
    assert asc == [i.id for i in reversed(listed.data)]
    page = c.responses.input_items.list(r.id, order="asc", limit=1)
    assert page.has_more and [i.id for i in page] == asc  # the SDK follows `after` for the rest
    c.responses.delete(r.id)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "not_found"
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_previous_response_id_resumes_exactly_as_the_whole_conversation_and_a_cold_run(plain, tiny):
    url, app = plain
    c = client(url)
    r1 = c.responses.create(model=MODEL, input=LONG, max_output_tokens=6, **GREEDY)
    n1 = r1.usage.input_tokens
    stored = app.state.responses.get(r1.id).checkpoint
    assert n1 > 256 and len(stored[0]) == n1 // 128 * 128
    r2 = c.responses.create(model=MODEL, input="And then?", previous_response_id=r1.id, max_output_tokens=6, **GREEDY)
    assert r2.previous_response_id == r1.id and r2.usage.input_tokens_details.cached_tokens == n1 // 128 * 128
    whole = [{"role": "user", "content": LONG}] + sent_back(r1) + [{"role": "user", "content": "And then?"}]
    stateless = c.responses.create(model=MODEL, input=whole, max_output_tokens=6, store=False, **GREEDY)
    assert stateless.usage.input_tokens_details.cached_tokens == 0  # no prefix cache here: a cold run
    cold_app = create_app(kvfold.Engine(tiny, max_seq_len=2048, prefix_cache_bytes=0), model_name=MODEL)
    with serving(cold_app) as cold_url:
        cold = client(cold_url, "none").responses.create(model=MODEL, input=whole, max_output_tokens=6, **GREEDY)
    assert r2.usage.input_tokens == stateless.usage.input_tokens == cold.usage.input_tokens
    assert r2.output_text == stateless.output_text == cold.output_text
    assert logprobs(r2) == logprobs(stateless) == logprobs(cold) and len(logprobs(r2)) == 6
    # a third turn resumes from the second's snapshot
    r3 = c.responses.create(model=MODEL, input="Go on.", previous_response_id=r2.id, max_output_tokens=4, **GREEDY)
    whole3 = whole + sent_back(r2) + [{"role": "user", "content": "Go on."}]
    again = c.responses.create(model=MODEL, input=whole3, max_output_tokens=4, store=False, **GREEDY)
    assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens // 128 * 128
    assert (r3.output_text, logprobs(r3)) == (again.output_text, logprobs(again))


def test_a_snapshot_that_fails_its_checks_is_dropped_never_served(plain):
    url, app = plain
    c = client(url)
    r1 = c.responses.create(model=MODEL, input=LONG + " Twice.", max_output_tokens=4, **GREEDY)
    rec = app.state.responses.get(r1.id)
    ids, blob = rec.checkpoint
    bad = bytearray(blob)
    bad[-10] ^= 0x40
    rec.checkpoint = (ids, bytes(bad))
    refused = app.state.responses.refused_checkpoints
    r2 = c.responses.create(model=MODEL, input="Next?", previous_response_id=r1.id, max_output_tokens=4, **GREEDY)
    assert r2.usage.input_tokens_details.cached_tokens == 0  # the history was prefilled again
    assert rec.checkpoint is None and app.state.responses.refused_checkpoints == refused + 1
    whole = [{"role": "user", "content": LONG + " Twice."}] + sent_back(r1) + [{"role": "user", "content": "Next?"}]
    ref = c.responses.create(model=MODEL, input=whole, max_output_tokens=4, store=False, **GREEDY)
    assert (r2.output_text, logprobs(r2)) == (ref.output_text, logprobs(ref))
    r3 = c.responses.create(model=MODEL, input="Again?", previous_response_id=r1.id, max_output_tokens=4, **GREEDY)
    assert r3.usage.input_tokens_details.cached_tokens == 0 and r3.output_text == r2.output_text


def test_unknown_and_evicted_previous_responses_are_not_found(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=1024, prefix_cache_bytes=0)
    app = create_app(engine, model_name=MODEL, responses_store_bytes=150_000)  # one snapshot of ~256 tokens fits
    with serving(app) as url:
        c = client(url, "none")
        first = c.responses.create(model=MODEL, input=LONG, max_output_tokens=2)
        second = c.responses.create(model=MODEL, input=LONG + "!", max_output_tokens=2)
        assert app.state.responses.get(second.id) is not None and app.state.responses.evictions >= 1
        for rid in (first.id, "resp_nope"):
            with pytest.raises(openai.NotFoundError) as err:
                c.responses.create(model=MODEL, input="x", previous_response_id=rid, max_output_tokens=2)
            body = err.value.body
            assert (body["code"], body["param"], body["type"]) == ("previous_response_not_found",
                                                                   "previous_response_id", "invalid_request_error")


# ---- streaming ---------------------------------------------------------------------------------------

def test_stream_events_follow_the_responses_grammar(plain):
    url, _ = plain
    evs = events(url, {"model": MODEL, "input": "Hi there", "max_output_tokens": 6, **GREEDY})
    names = [n for n, _ in evs]
    assert all(n == d["type"] for n, d in evs)
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    deltas = [d for n, d in evs if n == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert names[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    done = dict(evs)["response.output_text.done"]
    assert "".join(d["delta"] for d in deltas) == done["text"]
    assert [x for d in deltas for x in d["logprobs"]] == done["logprobs"][:sum(len(d["logprobs"]) for d in deltas)]
    final = evs[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == done["text"] and final["usage"]["output_tokens"] == 6
    assert evs[0][1]["response"]["status"] == "in_progress" and evs[0][1]["response"]["output"] == []
    stored = client(url).responses.retrieve(final["id"])
    assert stored.status == final["status"] and stored.output_text == done["text"]


def test_structured_output_with_the_sdk_stream_and_create(plain):
    url, _ = plain
    c = client(url)
    text = {"format": {"type": "json_schema", "name": "cat", "schema": CAT, "strict": True}}
    with c.responses.stream(model=MODEL, input="Describe a cat as JSON.", text=text, max_output_tokens=400,
                            temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), CAT)
    chunks = list(c.responses.create(model=MODEL, input="Another cat.", text=text, max_output_tokens=400,
                                     stream=True, temperature=0.8, top_p=0.9))
    assert chunks[-1].type == "response.completed" and chunks[-1].response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(chunks[-1].response.output_text), CAT)


# ---- tools and reasoning (DeepSeek-V4's format) ------------------------------------------------------

def test_forced_function_call_round_trip(dsv4):
    url, _ = dsv4
    c = client(url, "none")
    kw = dict(model=MODEL, tools=[WEATHER], max_output_tokens=300, temperature=0)
    r1 = c.responses.create(input="Weather in Paris for 3 days?",
                            tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21C"}
    r2 = c.responses.create(input=[result], previous_response_id=r1.id, tool_choice="none", **kw)
    assert r2.status in ("completed", "incomplete") and not [o for o in r2.output if o.type == "function_call"]
    whole = [{"role": "user", "content": "Weather in Paris for 3 days?"}] + sent_back(r1) + [result]
    ref = c.responses.create(input=whole, tool_choice="none", store=False, **kw)
    assert ref.output_text == r2.output_text and ref.usage.input_tokens == r2.usage.input_tokens
    listed = c.responses.input_items.list(r2.id)
    assert [(i.type, i.call_id, i.output) for i in listed] == [("function_call_output", calls[0].call_id,
                                                                 "Sunny, 21C")]
    evs = events(url, {**kw, "input": "Weather?", "tool_choice": "required", "parallel_tool_calls": False})
    names = [n for n, _ in evs]
    assert "response.function_call_arguments.delta" in names and names[-1] == "response.completed"
    done = next(d for n, d in evs if n == "response.function_call_arguments.done")
    item = next(d["item"] for n, d in evs if n == "response.output_item.done" and d["item"]["type"] == "function_call")
    assert done["arguments"] == item["arguments"] and item["status"] == "completed"


def test_reasoning_items_and_effort(dsv4):
    url, _ = dsv4
    c = client(url, "none")
    r = c.responses.create(model=MODEL, input="Think first.", reasoning={"effort": "high", "summary": "auto"},
                           max_output_tokens=8, temperature=0)
    (item,) = r.output
    assert item.type == "reasoning" and item.summary == [] and item.content[0].type == "reasoning_text"
    assert r.usage.output_tokens_details.reasoning_tokens == 8 and r.reasoning.effort == "high"
    evs = events(url, {"model": MODEL, "input": "Think first.", "reasoning": {"effort": "low"},
                       "max_output_tokens": 8, "temperature": 0})
    text = "".join(d["delta"] for n, d in evs if n == "response.reasoning_text.delta")
    assert text and text == next(d["text"] for n, d in evs if n == "response.reasoning_text.done")
    plain_turn = c.responses.create(model=MODEL, input="Answer.", reasoning={"effort": "none"}, max_output_tokens=4,
                                    temperature=0)
    assert [o.type for o in plain_turn.output] == ["message"]
    assert plain_turn.usage.output_tokens_details.reasoning_tokens == 0
    # a reasoning item sent back renders as the assistant turn's reasoning
    back = c.responses.create(model=MODEL, input=[{"role": "user", "content": "Q"}] + sent_back(r) +
                              [{"role": "user", "content": "And?"}], max_output_tokens=2, store=False, temperature=0)
    assert back.status == "incomplete"


# ---- background and cancel ---------------------------------------------------------------------------

def test_background_response_polls_and_cancels(plain):
    url, _ = plain
    c = client(url)
    r = c.responses.create(model=MODEL, input=LONG, background=True, max_output_tokens=1500, temperature=0)
    assert r.status == "in_progress" and r.background
    assert c.responses.retrieve(r.id).status == "in_progress"  # 1,500 tokens take seconds
    cancelled = c.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and c.responses.retrieve(r.id).status == "cancelled"
    assert c.responses.cancel(r.id).status == "cancelled"  # a finished one is returned as it is
    done = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(done.id)
    for extra in ({"store": False}, {"stream": True}):
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=MODEL, input="Hi", background=True, **extra)
        assert err.value.body["param"] == "background"


# ---- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}, "input.0.encrypted_content"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0.type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}]}, "tools.0.tools.0.type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["everything"]}, "include.0"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_output_tokens": 4000}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": None}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{}"}]}, "input.1"),
])
def test_refused_fields_name_their_param(plain, extra, param):
    url, _ = plain
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_codex_cli_tools_namespaces_and_web_search(dsv4):
    """What Codex CLI sends: a `namespace` tool (its functions offered as NAMESPACE.NAME, a call of
    one comes back with `namespace`), a `web_search` tool (accepted, not offered: kvfold runs no
    hosted tool), and its other fields, streamed, unstored; the call then goes back as input."""
    url, _ = dsv4
    group = {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [WEATHER]}
    body = {"model": MODEL, "input": "Weather?", "tools": [{"type": "web_search", "external_web_access": False}, group],
            "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 300, "temperature": 0,
            "stream": True, "store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
            "prompt_cache_key": "k", "client_metadata": {"session_id": "s"}}
    evs = events(url, body, key="none")
    assert [n for n, _ in evs][-1] == "response.completed"
    item = next(d["item"] for n, d in evs if n == "response.output_item.done" and d["item"]["type"] == "function_call")
    assert (item["namespace"], item["name"]) == ("agents", "get_weather")
    jsonschema.validate(json.loads(item["arguments"]), WEATHER["parameters"])
    assert [t["name"] for t in evs[-1][1]["response"]["tools"]] == ["agents.get_weather"]
    call = {k: item[k] for k in ("type", "call_id", "name", "namespace", "arguments")}
    result = {"type": "function_call_output", "call_id": item["call_id"], "output": "Sunny"}
    again = {**body, "input": [{"role": "user", "content": "Weather?"}, call, result], "tool_choice": "auto",
             "parallel_tool_calls": True, "stream": False, "max_output_tokens": 2}
    r = httpx.post(url + "/v1/responses", json=again, timeout=120)
    assert r.status_code == 200, r.text


def test_metadata_fields_are_accepted_and_the_key_is_required(plain):
    url, _ = plain
    c = client(url)
    r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0, service_tier="auto",
                           parallel_tool_calls=True,
                           prompt_cache_retention="in_memory", stream_options=None, max_tool_calls=3,
                           reasoning={"effort": "none", "summary": "auto"}, text={"format": {"type": "text"}},
                           extra_body={"client_metadata": {"app": "x"}, "background_options": {}})
    assert r.status == "incomplete"
    for method, path in (("POST", "/v1/responses"), ("GET", f"/v1/responses/{r.id}"),
                         ("DELETE", f"/v1/responses/{r.id}"), ("POST", f"/v1/responses/{r.id}/cancel"),
                         ("GET", f"/v1/responses/{r.id}/input_items")):
        assert httpx.request(method, url + path, json={}).status_code == 401


def test_an_engine_failure_is_a_failed_response(plain, monkeypatch):
    url, app = plain
    engine = app.state.server.engine

    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(engine, "_run_batch", boom)
    evs = events(url, {"model": MODEL, "input": "Hi", "max_output_tokens": 4})
    assert [n for n, _ in evs] == ["response.created", "response.in_progress", "response.failed"]
    failed = evs[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "boom" in failed["error"]["message"]
    assert client(url).responses.retrieve(failed["id"]).status == "failed"
    with pytest.raises(openai.InternalServerError):
        client(url).responses.create(model=MODEL, input="Hi", max_output_tokens=4)


def test_encrypted_reasoning_round_trips_to_the_exact_ids_and_forgeries_are_refused(dsv4):
    """include reasoning.encrypted_content (as Codex CLI sends it, store false): each reasoning item
    carries its token ids, signed; sent back, the prompt holds exactly those ids (the tiny model's
    reasoning is bytes no text encodes back to, so re-tokenizing its text could not); a blob that
    is garbage, altered, signed with another key or for another model is a 400 naming it."""
    from kvfold.server.anthropic_format import ThinkingSigner
    from kvfold.server.openai_responses_format import seal, unseal
    from kvfold.server.openai_responses_schemas import ResponsesRequest, items
    from kvfold.server.openai_responses_translate import render
    url, app = dsv4
    c = client(url, "none")
    signer, tok = app.state.thinking_signer, app.state.server.tokenizer
    kw = dict(model=MODEL, reasoning={"effort": "high"}, temperature=0, store=False)
    r = c.responses.create(input="Think first.", max_output_tokens=12, include=["reasoning.encrypted_content"], **kw)
    (item,) = r.output
    blob = item.encrypted_content
    ids = unseal(signer, MODEL, blob, "x")
    assert len(ids) == r.usage.output_tokens_details.reasoning_tokens == 12
    assert tok.decode(ids) == item.content[0].text and tok.encode_text(tok.decode(ids)) != ids  # not re-tokenizable
    assert c.responses.create(input="Think first.", max_output_tokens=4, **kw).output[0].encrypted_content is None
    # sent back with tools (DeepSeek-V4 then shows every turn's reasoning): the prompt holds the ids, then </think>
    body = {"model": MODEL, "reasoning": {"effort": "high"}, "tools": [WEATHER], "tool_choice": "none", "store": False,
            "input": [{"role": "user", "content": "Think first."},
                      {"type": "reasoning", "summary": [], "encrypted_content": blob},
                      {"role": "user", "content": "And?"}]}
    req = ResponsesRequest.model_validate(body)
    _, prompt, _ = render(app.state.server, req, [(f"input.{i}", it) for i, it in enumerate(items(req.input))], signer)
    run = ids + tok.encode("</think>")
    assert any(prompt[k:k + len(run)] == run for k in range(len(prompt)))
    back = c.responses.create(**{**body, "max_output_tokens": 1, "temperature": 0})
    assert back.usage.input_tokens == len(prompt)
    payload = blob.split(".")[1]
    altered = blob.replace(payload, payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1])
    for bad in ("abc", altered, seal(signer, "other-model", ids), seal(ThinkingSigner(b"another key"), MODEL, ids)):
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(**{**body, "input": body["input"][:1] + [{**body["input"][1], "encrypted_content": bad}]})
        assert err.value.body["param"] == "input.1.encrypted_content", err.value.body

"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) with the real `anthropic`
client against a live server of the tiny model, in DeepSeek-V4's chat format (tools, thinking
mode) and in the plain template with a short context.

The installed SDK no longer takes `temperature` as an argument (newer Claude models refuse
sampling parameters); clients still send it, so the tests pass it in `extra_body`.
"""
import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

import kvfold
from kvfold.chat.template import ChatTemplate
from kvfold.server.anthropic import error_response
from kvfold.server.anthropic_format import ThinkingSigner
from kvfold.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from kvfold.server.anthropic_translate import chat_body, chat_messages, render
from kvfold.server.app import create_app
from kvfold.server.schemas import ApiError, parse

from helpers import serving

KEY = "test-key"
MODEL = "tiny-random"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def dsv4(tiny):
    """DeepSeek-V4's format (tools, thinking) with an API key; the app, for its context and signer."""
    engine = kvfold.Engine(tiny, max_seq_len=2048, max_running=8)
    app = create_app(engine, model_name=MODEL, api_key=KEY, chat_template=ChatTemplate.deepseek_v4(tiny.tokenizer))
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def plain(tiny):
    """The plain template, no key, a 128-token context."""
    with serving(create_app(kvfold.Engine(tiny, max_seq_len=128, max_running=4), model_name=MODEL)) as url:
        yield url


def client(url, key=KEY, **kw):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def raw_events(url, body, headers=None, path="/v1/messages") -> list[tuple[str, dict]]:
    """A streamed response's (event name, data) pairs, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120,
                      headers={"x-api-key": KEY, **(headers or {})}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


def check_grammar(events: list[tuple[str, dict]]) -> None:
    """Anthropic's event order: message_start, a ping, blocks (start, deltas, stop, indexes in
    order), message_delta, message_stop; each `event:` line names its data's type."""
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    index, open_block = -1, None
    for name, data in events[2:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_block is None and data["index"] == index + 1
            index, open_block = data["index"], data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == index and open_block is not None
            kind = data["delta"]["type"]
            assert kind == {"text": "text_delta", "tool_use": "input_json_delta"}.get(open_block, kind)
            assert open_block != "thinking" or kind in ("thinking_delta", "signature_delta")
        else:
            assert name == "content_block_stop" and data["index"] == index
            open_block = None
    assert open_block is None


def test_a_greedy_reply_is_the_chat_completions_reply(dsv4):
    """The same conversation through both APIs: the same text, token for token, the same counts."""
    url, _ = dsv4
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."},
               {"role": "user", "content": "What is a list?"}]
    a = client(url).messages.create(model=MODEL, max_tokens=24, system="Be brief.", messages=history,
                                    extra_body=GREEDY)
    o = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[{"role": "system", "content": "Be brief."}, *history])
    assert text_of(a) == o.choices[0].message.content
    assert a.usage.output_tokens == o.usage.completion_tokens
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == o.usage.prompt_tokens
    assert a.usage.cache_creation_input_tokens == 0
    assert a.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[o.choices[0].finish_reason]
    assert a.id.startswith("msg_") and a.type == "message" and a.role == "assistant" and a.model == MODEL
    # the system prompt as text blocks (cache_control and all) is the same prompt, blocks joined by a blank line
    blocks = client(url).messages.create(model=MODEL, max_tokens=24, messages=history, extra_body=GREEDY,
                                         system=[{"type": "text", "text": "Be"},
                                                 {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}])
    joined = client(url).messages.create(model=MODEL, max_tokens=24, messages=history, extra_body=GREEDY,
                                         system="Be\n\nbrief.")
    assert text_of(blocks) == text_of(joined)


def test_a_stream_follows_the_event_grammar_and_adds_up_to_the_whole_reply(dsv4):
    url, _ = dsv4
    body = {"model": MODEL, "max_tokens": 20, "messages": ASK, **GREEDY}
    whole = client(url).messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    events = raw_events(url, body)
    check_grammar(events)
    deltas = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert deltas == text_of(whole) and deltas
    start, end = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert end["delta"]["stop_reason"] == whole.stop_reason and end["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's own accumulation of the stream
    with client(url).messages.stream(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_forced_tool_call_and_its_result_round_trip(dsv4):
    url, _ = dsv4
    c = client(url)
    kw = dict(model=MODEL, max_tokens=300, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    r = c.messages.create(messages=ASK, extra_body=GREEDY, **kw)
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # streamed, the input comes in input_json_delta fragments that the SDK puts together
    with c.messages.stream(messages=ASK, extra_body=GREEDY, **kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "sunny, 21 C"}]}]
    again = c.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=history, extra_body=GREEDY)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert c.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens == \
        again.usage.input_tokens + again.usage.cache_read_input_tokens
    _, app = dsv4
    text = app.state.server.tokenizer.decode(_rendered(app, {"model": MODEL, "messages": history, "tools": [WEATHER]}))
    assert '<｜DSML｜invoke name="get_weather">' in text and "<tool_result>sunny, 21 C</tool_result>" in text


def _rendered(app, body, model=CountTokensRequest) -> list[int]:
    return render(app.state.server, parse(model, body), app.state.thinking_signer).ids


def test_thinking_turns_the_reasoning_mode_on(dsv4):
    url, app = dsv4
    tok = app.state.server.tokenizer
    body = {"model": MODEL, "messages": ASK}
    prompts = {kind: tok.decode(_rendered(app, {**body, "thinking": cfg})) for kind, cfg in (
        ("enabled", {"type": "enabled", "budget_tokens": 1024}), ("disabled", {"type": "disabled"}),
        ("adaptive", {"type": "adaptive", "display": "omitted"}))}
    assert prompts["enabled"].endswith("<｜Assistant｜><think>") and prompts["disabled"].endswith("</think>")
    assert prompts["adaptive"] == prompts["enabled"] and tok.decode(_rendered(app, body)) == prompts["disabled"]
    counts = {k: client(url).messages.count_tokens(model=MODEL, messages=ASK, thinking=cfg).input_tokens
              for k, cfg in (("on", {"type": "enabled", "budget_tokens": 1024}), ("off", {"type": "disabled"}))}
    assert counts == {"on": len(tok.encode(prompts["enabled"])), "off": len(tok.encode(prompts["disabled"]))}
    assert counts["on"] != counts["off"]


def test_a_thinking_block_is_signed_and_its_signature_checked_in_history(dsv4):
    """In thinking mode the random model never closes </think>: its output is one thinking block,
    whose signature lets it come back in history; altered, it is refused."""
    url, app = dsv4
    c = client(url)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    r = c.messages.create(model=MODEL, max_tokens=1100, messages=ASK, thinking=thinking, extra_body=GREEDY)
    block = r.content[0]
    assert block.type == "thinking" and block.thinking and r.stop_reason in ("end_turn", "max_tokens")
    assert app.state.thinking_signer.verify(block.thinking, block.signature)
    events = raw_events(url, {"model": MODEL, "max_tokens": 1100, "messages": ASK, "thinking": thinking, **GREEDY})
    check_grammar(events)
    assert [d["delta"]["type"] for n, d in events if n == "content_block_delta"][-1] == "signature_delta"
    follow = [{"role": "user", "content": "And tomorrow?"}]
    turn = {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "Sunny."}]}
    ok = c.messages.count_tokens(model=MODEL, messages=ASK + [turn] + follow, thinking=thinking)
    assert ok.input_tokens > 0
    forged = {"role": "assistant", "content": [{**block.model_dump(), "thinking": block.thinking + "!"}]}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=1100, messages=ASK + [forged] + follow, thinking=thinking)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "signature" in e.value.body["error"]["message"]


def test_signatures_are_hmacs_under_the_servers_key():
    a, b = ThinkingSigner(b"one"), ThinkingSigner(b"two")
    sig = a.sign("Paris is in France.")
    assert a.verify("Paris is in France.", sig) and not a.verify("Paris is in France!", sig)
    assert not b.verify("Paris is in France.", sig) and not a.verify("Paris is in France.", sig[:-1])
    signer = ThinkingSigner(b"k")
    req = parse(CountTokensRequest, {"model": MODEL, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": signer.sign("hmm")},
                                          {"type": "text", "text": "a"}]},
        {"role": "user", "content": "q2"}]})
    messages, _ = chat_messages(req, signer)
    assert messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "hmm"}
    with pytest.raises(ApiError) as e:
        chat_messages(req, ThinkingSigner(b"another server"))
    assert e.value.status == 400 and e.value.param == "messages.1.content.0.signature"


def test_the_translation_merges_turns_and_places_tool_results():
    signer = ThinkingSigner(b"k")
    req = parse(MessagesRequest, {"model": MODEL, "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
                                  "stop_sequences": ["\n\n"], "tools": [WEATHER],
                                  "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                  "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"x": 1}},
                                          {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "c"},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": "r2", "is_error": True},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "r"}, {"type": "text", "text": "1"}]}]}]})
    messages, origin = chat_messages(req, signer)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert messages[1]["content"] == "a\n\nb" and messages[2]["content"] == ""
    assert messages[2]["tool_calls"][0] == {"id": "t1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": '{"x": 1}'}}
    assert [messages[3]["content"], messages[4]["content"], messages[5]["content"]] == ["Error: r2", "r\n\n1", "c"]
    assert origin == ["system", "messages.0", "messages.2", "messages.3.content.1", "messages.3.content.2",
                      "messages.3"]
    body = chat_body(req, None, messages)
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"]) == ("required", False, ["\n\n"])
    assert body["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


def test_system_messages_in_the_conversation():
    """The mid-conversation-system beta: leading system messages join the system prompt, later ones
    are DeepSeek-V4's developer turn (another format's system message), and clear_at
    "next_user_message" drops one once a user message follows it."""
    req = parse(CountTokensRequest, {"model": MODEL, "system": "s", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "s2"}]},
        {"role": "user", "content": "a"}, {"role": "system", "content": "agents", "output_config": {"effort": "low"}},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": "gone", "clear_at": "next_user_message"}, {"role": "user", "content": "c"},
        {"role": "system", "content": "kept", "clear_at": "next_user_message"}]})
    dsv4 = ChatTemplate.deepseek_v4(None)
    messages, origin = chat_messages(req, ThinkingSigner(b"k"), dsv4)
    assert messages == [{"role": "system", "content": "s\n\ns2"}, {"role": "user", "content": "a"},
                        {"role": "developer", "content": "agents"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}, {"role": "developer", "content": "kept"}]
    assert origin == ["system", "messages.1", "messages.2", "messages.3", "messages.5", "messages.6"]
    assert chat_messages(req, ThinkingSigner(b"k"))[0][2] == {"role": "system", "content": "agents"}


def test_the_api_key_comes_as_x_api_key_or_bearer(dsv4):
    url, _ = dsv4
    assert client(url).messages.create(model=MODEL, max_tokens=2, messages=ASK).type == "message"
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(url, key="wrong").messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.status_code == 401 and e.value.body == {
        "type": "error", "error": {"type": "authentication_error", "message": "incorrect API key"}}
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in r.json()["error"]["message"]


BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"}]}]},
     "tool_result for 'x'"),
    ({"messages": ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                         {"role": "user", "content": "no result"}]}, "no tool_result"),
    ({"messages": ASK + [{"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": [{"role": "system", "content": "x"}]}, "no user message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x", "clear_at": "never"}]}, "belong to system messages"),
    ({"messages": ASK + [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "type 'tool_use'"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty content"),
    ({"typical_p": 0.5}, "unrecognized parameter typical_p"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice names 'nope'"),
    ({"tool_choice": {"type": "any"}}, 'tool_choice "any" needs tools'),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"compaction": {"type": "summarize"}}, "compaction"),
    ({"thread": {"type": "create"}}, "thread"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
    ({"tools": [{**WEATHER, "name": "t" * 65}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "disable_parallel_tool_use"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages: the prompt is"),
]


@pytest.mark.parametrize("change,words", BAD, ids=[w for _, w in BAD])
def test_bad_requests_are_400s_in_anthropics_shape(dsv4, change, words):
    url, _ = dsv4
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": MODEL, "max_tokens": 4, "messages": ASK, **change})
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"], body


def test_other_errors_in_anthropics_shape(dsv4):
    url, app = dsv4
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(url + path, headers={"x-api-key": KEY}, json={"model": "nope", "messages": ASK, **extra})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = httpx.post(url + path, headers={"x-api-key": KEY, "content-type": "application/json"}, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (1 << 20)}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    full = error_response(app.state.server, ApiError(503, "queue full", type="server_error"))
    assert full.status_code == 529 and json.loads(full.body)["error"]["type"] == "overloaded_error"


def test_consecutive_messages_of_a_role_merge(dsv4):
    url, _ = dsv4
    c = client(url)
    split = c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "a"},
                                                           {"role": "user", "content": "b"}])
    one = c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "a\n\nb"}])
    assert split.input_tokens == one.input_tokens


def test_max_tokens_past_the_context_generates_what_fits(plain):
    """A short context (128): max_tokens 32000 is cut to what the prompt leaves, and the reply
    ends there with stop_reason max_tokens; a prompt that alone fills it is a 400."""
    c = client(plain)
    n = c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    r = c.messages.create(model=MODEL, max_tokens=32000, messages=ASK, extra_body={"temperature": 0, "top_k": 5})
    assert r.stop_reason in ("max_tokens", "end_turn") and n + r.usage.output_tokens <= 128
    assert r.stop_reason == "end_turn" or n + r.usage.output_tokens == 128
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "x" * 200}])
    assert e.value.body["error"]["message"].startswith("messages: the prompt is")
    with pytest.raises(anthropic.BadRequestError) as e:  # the plain template has no reasoning mode
        c.messages.create(model=MODEL, max_tokens=2000, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "no reasoning mode" in e.value.body["error"]["message"]
    # ... but adaptive thinking may always not think
    assert c.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "adaptive"}).input_tokens == n


def test_output_config_format_is_structured_output(dsv4):
    url, _ = dsv4
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client(url).messages.create(model=MODEL, max_tokens=60, messages=ASK, extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(text_of(r)), schema)
    assert r.stop_reason == "end_turn"


def test_a_stop_sequence_ends_the_reply(plain):
    c = client(plain)
    free = c.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    text = text_of(free)
    stop = text[5:7]
    r = c.messages.create(model=MODEL, max_tokens=12, messages=ASK, stop_sequences=["\x00never", stop],
                          extra_body=GREEDY)
    assert text_of(r) == text[:text.index(stop)] and r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_a_claude_code_request_is_accepted_and_streams_to_the_end(dsv4):
    """The shape Claude Code (2.1) sends: ?beta=true, its headers, max_tokens 32000 on a small
    context, adaptive thinking with display omitted, context_management, output_config, metadata,
    system blocks and tools with cache_control, text blocks with cache_control, and a system
    message after the user's (the mid-conversation-system beta)."""
    url, _ = dsv4
    body = {
        "model": MODEL, "max_tokens": 32000, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code."},
                   {"type": "text", "text": "Be helpful.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>context</system-reminder>"},
            {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            {"role": "system", "content": "Available agent types: none."}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "user_abc_account_def_session_ghi"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
               "context-management-2025-06-27,mid-conversation-system-2026-04-07,effort-2025-11-24", "anthropic-dangerous-direct-browser-access": "true",
               "x-app": "cli", "user-agent": "claude-cli/2.1.0 (external, cli)"}
    events = raw_events(url, body, headers, path="/v1/messages?beta=true")
    check_grammar(events)
    assert events[-2][1]["delta"]["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
    n = httpx.post(url + "/v1/messages/count_tokens?beta=true", headers={"x-api-key": KEY, **headers},
                   json={k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature", "metadata")})
    assert n.status_code == 200 and n.json()["input_tokens"] + events[-2][1]["usage"]["output_tokens"] <= 2048


def test_pings_between_outputs_lose_nothing(dsv4, monkeypatch):
    """A ping whenever the engine is silent for PING_SECONDS: the wait that times out cancels a
    queue read, which must lose no output."""
    import kvfold.server.anthropic_format as fmt
    url, _ = dsv4
    body = {"model": MODEL, "max_tokens": 40, "messages": ASK, **GREEDY}
    whole = client(url).messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    monkeypatch.setattr(fmt, "PING_SECONDS", 0.0005)
    events = raw_events(url, body)
    check_grammar(events)
    assert sum(n == "ping" for n, _ in events) > 1
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text_of(whole)


def test_a_client_that_goes_away_cancels_its_request(dsv4):
    from kvfold.server.metrics import parse as parse_metrics
    url, _ = dsv4
    body = {"model": MODEL, "max_tokens": 1900, "stream": True, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    def metrics():
        return parse_metrics(httpx.get(url + "/metrics").text)
    cancelled = metrics()["kvfold_requests_cancelled_total"]
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = r.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    deadline = time.monotonic() + 20
    while metrics()["kvfold_running_sequences"] != 0 or metrics()["kvfold_requests_cancelled_total"] == cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)

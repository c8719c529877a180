"""Bad input to the Anthropic Messages and OpenAI Responses routes (issue 43, item 8): each is a 4xx
in that API's own error shape (Anthropic: {"type": "error", "error": {"type", "message"}};
OpenAI: {"error": {...}}), never a 5xx, and leaves nothing behind: the engine idle, no stored
response for a refused POST /v1/responses. (tests/test_server_schemathesis.py fuzzes both
routes against /openapi.json; these are the cases a schema cannot express.)

`previous_response_id` of another model: the response store is the server's own, so an id a
server of model A stored is unknown to a server of model B (404 previous_response_not_found); a
`model` field other than the served one is a 404 model_not_found before the id is looked up; a
record made by another model name in a store that outlived its server is a 404
previous_response_not_found naming that model.
"""

import httpx
import pytest

import kvfold
from kvfold.chat.template import ChatTemplate
from kvfold.server.app import create_app

from helpers import serving, wait_engine_idle

CONTEXT = 256
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
LONG = "The quick brown fox jumps over the lazy dog. " * 40  # > CONTEXT tokens


def _server(tiny, name):
    engine = kvfold.Engine(tiny, max_seq_len=CONTEXT, max_running=4)
    return create_app(engine, model_name=name, chat_template=ChatTemplate.deepseek_v4(tiny.tokenizer))


@pytest.fixture(scope="module")
def two(tiny):
    """Servers of two models (the same weights under two names), DeepSeek-V4's format."""
    a, b = _server(tiny, "model-a"), _server(tiny, "model-b")
    with serving(a) as url_a, serving(b) as url_b:
        yield (url_a, a), (url_b, b)


def idle(app) -> None:
    wait_engine_idle(app.state.engine.engine)


def anthropic_error(server, body, path="/v1/messages", status=400) -> str:
    url, app = server
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k != "max_tokens"}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    idle(app)
    return err["error"]["message"]


def openai_error(server, body, status=400) -> dict:
    url, app = server
    stored = len(app.state.responses)
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error"} and {"message", "type", "param", "code"} <= set(err["error"]), err
    idle(app)
    assert len(app.state.responses) == stored  # a refused request stores nothing
    return err["error"]


def msg(model, messages, **kw):
    return {"model": model, "max_tokens": 8, "messages": messages, **kw}


# ---- Anthropic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("where,messages,named", [
    ("user", [{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages.0.content.0"),
    ("unknown", [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "bogus"}]}],
     "messages.0.content.1"),
    ("tool_result", [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "document", "source": {}}]}]}],
     "messages.2.content.0.content.0"),
    ("system-message", [{"role": "system", "content": [{"type": "tool_use", "id": "x", "name": "n", "input": {}}]},
                        {"role": "user", "content": "hi"}], "messages.0.content.0"),
    ("no-type", [{"role": "user", "content": [{"text": "hi"}]}], "messages.0.content.0"),
])
def test_anthropic_unknown_block_types(two, path, where, messages, named):
    message = anthropic_error(two[0], msg("model-a", messages, tools=[WEATHER]), path)
    assert named in message


def test_anthropic_unknown_system_block_and_server_tool(two):
    assert "system.0" in anthropic_error(two[0], msg("model-a", [{"role": "user", "content": "hi"}],
                                                     system=[{"type": "image", "source": {}}]))
    assert "tools.0" in anthropic_error(two[0], msg("model-a", [{"role": "user", "content": "hi"}],
                                                    tools=[{"type": "web_search_20250305", "name": "web_search"}]))


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_tool_result_without_its_tool_use(two, path):
    lone = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "22C"}]}]
    assert "'nope'" in anthropic_error(two[0], msg("model-a", lone, tools=[WEATHER]), path)
    wrong = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "22C"}]}]
    message = anthropic_error(two[0], msg("model-a", wrong, tools=[WEATHER]), path)
    assert "messages.2.content.0" in message and "'t2'" in message
    # a tool_result answering a tool_use two turns back (not the assistant message right before it)
    late = wrong[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "22C"}]},
                        {"role": "assistant", "content": "It is 22C."},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]
    assert "messages.4.content.0" in anthropic_error(two[0], msg("model-a", late, tools=[WEATHER]), path)


def test_anthropic_prompt_past_the_context(two):
    url, _ = two[0]
    body = msg("model-a", [{"role": "user", "content": LONG}])
    message = anthropic_error(two[0], body)
    assert message.startswith("messages:") and str(CONTEXT) in message
    anthropic_error(two[0], {**body, "stream": True})  # refused before the stream starts
    # count_tokens counts it all the same
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": "model-a", "messages": body["messages"]})
    assert r.status_code == 200 and r.json()["input_tokens"] > CONTEXT


def test_anthropic_another_model(two):
    assert "model-b" in anthropic_error(two[0], msg("model-b", [{"role": "user", "content": "hi"}]), status=404)


# ---- Responses ------------------------------------------------------------------------------------

@pytest.mark.parametrize("inp,param", [
    ([{"type": "image_generation_call", "id": "x"}], "input.0.type"),
    ([{"type": "bogus"}], "input.0.type"),
    ([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input.0.content.0"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_file", "file_id": "f"}]}], "input.1.output.0"),
    ([7], "input.0"),
])
def test_responses_unknown_item_and_part_types(two, inp, param):
    err = openai_error(two[0], {"model": "model-a", "input": inp})
    assert err["param"].startswith(param), err


def test_responses_prompt_past_the_context(two):
    for extra in ({}, {"max_output_tokens": 8}, {"stream": True}, {"background": True}):
        err = openai_error(two[0], {"model": "model-a", "input": LONG, **extra})
        assert err["param"] == "input" and err["code"] == "context_length_exceeded", (extra, err)
    # a prompt that fits, with max_output_tokens past what is left: that field is named
    err = openai_error(two[0], {"model": "model-a", "input": "hi", "max_output_tokens": CONTEXT})
    assert err["param"] == "max_output_tokens", err


def test_responses_previous_response_of_another_model(two):
    (url_a, app_a), (url_b, app_b) = two
    r = httpx.post(url_a + "/v1/responses", json={"model": "model-a", "input": "hi", "max_output_tokens": 4,
                                                 "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    # a server of model B has no such response
    err = openai_error((url_b, app_b), {"model": "model-b", "input": "more", "previous_response_id": rid}, 404)
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
    # server A, asked for model B: the model is unknown there
    err = openai_error((url_a, app_a), {"model": "model-b", "input": "more", "previous_response_id": rid}, 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    # a store outliving its server (shared here): B refuses A's record, naming A's model
    shared = app_b.state.responses
    app_b.state.responses = app_a.state.responses
    try:
        err = openai_error((url_b, app_b), {"model": "model-b", "input": "more", "previous_response_id": rid}, 404)
    finally:
        app_b.state.responses = shared
    assert err["code"] == "previous_response_not_found" and "'model-a'" in err["message"]
    # and A itself continues it
    r = httpx.post(url_a + "/v1/responses", json={"model": "model-a", "input": "more", "previous_response_id": rid,
                                                 "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    idle(app_a)

"""One conversation, three APIs (issue 43, item 5): the same conversation (a system prompt, a user
message, an assistant tool call, its result, a user message; with tools) sent through
/v1/chat/completions, Anthropic's /v1/messages and OpenAI's /v1/responses renders to the same
prompt token ids, and greedy decoding gives the same text, reasoning and tool calls through all
three.

The prompt ids: chat completions' through /tokenize (vLLM's route, which renders messages as the
chat route does); the Messages and Responses routes expose only the count (count_tokens, and
usage.input_tokens of each answer), so their exact ids come from their translation functions
(`anthropic_translate.render`, `openai_responses_translate.render`) on the live server's context.
DeepSeek-V4's chat format (the plain template has no tool calls), with the tiny model.
"""
import json

import httpx
import pytest

import kvfold
from kvfold.chat.template import ChatTemplate
from kvfold.server.anthropic_schemas import MessagesRequest
from kvfold.server.anthropic_translate import render as render_messages
from kvfold.server.app import create_app
from kvfold.server.openai_responses_schemas import ResponsesRequest, items
from kvfold.server.openai_responses_translate import render as render_responses
from kvfold.server.schemas import parse

from helpers import serving

MODEL = "tiny-random"
MAX = 24
SYSTEM, ASK, RESULT, THEN = "You are terse.", "Weather in Paris?", "22C, sunny", "And in Lyon tomorrow?"
ARGS = {"city": "Paris", "days": 1}
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
DESCRIPTION = "The weather in a city"


def chat_body(assistant_content=None, **kw):
    return {"model": MODEL, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": assistant_content, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT}, {"role": "user", "content": THEN}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                                    "parameters": PARAMS}}], **kw}


def messages_body(**kw):
    return {"model": MODEL, "system": SYSTEM, "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": RESULT},
                                     {"type": "text", "text": THEN}]}],
        "tools": [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS}], **kw}


def responses_body(**kw):
    return {"model": MODEL, "instructions": SYSTEM, "input": [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
        {"role": "user", "content": THEN}],
        "tools": [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}],
        "store": False, **kw}


@pytest.fixture(scope="module")
def server(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=4096, max_running=4)
    app = create_app(engine, model_name=MODEL, chat_template=ChatTemplate.deepseek_v4(tiny.tokenizer))
    with serving(app) as url:
        yield url, app


def post(url, path, body) -> dict:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def prompt_ids(server):
    """The chat route's prompt ids, through /tokenize."""
    url, _ = server
    body = chat_body()
    ids = post(url, "/tokenize", {"model": MODEL, "messages": body["messages"], "tools": body["tools"]})["tokens"]
    assert len(ids) > 100
    return ids


def test_one_prompt(server, prompt_ids):
    url, app = server
    ctx = app.state.server
    # the chat route's own renderings agree with /tokenize (assistant content null or "")
    body = chat_body("")
    assert post(url, "/tokenize", {"model": MODEL, "messages": body["messages"], "tools": body["tools"]})["tokens"] \
        == prompt_ids
    # Messages: the exact ids of its translation, and count_tokens
    req = parse(MessagesRequest, messages_body(max_tokens=MAX))
    assert render_messages(ctx, req, app.state.thinking_signer).ids == prompt_ids
    assert post(url, "/v1/messages/count_tokens", messages_body()) == {"input_tokens": len(prompt_ids)}
    # Responses: the exact ids of its translation
    req = parse(ResponsesRequest, responses_body())
    _, ids, _ = render_responses(ctx, req, [(f"input.{i}", it) for i, it in enumerate(items(req.input))])
    assert ids == prompt_ids


def _chat(answer: dict) -> tuple:
    (choice,) = answer["choices"]
    m = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or ()]
    return m["content"] or "", m.get("reasoning_content") or "", calls


def _messages(answer: dict) -> tuple:
    blocks = answer["content"]
    return ("".join(b["text"] for b in blocks if b["type"] == "text"),
            "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])


def _responses(answer: dict) -> tuple:
    out = answer["output"]
    return ("".join(p["text"] for it in out if it["type"] == "message" for p in it["content"]),
            "".join(p["text"] for it in out if it["type"] == "reasoning" for p in it["content"] or ()),
            [(it["name"], json.loads(it["arguments"])) for it in out if it["type"] == "function_call"])


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced-call"])
def test_same_greedy_output(server, prompt_ids, forced):
    """Greedy decoding through the three routes: the same text, reasoning and tool calls; each
    answer's usage counts the same prompt. `forced`: a tool call the model must make (chat's
    "required", Anthropic's "any", Responses' "required")."""
    url, _ = server
    # forced: one call (the random model would call on), and room for it in DeepSeek-V4's DSML markup
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    most = 16 * MAX if forced else MAX
    chat = post(url, "/v1/chat/completions", chat_body(temperature=0, max_tokens=most, **(one if forced else {})))
    messages = post(url, "/v1/messages", messages_body(
        temperature=0, max_tokens=most,
        **({"tool_choice": {"type": "any", "disable_parallel_tool_use": True}} if forced else {})))
    responses = post(url, "/v1/responses", responses_body(temperature=0, max_output_tokens=most,
                                                          **(one if forced else {})))
    n = len(prompt_ids)  # (Anthropic's input_tokens leaves out the prompt's cached tokens: the prefix cache)
    anthropic_prompt = messages["usage"]["input_tokens"] + messages["usage"]["cache_read_input_tokens"]
    assert chat["usage"]["prompt_tokens"] == anthropic_prompt == responses["usage"]["input_tokens"] == n
    out = _chat(chat)
    assert _messages(messages) == out
    assert _responses(responses) == out
    assert chat["usage"]["completion_tokens"] == messages["usage"]["output_tokens"] == \
        responses["usage"]["output_tokens"]
    if forced:  # the forced call came out whole, the same through all three
        assert len(out[2]) == 1 and chat["choices"][0]["finish_reason"] == "tool_calls", chat
        assert messages["stop_reason"] == "tool_use" and responses["status"] == "completed"

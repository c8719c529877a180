"""A forced tool call (tool_choice "required" / "any" / a named tool: the grammar makes the output
a call from its first token) streams its arguments as the model writes them, in all three APIs
(chat completions' `tool_calls[].function.arguments`, Messages' `input_json_delta`, Responses'
`response.function_call_arguments.delta`), and nothing streamed is ever taken back: the
concatenated deltas are a prefix of the final arguments at every point, and equal them at the end.
Under tool_choice "auto" a call is still held back until it is complete (docs/serving.md)."""
import json
import random

import httpx
import jsonschema
import pytest

import kvfold
from kvfold.chat.parsers import OutputParser, parse_output
from kvfold.chat.template import ChatTemplate
from kvfold.decoding.grammar import MAX_TOOL_WHITESPACE
from kvfold.server.app import create_app

from helpers import serving
from test_server_tools import GLM_TEMPLATE

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60}},
          "required": ["text"], "additionalProperties": False}
NOTE = {"type": "function", "function": {"name": "write_note", "description": "Write a note", "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "Write a note."}]
GRAMMAR_SPACE = " \n\r\t"
MAX_TOKENS = 600  # the markup and up to 60 characters of random UTF-8, a byte a token


@pytest.fixture(scope="module", params=["dsv4", "glm"])
def url(request, tiny):
    engine = kvfold.Engine(tiny, max_seq_len=4096, max_running=4)
    template = ChatTemplate.deepseek_v4(tiny.tokenizer) if request.param == "dsv4" else \
        ChatTemplate(tiny.tokenizer, GLM_TEMPLATE, family="glm")
    with serving(create_app(engine, model_name="tiny-random", chat_template=template)) as u:
        yield u


def _events(url: str, path: str, body: dict):
    """The (event name or None, data) of a server-sent event stream, in order."""
    with httpx.stream("POST", url + path, json=body, headers={"x-api-key": "none"}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                yield name, json.loads(line[len("data: "):])
                name = None


def _check(deltas: list[str], final: str) -> None:
    """More than one delta, each extending a prefix of the final arguments, which they make up;
    and the final arguments are a JSON object the schema validates."""
    assert len(deltas) > 3, deltas  # held back until complete, they would come as 2 (`{"text": ...`, `}`)
    sent = ""
    for d in deltas:
        sent += d
        assert final.startswith(sent), (sent, final)
    assert sent == final
    args = json.loads(final)
    # GLM: xgrammar's glm_4_7 tag admits up to MAX_TOOL_WHITESPACE of [ \n\r\t] on either side of a
    # value inside <arg_value>, which the random model writes and the parser keeps, as it keeps a
    # string value's text exactly; so some split of that slack must leave a text the schema takes
    assert any(_validates(args, a, b) for a in range(MAX_TOOL_WHITESPACE + 1)
               for b in range(MAX_TOOL_WHITESPACE + 1)), args


def _validates(args: dict, lead: int, trail: int) -> bool:
    text = args["text"]
    if len(text) < lead + trail or text[:lead].strip(GRAMMAR_SPACE) or text[len(text) - trail:].strip(GRAMMAR_SPACE):
        return False
    return jsonschema.Draft202012Validator(SCHEMA).is_valid({**args, "text": text[lead:len(text) - trail]})


@pytest.mark.parametrize("choice", ["required", "named"])
def test_chat_completions_streams_forced_arguments(url, choice):
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "write_note"}}
    # one call: under "required" the GLM grammar lets the random model write on after a first one
    body = dict(model="tiny-random", messages=ASK, tools=[NOTE], tool_choice=tc, max_tokens=MAX_TOKENS, seed=5,
                parallel_tool_calls=False)
    deltas, chunks, finish = [], 0, None
    for _, data in _events(url, "/v1/chat/completions", {**body, "stream": True}):
        for choice_ in data["choices"]:
            calls = choice_["delta"].get("tool_calls") or []
            assert all(c["index"] == 0 for c in calls)
            fragments = [c["function"]["arguments"] for c in calls if c["function"].get("arguments")]
            deltas += fragments
            chunks += bool(fragments)
            finish = choice_["finish_reason"] or finish
    assert chunks > 3 and finish == "tool_calls"  # the arguments came over many chunks, as tokens came
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "write_note"
    _check(deltas, call["function"]["arguments"])


def test_messages_streams_forced_input_json(url):
    body = dict(model="tiny-random", messages=ASK, max_tokens=MAX_TOKENS, stream=True,
                tools=[{"name": "write_note", "description": "Write a note", "input_schema": SCHEMA}],
                tool_choice={"type": "tool", "name": "write_note"})
    deltas, start, stop_reason = [], None, None
    for name, data in _events(url, "/v1/messages", body):
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            start = data["content_block"]
        elif name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            deltas.append(data["delta"]["partial_json"])
        elif name == "message_delta":
            stop_reason = data["delta"]["stop_reason"]
    assert start["name"] == "write_note" and stop_reason == "tool_use"
    final = "".join(deltas)
    _check(deltas, final)


def test_responses_streams_forced_function_call_arguments(url):
    body = dict(model="tiny-random", input="Write a note.", max_output_tokens=MAX_TOKENS, stream=True, store=False,
                tools=[{"type": "function", "name": "write_note", "parameters": SCHEMA}],
                tool_choice={"type": "function", "name": "write_note"})
    deltas, done, item = [], None, None
    for name, data in _events(url, "/v1/responses", body):
        if name == "response.function_call_arguments.delta":
            deltas.append(data["delta"])
        elif name == "response.function_call_arguments.done":
            done = data["arguments"]
        elif name == "response.output_item.done" and data["item"]["type"] == "function_call":
            item = data["item"]
    assert item["name"] == "write_note" and item["arguments"] == done
    _check(deltas, done)


# ---- the parser itself: forced calls stream; auto still holds a call back; both ways agree

DSML = "｜DSML｜"
PROPS = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"},
                                          "maybe": {"type": ["string", "null"]}}}
TOOLS = [{"type": "function", "function": {"name": "note", "parameters": PROPS}}]
OUTPUTS = {
    "deepseek_v4": f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="note">\n'
                   f'<{DSML}parameter name="n" string="false">3</{DSML}parameter>\n'
                   f'<{DSML}parameter name="text" string="true">he said "hi" </b>\n\tok</{DSML}parameter>\n'
                   f'<{DSML}parameter name="maybe" string="true">null</{DSML}parameter>\n</{DSML}invoke>\n'
                   f'<{DSML}invoke name="note">\n<{DSML}parameter name="text" string="true">two'
                   f'</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>',
    "glm": '<tool_call>note\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>text</arg_key>\n'
           '<arg_value>he said "hi" </b>\n\tok</arg_value>\n<arg_key>maybe</arg_key>\n<arg_value>null</arg_value>\n'
           '</tool_call>\n<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>two</arg_value>\n</tool_call>',
}


def _stream(family: str, text: str, forced: bool, seed: int):
    """Feed `text` in random pieces: the fragments of each call, checked never to be taken back
    against the whole parse, and the deltas' content."""
    rng = random.Random(seed)
    _, whole_content, whole = parse_output(family, text, tools=TOOLS, forced=forced)
    parser, sent, content, i = OutputParser(family, tools=TOOLS, forced=forced), {}, "", 0
    per_feed = []
    while True:
        k = rng.randint(1, 3)
        delta = parser.feed(text[i:i + k]) if i < len(text) else parser.finish()
        i += k
        content += delta.content
        per_feed.append(sum(bool(f) for _, _, _, f in delta.tool_calls))
        for index, call_id, name, fragment in delta.tool_calls:
            if call_id is not None:
                assert call_id.startswith("call_") and name == whole[index].name
            sent[index] = sent.get(index, "") + fragment
            assert whole[index].arguments.startswith(sent[index])
        if i - k >= len(text):  # that was finish()
            break
    assert [sent[k] for k in sorted(sent)] == [c.arguments for c in whole] == [c.arguments for c in parser.tool_calls]
    assert content == whole_content
    return per_feed, whole


@pytest.mark.parametrize("family", ["deepseek_v4", "glm"])
def test_a_forced_call_streams_as_written_and_agrees_with_the_whole_parse(family):
    for seed in range(20):
        per_feed, whole = _stream(family, OUTPUTS[family], True, seed)
        assert [json.loads(c.arguments) for c in whole] == [{"n": 3, "text": 'he said "hi" </b>\n\tok', "maybe": None},
                                                            {"text": "two"}]
        assert sum(1 for n in per_feed if n) > 6  # many feeds carried argument text
        auto_feed, auto_whole = _stream(family, OUTPUTS[family], False, seed)
        assert [c.arguments for c in auto_whole] == [c.arguments for c in whole]
        if family == "deepseek_v4":  # one block: every call in one delta, once it is complete
            assert sum(1 for n in auto_feed if n) == 1


@pytest.mark.parametrize("family", ["deepseek_v4", "glm"])
def test_a_forced_call_the_output_ends_inside_keeps_what_was_streamed(family):
    text = OUTPUTS[family]
    cut = text[:text.index("\tok") + 2]  # inside the text value
    for seed in range(5):
        _, whole = _stream(family, cut, True, seed)
        assert [c.arguments for c in whole] == ['{"n": 3, "text": "he said \\"hi\\" </b>\\n\\to']
    _, content, calls = parse_output(family, cut, tools=TOOLS)  # under auto: not a call, the text is content
    assert calls == [] and content == cut

"""Tool calling and reasoning through `kvfold serve`, with the real clients (openai, langchain).

The tiny model is served in DeepSeek-V4's own chat format (kvfold's implementation of the
release encoding) and in a GLM-style Jinja template with tools. Its random weights never write a
tool call by themselves, so the output is forced: tool_choice "required" or a named function
constrain it to a call (xgrammar's structural tag of the family's syntax), and a regex
(`structured_outputs`) writes exact markup to drive the parsers end to end.
"""
import json

import openai
import pydantic
import pytest

import kvfold
from kvfold.server.app import create_app
from kvfold.chat.template import ChatTemplate

from helpers import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

# a GLM-style template (the shape of GLM-4.x/5.x's: tools in the system part, <tool_call> with
# <arg_key>/<arg_value>, results in <|observation|><tool_response>, reasoning in <think>)
GLM_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{ m.content }}
{%- for tc in m.tool_calls or [] -%}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}<|observation|><tool_response>
{{ m.content }}
</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""

DSML = "｜DSML｜"


@pytest.fixture(scope="module")
def dsv4_url(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=4096, max_running=8)
    with serving(create_app(engine, model_name="tiny-random", chat_template=ChatTemplate.deepseek_v4(tiny.tokenizer))) as u:
        yield u


@pytest.fixture(scope="module")
def glm_url(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=4096, max_running=8)
    template = ChatTemplate(tiny.tokenizer, GLM_TEMPLATE, family="glm")
    with serving(create_app(engine, model_name="tiny-random", chat_template=template)) as u:
        yield u


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and 1 <= args["days"] <= 7
    return args


@pytest.mark.parametrize("which", ["dsv4", "glm"])
def test_tool_choice_required_makes_a_call_the_parser_reads(which, dsv4_url, glm_url):
    url = dsv4_url if which == "dsv4" else glm_url
    r = client(url).chat.completions.create(model="tiny-random", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            max_tokens=300, temperature=1.0, seed=1, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_a_named_tool_choice_calls_that_function(dsv4_url):
    c = client(dsv4_url)
    r = c.chat.completions.create(model="tiny-random", messages=ASK, tools=[WEATHER, TIME], max_tokens=300, seed=2,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    check_weather_call(call)
    assert r.choices[0].finish_reason == "tool_calls"


def test_a_streamed_call_reassembles_with_the_clients_own_helpers(dsv4_url):
    """The openai client's stream helper accumulates the deltas (id and name first, then the
    arguments in fragments) into the same call the whole response holds."""
    kw = dict(model="tiny-random", messages=ASK, tools=[WEATHER], max_tokens=300, seed=3,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = client(dsv4_url)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    fragments = 0
    with c.chat.completions.stream(**kw) as stream:
        for event in stream:
            fragments += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        (whole.function.name, json.loads(whole.function.arguments))
    assert fragments >= 2 and final.choices[0].finish_reason == "tool_calls"


def test_a_multi_turn_conversation_sends_the_result_back(dsv4_url, tiny):
    c = client(dsv4_url)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny-random", messages=ASK, tools=[WEATHER], tool_choice=forced, max_tokens=300,
                                  seed=4)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = c.chat.completions.create(model="tiny-random", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
    # what the model saw: its own call and the result, in the release's format
    import urllib.request
    body = json.dumps({"messages": history, "tools": [WEATHER]}).encode()
    req = urllib.request.Request(dsv4_url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        prompt = tiny.tokenizer.decode(json.loads(resp.read())["tokens"])
    assert f'<{DSML}invoke name="get_weather">' in prompt and "<tool_result>sunny, 21 C</tool_result>" in prompt
    assert prompt.count("get_weather") >= 2  # in the tools section and in the call


def test_tool_choice_auto_parses_a_call_the_model_writes(dsv4_url):
    """A regex writes an exact DSML call (the random model would not); with tool_choice auto the
    parser turns it into a call, the value coerced by the schema (days: an integer)."""
    markup = (f'Let me check.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
              f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
              f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
              f'</{DSML}invoke>\n</{DSML}tool_calls>')
    r = client(dsv4_url).chat.completions.create(model="tiny-random", messages=ASK, tools=[WEATHER], max_tokens=400,
                                                 extra_body={"structured_outputs": {"regex": _literal(markup)}})
    msg = r.choices[0].message
    assert (msg.content or "").strip() == "Let me check."
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert r.choices[0].finish_reason == "tool_calls"


def test_malformed_tool_markup_comes_back_as_content(dsv4_url):
    markup = f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city"'
    for stream in (False, True):
        c = client(dsv4_url)
        kw = dict(model="tiny-random", messages=ASK, tools=[WEATHER], max_tokens=400,
                  extra_body={"structured_outputs": {"regex": _literal(markup)}})
        if stream:
            text = "".join(ch.delta.content or "" for chunk in c.chat.completions.create(stream=True, **kw)
                           for ch in chunk.choices)
        else:
            r = c.chat.completions.create(**kw)
            assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert text == markup


def test_reasoning_content_is_separated(glm_url):
    out = "<think>Paris is in France.</think>It is sunny."
    c = client(glm_url)
    kw = dict(model="tiny-random", messages=ASK, max_tokens=200, extra_body={"structured_outputs": {"regex": _literal(out)}})
    msg = c.chat.completions.create(**kw).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Paris is in France.", "It is sunny.")
    deltas = [ch.delta for chunk in c.chat.completions.create(stream=True, **kw) for ch in chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Paris is in France."
    assert "".join(d.content or "" for d in deltas) == "It is sunny."


def test_thinking_mode_output_is_reasoning_until_it_closes(dsv4_url):
    r = client(dsv4_url).chat.completions.create(model="tiny-random", messages=ASK, max_tokens=6, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    assert msg.reasoning_content and not msg.content  # the random model never writes </think>


def test_langchain_bind_tools(dsv4_url):
    from langchain_openai import ChatOpenAI

    class GetWeather(pydantic.BaseModel):
        """The weather in a city."""
        city: str = pydantic.Field(max_length=8)
        days: int = pydantic.Field(ge=1, le=7)

    llm = ChatOpenAI(model="tiny-random", base_url=dsv4_url + "/v1", api_key="none", temperature=0, max_tokens=300,
                     max_retries=0)
    msg = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"])


def test_tool_choice_none_renders_the_tools_but_parses_no_call(dsv4_url):
    markup = f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n</{DSML}invoke>\n</{DSML}tool_calls>'
    r = client(dsv4_url).chat.completions.create(model="tiny-random", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=200,
                                                 extra_body={"structured_outputs": {"regex": _literal(markup)}})
    assert r.choices[0].message.content == markup and not r.choices[0].message.tool_calls


def test_what_the_plain_template_cannot_show_is_refused(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=256)
    with serving(create_app(engine, model_name="tiny-random")) as u:  # the tiny model's default: the plain template
        c = client(u)
        for kw, param in ((dict(tools=[WEATHER]), "tools"), (dict(reasoning_effort="max"), "reasoning_effort"),
                          (dict(messages=ASK + [{"role": "assistant", "content": "", "tool_calls": [
                              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
                           "messages.1.tool_calls")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(**{"model": "tiny-random", "messages": ASK, "max_tokens": 2, **kw})
            assert e.value.response.json()["error"]["param"] == param


@pytest.mark.parametrize("kw,param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages.0"),
])
def test_inconsistent_tool_requests_are_400s(dsv4_url, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(dsv4_url).chat.completions.create(**{"model": "tiny-random", "messages": ASK, "max_tokens": 2, **kw})
    assert e.value.response.json()["error"]["param"] == param, e.value.response.json()


def test_a_jinja_template_renders_as_transformers_renders_it(tiny):
    """The oracle: transformers' apply_chat_template on the same template, messages and tools."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    hf.chat_template = GLM_TEMPLATE
    messages = ASK + [
        {"role": "assistant", "content": "", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ours = ChatTemplate(tiny.tokenizer, GLM_TEMPLATE, family="glm").text(messages, [WEATHER, TIME])
    # transformers takes the arguments as objects, which is what kvfold hands the template
    as_objects = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if "tool_calls" in m else m for m in messages]
    theirs = hf.apply_chat_template(as_objects, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "<arg_key>days</arg_key>\n<arg_value>3</arg_value>" in ours and "<tool_response>\nsunny" in ours


def _literal(text: str) -> str:
    """A regex matching exactly `text`."""
    import re
    return re.escape(text)

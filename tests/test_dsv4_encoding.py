"""Golden tests of kvfold's DeepSeek-V4 chat encoding (kvfold/chat/dsv4_encoding.py).

Every expected prompt is written out by hand from the format of the DeepSeek-V4 release's
encoding/encoding_dsv4.py, token by token, so a change to any separator shows up here.
"""
import json

import pytest

from kvfold.chat.dsv4_encoding import ChatEncodingError, encode_chat, opens_reasoning
from kvfold.errors import InvalidRequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

TOOLS_SECTION = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    "writing a \"<｜DSML｜tool_calls>\" block like the following:\n"
    "\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n"
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    "{\"name\": \"get_weather\", \"description\": \"Weather for a city\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}\n"
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n"
    "\n"
)


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# --- golden conversations -----------------------------------------------------------------------


def test_single_user_turn_chat_mode():
    prompt = encode_chat([{"role": "user", "content": "Hello"}])
    assert prompt == BOS + "<｜User｜>Hello<｜Assistant｜></think>"
    assert not opens_reasoning(prompt)


def test_single_user_turn_thinking_mode():
    prompt = encode_chat([{"role": "user", "content": "Hello"}], thinking=True)
    assert prompt == BOS + "<｜User｜>Hello<｜Assistant｜><think>"
    assert opens_reasoning(prompt)


def test_system_then_user():
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert encode_chat(messages) == BOS + "You are terse.<｜User｜>Hi<｜Assistant｜></think>"


def test_developer_message_is_its_own_user_turn():
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                {"role": "user", "content": "Q"}]
    assert encode_chat(messages) == BOS + "S<｜User｜>D<｜User｜>Q<｜Assistant｜></think>"
    # thinking mode without tools leaves out developer messages before the last user turn
    assert encode_chat(messages, thinking=True) == BOS + "S<｜User｜>Q<｜Assistant｜><think>"
    # ... but not the last one
    last = [{"role": "user", "content": "Q"}, {"role": "developer", "content": "D"}]
    assert encode_chat(last, thinking=True) == BOS + "<｜User｜>Q<｜User｜>D<｜Assistant｜><think>"


def test_earlier_reasoning_is_dropped_without_tools():
    messages = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                {"role": "user", "content": "Q2"}]
    assert encode_chat(messages, thinking=True) == (
        BOS + "<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>")
    # chat mode never shows reasoning
    assert encode_chat(messages) == (
        BOS + "<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜></think>")


def test_earlier_reasoning_is_kept_with_tools():
    messages = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                {"role": "user", "content": "Q2"}]
    assert encode_chat(messages, tools=[WEATHER], thinking=True) == (
        BOS + "\n\n" + TOOLS_SECTION
        + "<｜User｜>Q1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>")


def test_reasoning_of_the_last_reply_is_kept():
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert encode_chat(messages, thinking=True) == (
        BOS + "<｜User｜>Q<｜Assistant｜><think>R</think>A<｜end▁of▁sentence｜>")


def test_tool_call_and_result_become_the_next_user_turn():
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"}]
    assert encode_chat(messages, tools=[WEATHER]) == (
        BOS + "S\n\n" + TOOLS_SECTION
        + "<｜User｜>Weather in Paris?<｜Assistant｜></think>\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>18C sunny</tool_result><｜Assistant｜></think>")


def test_parallel_calls_results_in_call_order_then_user_text():
    messages = [{"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need both.",
                 "tool_calls": [call("c1", "get_weather", {"city": "Paris"}),
                                call("c2", "get_weather", {"city": "Rome"})]},
                {"role": "tool", "tool_call_id": "c2", "content": "Rome: 20C"},
                {"role": "tool", "tool_call_id": "c1", "content": "Paris: 18C"},
                {"role": "user", "content": "Compare them."}]
    assert encode_chat(messages, tools=[WEATHER], thinking=True) == (
        BOS + "\n\n" + TOOLS_SECTION
        + "<｜User｜>Paris and Rome?<｜Assistant｜><think>Need both.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>Paris: 18C</tool_result>\n\n<tool_result>Rome: 20C</tool_result>\n\n"
        "Compare them.<｜Assistant｜><think>")


def test_tool_loop_without_tools_drops_the_reasoning_before_the_results():
    # the results are the last user turn, so the reasoning of the call before them goes
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "reasoning_content": "R",
                 "tool_calls": [call("c1", "now", {})]},
                {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert encode_chat(messages, thinking=True) == (
        BOS + "<｜User｜>Q<｜Assistant｜></think>\n\n"
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        "<｜end▁of▁sentence｜><｜User｜><tool_result>noon</tool_result><｜Assistant｜><think>")


def test_string_and_non_string_parameters():
    arguments = ('{"query": "kv cache", "note": "said \\"hi\\"\\né", "limit": 5, "exact": false, '
                 '"tags": ["a", "b"], "filter": {"lang": "en"}, "cutoff": null, "ratio": 0.5}')
    messages = [{"role": "user", "content": "Find it"},
                {"role": "assistant", "content": "Searching.", "tool_calls": [
                    {"id": "s1", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "s1", "content": "3 hits"},
                {"role": "assistant", "content": "Found 3."}]
    assert encode_chat(messages) == (
        BOS + "<｜User｜>Find it<｜Assistant｜></think>Searching.\n\n"
        "<｜DSML｜tool_calls>\n"
        "<｜DSML｜invoke name=\"search\">\n"
        "<｜DSML｜parameter name=\"query\" string=\"true\">kv cache</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"note\" string=\"true\">said \"hi\"\né</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"limit\" string=\"false\">5</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"exact\" string=\"false\">false</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"tags\" string=\"false\">[\"a\", \"b\"]</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"filter\" string=\"false\">{\"lang\": \"en\"}</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"cutoff\" string=\"false\">null</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"ratio\" string=\"false\">0.5</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>3 hits</tool_result><｜Assistant｜></think>Found 3.<｜end▁of▁sentence｜>")


def test_response_format_json_schema_section():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "strict": True, "schema": schema}}
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    section = ("## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
               "{\"type\": \"object\", \"properties\": {\"answer\": {\"type\": \"string\"}}, \"required\": [\"answer\"]}")
    assert encode_chat(messages, response_format=rf) == BOS + "S\n\n" + section + "<｜User｜>Q<｜Assistant｜></think>"
    # after the tools section; into an empty system turn when there is no system message
    assert encode_chat(messages[1:], tools=[WEATHER], response_format=rf) == (
        BOS + "\n\n" + TOOLS_SECTION + "\n\n" + section + "<｜User｜>Q<｜Assistant｜></think>")


def test_response_format_json_object_and_text():
    messages = [{"role": "user", "content": "Q"}]
    assert encode_chat(messages, response_format={"type": "json_object"}) == (
        BOS + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        "{\"type\": \"object\"}<｜User｜>Q<｜Assistant｜></think>")
    assert encode_chat(messages, response_format={"type": "text"}) == BOS + "<｜User｜>Q<｜Assistant｜></think>"


def test_max_reasoning_effort_preamble():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert encode_chat(messages, thinking=True, reasoning_effort="max") == (
        BOS + MAX_PREAMBLE + "S<｜User｜>Q<｜Assistant｜><think>")
    # the preamble goes before the tools section too
    assert encode_chat(messages[1:], tools=[WEATHER], thinking=True, reasoning_effort="max") == (
        BOS + MAX_PREAMBLE + "\n\n" + TOOLS_SECTION + "<｜User｜>Q<｜Assistant｜><think>")
    # chat mode has no preamble; "high" renders as no effort at all
    assert encode_chat(messages, reasoning_effort="max") == BOS + "S<｜User｜>Q<｜Assistant｜></think>"
    assert encode_chat(messages, thinking=True, reasoning_effort="high") == BOS + "S<｜User｜>Q<｜Assistant｜><think>"


def test_content_as_text_parts():
    messages = [{"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
                {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                             {"type": "text", "text": "Part two."}]}]
    assert encode_chat(messages) == BOS + "S1\n\nS2<｜User｜>Part one.\n\nPart two.<｜Assistant｜></think>"


def test_consecutive_user_messages_join_into_one_turn():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_chat(messages) == BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>"


def test_add_generation_prompt_false():
    assert encode_chat([{"role": "user", "content": "Q"}], add_generation_prompt=False) == BOS + "<｜User｜>Q"
    answered = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    for flag in (True, False):
        assert encode_chat(answered, add_generation_prompt=flag) == (
            BOS + "<｜User｜>Q<｜Assistant｜></think>A<｜end▁of▁sentence｜>")


def test_token_constants_use_full_width_bars():
    prompt = encode_chat([{"role": "user", "content": "x"}])
    assert "\uff5c" in prompt and "\u2581" in prompt and "|" not in prompt


def test_input_messages_are_not_modified():
    messages = [{"role": "user", "content": "Q"}]
    snapshot = json.dumps(messages)
    encode_chat(messages, tools=[WEATHER], response_format={"type": "json_object"})
    assert json.dumps(messages) == snapshot


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "user", "content": "Q"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}],
     "messages.1.role"),
    ([{"role": "function", "content": "x"}], "messages.0.role"),
    ([{"content": "x"}], "messages.0.role"),
    ([{"role": "assistant", "content": "A"}], "messages.0.role"),
    ([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}], "messages.1.role"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
      {"role": "assistant", "content": "B"}], "messages.2.role"),
    ([{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}], "messages.1.role"),
    ([{"role": "user", "content": "Q"},
      {"role": "assistant", "content": "", "tool_calls": [call("c1", "now", {})]},
      {"role": "tool", "tool_call_id": "c9", "content": "r"}], "messages.2.tool_call_id"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
      {"role": "tool", "tool_call_id": "c1", "content": "r"}], "messages.2.role"),
    ([{"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content.1"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
    ([{"role": "developer", "content": ""}], "messages.0.content"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
     "messages.1.tool_calls.0.function.arguments"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}],
     "messages.1.tool_calls.0.function.arguments"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}],
     "messages.1.tool_calls.0.function.name"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": 3}],
     "messages.1.reasoning_content"),
])
def test_refused_messages(messages, param):
    with pytest.raises(ChatEncodingError) as info:
        encode_chat(messages)
    assert info.value.param == param
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("options, param", [
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
])
def test_refused_options(options, param):
    with pytest.raises(ChatEncodingError) as info:
        encode_chat([{"role": "user", "content": "Q"}], **options)
    assert info.value.param == param

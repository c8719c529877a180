"""kvfold.chat.parsers: reasoning / content / tool calls out of DeepSeek-V4 and GLM output,
whole and streamed (split at every boundary, char by char, and fuzzed)."""

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfold.chat.parsers import Delta, OutputParser, ToolCall, parse_output

B = "｜"  # U+FF5C, DSML's bar
S, E = f"<{B}DSML{B}tool_calls>", f"</{B}DSML{B}tool_calls>"
INV_END, PAR_END = f"</{B}DSML{B}invoke>", f"</{B}DSML{B}parameter>"


def inv(name):
    return f'<{B}DSML{B}invoke name="{name}">'


def par(name, value, string=True):
    flag = "true" if string else "false"
    return f'<{B}DSML{B}parameter name="{name}" string="{flag}">{value}{PAR_END}'


def dsml(*invokes):
    """A block laid out as the release encoder writes it."""
    body = "\n".join(f"{inv(n)}\n" + "\n".join(ps) + ("\n" if ps else "") + INV_END
                     for n, ps in invokes)
    return f"{S}\n{body}\n{E}"


def glm(name, *pairs, newlines=False):
    """A GLM call: GLM-4.7's compact layout, or GLM-4.5's with newlines."""
    sep = "\n" if newlines else ""
    args = "".join(f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{args}{sep}</tool_call>"


def fn(name, props):
    return {"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    fn("get_weather", {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "zip": {"type": "string"}, "note": {"type": ["string", "null"]},
        "unit": {"enum": ["c", "f"]}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    }),
    fn("get_time", {}),
    fn("search", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
]

W1 = ("get_weather", [par("city", "Paris")])
W1_ARGS = {"city": "Paris"}

# (id, family, text, tools, in_reasoning, reasoning, content, [(name, args)])
CASES = [
    # ---- DeepSeek-V4
    ("dsv4-plain", "deepseek_v4", "The answer is 4.", None, False, None, "The answer is 4.", []),
    ("dsv4-plain-tools", "deepseek_v4", "The answer is 4.", TOOLS, False,
     None, "The answer is 4.", []),
    ("dsv4-thinking", "deepseek_v4", "Let me think.\n</think>The answer is 4.", None, True,
     "Let me think.\n", "The answer is 4.", []),
    ("dsv4-think-tag", "deepseek_v4", "<think>hmm</think>\n\nHi", TOOLS, False,
     "hmm", "\n\nHi", []),
    ("dsv4-empty-think", "deepseek_v4", "</think>Hi", None, True, "", "Hi", []),
    ("dsv4-unterminated-reasoning", "deepseek_v4", "still <thinking> </thi", None, True,
     "still <thinking> </thi", "", []),
    ("dsv4-one-call", "deepseek_v4", "Need weather.</think>\n\n" + dsml(W1), TOOLS, True,
     "Need weather.", "", [("get_weather", W1_ARGS)]),
    ("dsv4-two-calls-content", "deepseek_v4",
     "Checking both.\n\n" + dsml(W1, ("search", [par("query", "rain"), par("limit", "5", False)])),
     TOOLS, False, None, "Checking both.",
     [("get_weather", W1_ARGS), ("search", {"query": "rain", "limit": 5})]),
    ("dsv4-coercion", "deepseek_v4", dsml(("get_weather", [
        par("city", "São Paulo"), par("days", "3", False), par("temp", "21.5", False),
        par("metric", "true", False), par("opts", '{"a": [1, {"b": null}]}', False),
        par("tags", '["x", "y"]', False), par("zip", "75001"),
        par("note", "null", False), par("unit", "c"), par("maybe", "7")])),
     TOOLS, False, None, "", [("get_weather", {
         "city": "São Paulo", "days": 3, "temp": 21.5, "metric": True,
         "opts": {"a": [1, {"b": None}]}, "tags": ["x", "y"], "zip": "75001", "note": None,
         "unit": "c", "maybe": 7})]),
    ("dsv4-schema-wins", "deepseek_v4", dsml(("get_weather", [
        par("zip", "75001", False), par("days", "4"), par("temp", '"2.5"', False),
        par("city", " keep  spaces\n<b>x</b> ")])),
     TOOLS, False, None, "", [("get_weather", {
         "zip": "75001", "days": 4, "temp": 2.5, "city": " keep  spaces\n<b>x</b> "})]),
    ("dsv4-uncoercible-string-true", "deepseek_v4", dsml(("get_weather", [par("days", "three")])),
     TOOLS, False, None, "", [("get_weather", {"days": "three"})]),
    ("dsv4-unknown-params", "deepseek_v4",
     dsml(("get_weather", [par("extra", "[1, 2]", False), par("other", "42")])),
     TOOLS, False, None, "", [("get_weather", {"extra": [1, 2], "other": "42"})]),
    ("dsv4-unknown-function", "deepseek_v4", dsml(("launch", [par("n", "3", False)])),
     TOOLS, False, None, "", [("launch", {"n": 3})]),
    ("dsv4-zero-params", "deepseek_v4", dsml(("get_time", [])), TOOLS, False,
     None, "", [("get_time", {})]),
    ("dsv4-compact-layout", "deepseek_v4",
     f'{S}{inv("get_time")}{INV_END}{inv("search")}{par("query", "a")}{INV_END}{E}',
     TOOLS, False, None, "", [("get_time", {}), ("search", {"query": "a"})]),
    ("dsv4-loose-whitespace", "deepseek_v4",
     (f'{S}\n  <{B}DSML{B}invoke  name="search" >\n\t<{B}DSML{B}parameter name="query"  '
      f'string="true" >q{PAR_END}\n{INV_END}\n{E}'), TOOLS, False,
     None, "", [("search", {"query": "q"})]),
    ("dsv4-block-in-reasoning", "deepseek_v4", "I'll call it.\n" + dsml(W1), TOOLS, True,
     "I'll call it.\n", "", [("get_weather", W1_ARGS)]),
    ("dsv4-content-after-block", "deepseek_v4", "A\n\n" + dsml(W1) + "\n\nDone.", TOOLS, False,
     None, "A\n\nDone.", [("get_weather", W1_ARGS)]),
    ("dsv4-trailing-ws-after-block", "deepseek_v4", dsml(W1) + "\n \n", TOOLS, False,
     None, "", [("get_weather", W1_ARGS)]),
    ("dsv4-no-tools-is-content", "deepseek_v4", "x\n\n" + dsml(W1), None, False,
     None, "x\n\n" + dsml(W1), []),
    ("dsv4-no-tools-block-ends-reasoning", "deepseek_v4", "r " + dsml(W1), None, True,
     "r ", dsml(W1), []),
    # malformed -> content, verbatim
    ("dsv4-unclosed", "deepseek_v4", "</think>ok\n\n" + dsml(W1)[:-len(E)], TOOLS, True,
     "", "ok\n\n" + dsml(W1)[:-len(E)], []),
    ("dsv4-unclosed-invoke", "deepseek_v4", f"{S}\n{inv('get_time')}\n", TOOLS, False,
     None, f"{S}\n{inv('get_time')}\n", []),
    ("dsv4-no-name", "deepseek_v4", f"{S}\n<{B}DSML{B}invoke>\n{INV_END}\n{E}", TOOLS, False,
     None, f"{S}\n<{B}DSML{B}invoke>\n{INV_END}\n{E}", []),
    ("dsv4-empty-name", "deepseek_v4", dsml(("", [])), TOOLS, False, None, dsml(("", [])), []),
    ("dsv4-bad-json", "deepseek_v4", dsml(("get_weather", [par("days", "3,", False)])), TOOLS,
     False, None, dsml(("get_weather", [par("days", "3,", False)])), []),
    ("dsv4-nan-json", "deepseek_v4", dsml(("get_weather", [par("temp", "NaN", False)])), TOOLS,
     False, None, dsml(("get_weather", [par("temp", "NaN", False)])), []),
    ("dsv4-bad-string-flag", "deepseek_v4",
     dsml(("search", [f'<{B}DSML{B}parameter name="query" string="yes">a{PAR_END}'])), TOOLS,
     False, None, dsml(("search", [f'<{B}DSML{B}parameter name="query" string="yes">a{PAR_END}'])),
     []),
    ("dsv4-duplicate-param", "deepseek_v4", dsml(("search", [par("query", "a"), par("query", "b")])),
     TOOLS, False, None, dsml(("search", [par("query", "a"), par("query", "b")])), []),
    ("dsv4-stray-text", "deepseek_v4", f"{S}\nhello {inv('get_time')}{INV_END}{E}", TOOLS, False,
     None, f"{S}\nhello {inv('get_time')}{INV_END}{E}", []),
    ("dsv4-empty-block", "deepseek_v4", f"a\n\n{S}\n{E}", TOOLS, False, None, f"a\n\n{S}\n{E}", []),
    ("dsv4-bad-then-good", "deepseek_v4", f"{S}oops\n\n" + dsml(W1), TOOLS, False,
     None, f"{S}oops", [("get_weather", W1_ARGS)]),
    # ---- GLM
    ("glm-plain", "glm", "The answer is 4.", None, False, None, "The answer is 4.", []),
    ("glm-reasoning", "glm", "<think>Let me see.</think>\nThe answer is 4.", TOOLS, False,
     "Let me see.", "\nThe answer is 4.", []),
    ("glm-leading-newline-think", "glm", "\n<think>a</think>b", None, False, "a", "b", []),
    ("glm-in-reasoning", "glm", "Hmm.</think>Answer.", None, True, "Hmm.", "Answer.", []),
    ("glm-one-call", "glm", glm("get_weather", ("city", "Paris")), TOOLS, False,
     None, "", [("get_weather", W1_ARGS)]),
    ("glm45-newlines", "glm", "<think>r</think>\n" + glm("get_weather", ("city", "Paris"),
                                                         newlines=True),
     TOOLS, False, "r", "", [("get_weather", W1_ARGS)]),
    ("glm-two-calls-content", "glm", "I'll check both." + glm("get_weather", ("city", "Paris"))
     + "\n" + glm("search", ("query", "rain"), ("limit", "5")), TOOLS, False,
     None, "I'll check both.",
     [("get_weather", W1_ARGS), ("search", {"query": "rain", "limit": 5})]),
    ("glm-coercion", "glm", glm("get_weather", ("city", "Paris"), ("days", "3"), ("temp", "21.5"),
                                ("metric", "true"), ("opts", '{"a": 1}'), ("tags", '["x", "y"]'),
                                ("zip", "75001"), ("extra", "42"), ("maybe", "null"),
                                ("note", "null")),
     TOOLS, False, None, "", [("get_weather", {
         "city": "Paris", "days": 3, "temp": 21.5, "metric": True, "opts": {"a": 1},
         "tags": ["x", "y"], "zip": "75001", "extra": "42", "maybe": None, "note": None})]),
    ("glm-uncoercible", "glm", glm("get_weather", ("days", "three"), ("metric", "yes"),
                                   ("temp", "1e999"), ("city", " two words \n")),
     TOOLS, False, None, "", [("get_weather", {
         "days": "three", "metric": "yes", "temp": "1e999", "city": " two words \n"})]),
    ("glm-unknown-function", "glm", glm("launch", ("n", "3")), TOOLS, False,
     None, "", [("launch", {"n": "3"})]),
    ("glm-zero-args", "glm", "Time?" + glm("get_time"), TOOLS, False, None, "Time?",
     [("get_time", {})]),
    ("glm-content-after", "glm", glm("get_time") + "\n\nDone.", TOOLS, False, None, "\n\nDone.",
     [("get_time", {})]),
    ("glm-call-in-reasoning", "glm", "<think>" + glm("get_time") + "</think>ok", TOOLS, False,
     glm("get_time"), "ok", []),
    ("glm-no-tools", "glm", "a " + glm("get_time"), None, False, None, "a " + glm("get_time"), []),
    # malformed -> content
    ("glm-unclosed", "glm", "x " + glm("get_time")[:-3], TOOLS, False, None,
     "x " + glm("get_time")[:-3], []),
    ("glm-no-name", "glm", glm("", ("city", "Paris")), TOOLS, False, None,
     glm("", ("city", "Paris")), []),
    ("glm-name-with-space", "glm", glm("get weather", ("city", "P")), TOOLS, False, None,
     glm("get weather", ("city", "P")), []),
    ("glm-json-style", "glm", '<tool_call>{"name":"get_time"}</tool_call>', TOOLS, False, None,
     '<tool_call>{"name":"get_time"}</tool_call>', []),
    ("glm-stray-text", "glm", ("<tool_call>search<arg_key>query</arg_key>oops<arg_value>a"
                               "</arg_value></tool_call>"), TOOLS, False, None,
     "<tool_call>search<arg_key>query</arg_key>oops<arg_value>a</arg_value></tool_call>", []),
    ("glm-duplicate-key", "glm", glm("search", ("query", "a"), ("query", "b")), TOOLS, False,
     None, glm("search", ("query", "a"), ("query", "b")), []),
    ("glm-unclosed-value", "glm", ("<tool_call>search<arg_key>query</arg_key><arg_value>a"
                                   "</tool_call>"), TOOLS, False, None,
     "<tool_call>search<arg_key>query</arg_key><arg_value>a</tool_call>", []),
    ("glm-bad-then-good", "glm", "<tool_call>a b " + glm("get_time"), TOOLS, False, None,
     "<tool_call>a b", [("get_time", {})]),
    # ---- plain
    ("plain-think", "plain", "<think>a</think>b", TOOLS, False, "a", "b", []),
    ("plain-in-reasoning", "plain", "a</think>b " + glm("get_time"), TOOLS, True,
     "a", "b " + glm("get_time"), []),
    ("plain-markup-is-content", "plain", dsml(W1), TOOLS, False, None, dsml(W1), []),
    ("plain-partial-think-at-end", "plain", "  <thi", None, False, None, "  <thi", []),
    ("plain-think-later-is-content", "plain", "a <think>b</think>", None, False,
     None, "a <think>b</think>", []),
    ("empty", "glm", "", TOOLS, False, None, "", []),
]

ID_RE = re.compile(r"call_[0-9a-f]{24}")


def stream(family, pieces, tools=None, in_reasoning=False):
    """Feed `pieces`, checking every Delta; -> (reasoning, content, [(name, args text)])."""
    parser = OutputParser(family, tools=tools, in_reasoning=in_reasoning)
    reasoning, content = "", ""
    calls: list[list] = []  # [id, name, args]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        assert isinstance(d, Delta)
        reasoning += d.reasoning
        content += d.content
        for index, call_id, name, frag in d.tool_calls:
            assert isinstance(frag, str)
            if index == len(calls):  # the first fragment of a new call
                assert ID_RE.fullmatch(call_id) and isinstance(name, str) and name
                calls.append([call_id, name, frag])
            else:
                assert index == len(calls) - 1, "fragments of earlier calls after a new one"
                assert call_id is None and name is None
                calls[index][2] += frag
    assert parser.feed("more") == Delta()  # after finish
    final = parser.tool_calls
    assert [(c.id, c.name, c.arguments) for c in final] == [tuple(c) for c in calls]
    assert len({c.id for c in final}) == len(final)
    for c in final:
        assert isinstance(json.loads(c.arguments), dict)
    return reasoning, content, [(n, a) for _, n, a in calls]


def whole(family, text, tools=None, in_reasoning=False):
    r, c, calls = parse_output(family, text, tools=tools, in_reasoning=in_reasoning)
    assert all(isinstance(t, ToolCall) for t in calls)
    return r, c, [(t.name, t.arguments) for t in calls]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_output(case):
    _, family, text, tools, in_r, reasoning, content, calls = case
    r, c, got = whole(family, text, tools, in_r)
    assert (r, c) == (reasoning, content)
    assert [(n, json.loads(a)) for n, a in got] == calls
    # the exact text: keys in order, json.dumps spacing
    assert [a for _, a in got] == [json.dumps(a, ensure_ascii=False) for _, a in calls]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streaming_equals_whole(case):
    _, family, text, tools, in_r, *_ = case
    r, c, calls = whole(family, text, tools, in_r)
    expected = (r or "", c, calls)
    assert stream(family, list(text), tools, in_r) == expected
    for i in range(len(text) + 1):
        assert stream(family, [text[:i], text[i:]], tools, in_r) == expected, i


def test_arguments_stream_one_fragment_per_parameter():
    text = dsml(("search", [par("query", "rain"), par("limit", "5", False)]))
    parser = OutputParser("deepseek_v4", tools=TOOLS)
    frags = parser.feed(text).tool_calls + parser.finish().tool_calls
    assert [f[3] for f in frags] == ["", '{"query": "rain"', ', "limit": 5', "}"]
    assert frags[0][1:3] == (parser.tool_calls[0].id, "search")
    assert all(f[1] is None and f[2] is None for f in frags[1:])


@pytest.mark.parametrize("family,tools,pieces,early,rest", [
    ("deepseek_v4", TOOLS, ["Hello <", f"{B}DS", f"ML{B}tool_calls>"], "Hello",
     f" <{B}DSML{B}tool_calls>"),
    ("glm", TOOLS, ["Hi <tool_", "call>"], "Hi", " <tool_call>"),
    ("glm", None, ["Hi <tool_", "call>"], "Hi <tool_call>", ""),
])
def test_holds_back_possible_tags(family, tools, pieces, early, rest):
    parser = OutputParser(family, tools=tools)
    got = "".join(parser.feed(p).content for p in pieces)
    assert got == early
    assert parser.finish().content == rest


def test_holds_back_partial_think_end():
    parser = OutputParser("glm", in_reasoning=True)
    assert parser.feed("abc</thi").reasoning == "abc"
    d = parser.feed("nk>x")
    assert (d.reasoning, d.content) == ("", "x")


def test_invalid_markup_is_released_as_soon_as_it_is_known_invalid():
    parser = OutputParser("glm", tools=TOOLS)
    d = parser.feed("<tool_call>get weather is nice")
    assert d.content == "<tool_call>get weather is nice"
    parser = OutputParser("deepseek_v4", tools=TOOLS)
    assert parser.feed(f"{S}\nnot an invoke").content == f"{S}\nnot an invoke"


def test_odd_tools_and_bad_family():
    odd = [{"junk": 1}, "x", {"type": "function", "function": {"name": "f", "parameters": "bad"}},
           {"function": {"name": "g", "parameters": {"properties": {"n": {"type": 5}}}}}]
    assert whole("glm", glm("g", ("n", "1")), odd) == (None, "", [("g", '{"n": "1"}')])
    assert whole("glm", glm("f", ("n", "1")), odd) == (None, "", [("f", '{"n": "1"}')])
    with pytest.raises(ValueError):
        OutputParser("llama")


def test_ids_are_unique():
    text = "".join(glm("get_time") for _ in range(50))
    ids = [c.id for c in parse_output("glm", text, tools=TOOLS)[2]]
    assert len(ids) == 50 and len(set(ids)) == 50


# ---------------------------------------------------------------- fuzz

FRAGMENTS = [
    "<think>", "</think>", "</thi", "<thi", S, E, S[:5], E[:7], inv("get_weather"), inv("search"),
    inv(""), INV_END, INV_END[:4], par("city", "Paris"), par("days", "3", False),
    par("opts", "{", False), par("limit", "NaN", False), PAR_END, PAR_END[:6],
    f"<{B}DSML{B}parameter", f"<{B}DSML{B}invoke", ' name="', '"', 'string="true">',
    'string="false">', "<tool_call>", "</tool_call>", "<tool_", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<arg_", "get_weather", "search", "get_time", "city", "days",
    "Paris", "3", "[1, 2]", '{"a": 1}', "true", "null", " ", "\n", "\n\n", "\t", "<", ">", "/",
    B, "a b", "é", "\ud800",
]
VALID = [c[2] for c in CASES if c[7]]


def _check(family, text, tools, in_r, cuts):
    r, c, calls = whole(family, text, tools, in_r)
    if not tools and not in_r and not text.lstrip().startswith("<think>"):
        assert (r, c, calls) == (None, text, [])  # nothing to parse: the text is content
    bounds = sorted({min(x, len(text)) for x in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert stream(family, pieces, tools, in_r) == (r or "", c, calls)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["deepseek_v4", "glm", "plain"]),
       parts=st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30),
       tools=st.sampled_from([None, [], TOOLS]), in_r=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=8))
def test_fuzz_fragments(family, parts, tools, in_r, cuts):
    _check(family, "".join(parts), tools, in_r, cuts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(VALID), family=st.sampled_from(["deepseek_v4", "glm"]),
       edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3),
                                st.sampled_from(FRAGMENTS)), max_size=3),
       in_r=st.booleans(), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_fuzz_mutated_calls(base, family, edits, in_r, cuts):
    """Valid outputs with a few characters cut out or fragments pasted in."""
    text = base
    for pos, cut, frag in edits:
        pos %= len(text) + 1
        text = text[:pos] + (frag if cut == 0 else "") + text[pos + cut:]
    _check(family, text, TOOLS, in_r, cuts)

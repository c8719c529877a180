"""A conversation kvfold produced, re-sent whole by a stateless client, continues its exact state:
each earlier assistant turn maps back to the token ids that were generated (`Engine(...,
conversations=N)`, kvfold/engine/transcripts.py), so the prefix cache covers everything before the
new user turn, and every turn's output is bit-identical to the one a single growing state gives.

Through each API (chat completions; Anthropic's Messages, the assistant turn sent back as its
content blocks, thinking blocks with their signatures; Responses with store: false, the output
items sent back, reasoning as encrypted_content), with the real SDK clients, a 5-turn agent loop:
a long system prompt, a tool call forced on turns 0, 2 and 4 and none allowed on turns 1 and 3,
each call answered, then a short user message. Two servers over the same random tiny DeepSeek-V4
with the release tokenizer (`test_dsv4_real_tokenizer`): one with the prefix cache, on which
turns 2-5 find at least 95% of their prompt cached; one without (`prefix_cache_bytes=0`), which
replays the earlier outputs' decode spans (a single growing state) and caches nothing, the
control showing that the cache, not luck, gives the hit rate. Both give the same outputs (and,
where the API has them, the same logprob bits) turn for turn, and each engine aligned every
re-sent prompt (4 of 5) with its conversation. Each API runs the loop twice: in the format's
chat mode, where the forced turns make tool calls (and the others write text to max_tokens), and
in thinking mode, where the random model only reasons (it never closes its reasoning in the token
budget), which is what carries thinking blocks and encrypted reasoning back.
"""
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import anthropic
import openai
import pytest

import kvfold
from kvfold.server.app import create_app

from helpers import serving
from test_dsv4_real_tokenizer import WEATHER, model, template  # noqa: F401

MODEL = "dsv4-real-vocab"
SYSTEM = "You are a careful assistant. " * 150  # ~1,200 tokens: the new user turn is small against the history
ASK, RESULT = "Weather in Paris?", "sunny"
TURNS, FORCED = 5, (0, 2, 4)
HIT = 0.95
TOOL = WEATHER["function"]


class Turn(NamedTuple):
    prompt: int  # the prompt's tokens
    cached: int  # of them, found in the prefix cache
    output: int  # the answer's tokens
    out: tuple  # ("reasoning" | "text", text) and ("call", name, arguments): no ids or signatures
    bits: list  # the sampled tokens' logprobs, where the API gives them


def most(turn: int, thinking: bool) -> int:
    """max_tokens: room for the random model to finish a grammar-forced call; elsewhere it talks
    (or reasons) to the limit, so less of it keeps the test quick."""
    return 300 if turn in FORCED and not thinking else 100


def follow_up(turn: int) -> str:
    return f"Thanks, and turn {turn}?"


def chat_turns(url: str, thinking: bool) -> list[Turn]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    got = []
    for turn in range(TURNS):
        tc = {"type": "function", "function": {"name": "get_weather"}} if turn in FORCED else "none"
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=tc,
                                      max_tokens=most(turn, thinking), temperature=0, logprobs=True, top_logprobs=0,
                                      extra_body={"chat_template_kwargs": {"thinking": thinking}})
        (choice,) = r.choices
        m, calls = choice.message, choice.message.tool_calls or []
        out = [("reasoning", m.reasoning_content)] if getattr(m, "reasoning_content", None) else []
        out += [("text", m.content)] if m.content else []
        out += [("call", t.function.name, t.function.arguments) for t in calls]
        got.append(Turn(r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens,
                        tuple(out),
                        [t.logprob for t in choice.logprobs.content]))
        messages.append(m.model_dump(exclude_none=True))  # content, reasoning_content, tool_calls as returned
        messages += [{"role": "tool", "tool_call_id": t.id, "content": RESULT} for t in calls]
        messages.append({"role": "user", "content": follow_up(turn)})
    return got


def messages_turns(url: str, thinking: bool) -> list[Turn]:
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    messages = [{"role": "user", "content": ASK}]
    got = []
    for turn in range(TURNS):
        tc = {"type": "tool", "name": "get_weather"} if turn in FORCED else {"type": "none"}
        r = c.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[tool], tool_choice=tc,
                              max_tokens=most(turn, thinking),
                              thinking={"type": "adaptive" if thinking else "disabled"},
                              extra_body={"temperature": 0})  # the SDK no longer takes temperature
        out = []
        for b in r.content:
            if b.type == "thinking":
                assert b.signature, b  # the server checks it when the block comes back
                out.append(("reasoning", b.thinking))
            else:
                out.append(("text", b.text) if b.type == "text" else ("call", b.name, json.dumps(b.input)))
        u = r.usage  # Anthropic's input_tokens leaves the cached ones out
        got.append(Turn(u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens,
                        tuple(out), []))
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": RESULT}
                   for b in r.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": results + [{"type": "text", "text": follow_up(turn)}]})
    return got


def responses_turns(url: str, thinking: bool) -> list[Turn]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    items = [{"role": "user", "content": ASK}]
    got = []
    for turn in range(TURNS):
        tc = {"type": "function", "name": "get_weather"} if turn in FORCED else "none"
        r = c.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=[{"type": "function", **TOOL}],
                               tool_choice=tc, max_output_tokens=most(turn, thinking), temperature=0, store=False,
                               reasoning={"effort": "medium" if thinking else "none"}, top_logprobs=0,
                               include=["reasoning.encrypted_content", "message.output_text.logprobs"])
        out, bits = [], []
        for it in r.output:
            if it.type == "message":
                out.append(("text", "".join(p.text for p in it.content)))
                bits += [e.logprob for p in it.content for e in p.logprobs or ()]
            elif it.type == "reasoning":
                assert it.encrypted_content, it  # what carries the reasoning's own ids back
                out.append(("reasoning", "".join(p.text for p in it.content or ())))
            else:
                out.append(("call", it.name, it.arguments))
        u = r.usage
        got.append(Turn(u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens, tuple(out), bits))
        for it in r.output:  # the output items as returned, each call answered
            items.append(it.model_dump(exclude_none=True))
            if it.type == "function_call":
                items.append({"type": "function_call_output", "call_id": it.call_id, "output": RESULT})
        items.append({"role": "user", "content": follow_up(turn)})
    return got


LOOPS = {"chat": chat_turns, "messages": messages_turns, "responses": responses_turns}


@pytest.fixture
def servers(model, template):  # noqa: F811
    """(engine, url) with the prefix cache, and (engine, url) without: fresh engines per test."""
    cached = kvfold.Engine(model, max_seq_len=4096, max_running=4, conversations=1 << 20)
    replayed = kvfold.Engine(model, max_seq_len=4096, max_running=4, conversations=1 << 20, prefix_cache_bytes=0)
    with contextlib.ExitStack() as stack:
        yield [(e, stack.enter_context(serving(create_app(e, model_name=MODEL, chat_template=template))))
               for e in (cached, replayed)]


def ratios(turns: list[Turn]) -> list[float]:
    return [round(t.cached / t.prompt, 4) for t in turns]


@pytest.mark.parametrize("thinking", [False, True], ids=["tools", "thinking"])
@pytest.mark.parametrize("api", list(LOOPS))
def test_a_resent_conversation_is_cached_and_continues_bit_for_bit(servers, api, thinking):
    (cached_engine, cached_url), (replayed_engine, replayed_url) = servers
    with ThreadPoolExecutor(2) as pool:  # the two servers side by side
        cached, replayed = pool.map(lambda url: LOOPS[api](url, thinking), (cached_url, replayed_url))
    print(api, "thinking" if thinking else "tools", "cached:", ratios(cached), "replayed:", ratios(replayed))
    # the conversation is what it says: a long prompt; in chat mode calls on the forced turns only,
    # in thinking mode reasoning on every turn (sent back as thinking blocks, encrypted reasoning)
    assert cached[0].prompt > 1000
    for turn, t in enumerate(cached):
        kinds = [o[0] for o in t.out]
        assert ("reasoning" in kinds) if thinking else (("call" in kinds) == (turn in FORCED)), (turn, t.out)
    # the cache covers everything before the new user turn: all the earlier turns fed (each
    # output's last token is sampled, never fed), so at least 95% of the prompt
    assert all(r >= HIT for r in ratios(cached)[1:]), ratios(cached)
    for before, t in zip(cached, cached[1:]):
        assert before.prompt + before.output - 1 <= t.cached < t.prompt, (before, t)
    # the control: without the prefix cache nothing past the first prompt is found, the bits are
    # computed again (the earlier outputs replayed one token a call)
    assert all(r < HIT for r in ratios(replayed)[1:]), ratios(replayed)
    assert all(t.cached <= replayed[0].prompt for t in replayed)
    # the same prompts, the same outputs and logprob bits, turn for turn
    assert [t.prompt for t in cached] == [t.prompt for t in replayed]
    for turn, (a, b) in enumerate(zip(cached, replayed)):
        assert a.out == b.out, (turn, a.out, b.out)
        assert a.bits == b.bits, turn
    if api == "chat":  # logprobs for every token (Responses: for its message text; Messages: none)
        assert all(len(t.bits) == t.output for t in cached)
    # every re-sent prompt took its conversation's ids
    assert cached_engine.transcripts.aligned == replayed_engine.transcripts.aligned == TURNS - 1

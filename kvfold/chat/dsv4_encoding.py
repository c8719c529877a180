"""The DeepSeek-V4 chat encoding: OpenAI-shaped messages -> the prompt text V4 was trained on.

The DeepSeek-V4 release ships no Jinja chat_template; the format is defined by the Python encoder
in the release's encoding/encoding_dsv4.py. This is kvfold's own implementation of its prompt side,
plus the convention OpenAI-compatible servers wrap around it: request-level `tools` and
`response_format` go into the leading system message, inserted empty when there is none.

A prompt is BOS and then the turns with no separators of their own:

    BOS [max-effort preamble] system-text [\\n\\n tools section] [\\n\\n response-format section]
    <｜User｜>question<｜Assistant｜></think>answer<｜end▁of▁sentence｜>
    <｜User｜><tool_result>r1</tool_result>\\n\\n<tool_result>r2</tool_result><｜Assistant｜><think>

- An assistant turn is [reasoning</think>] text [\\n\\n DSML tool-call block] EOS; the reasoning
  part is written in thinking mode only, and only for turns after the last user turn unless the
  request has tools (then every turn keeps it). A user turn that the assistant answers (or the
  last one, with add_generation_prompt) ends with <｜Assistant｜> and <think> when the model is to
  reason there, else </think>.
- There is no tool role: the results of one assistant turn's calls become one user turn of
  <tool_result> blocks, in the order of the calls; user text that follows joins that turn, and
  consecutive user messages join into one, all blocks separated by a blank line.
- A developer message is a user turn of its own (<｜User｜>text); in thinking mode without tools
  the developer messages before the last user turn are left out, as the release does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvfold.errors import InvalidRequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"
BLOCK_SEP = "\n\n"  # between the sections of a system turn and the blocks of a user turn

# None and "high" render alike; "max" adds MAX_EFFORT_PREAMBLE in thinking mode. The release
# accepts no other value, so neither does encode_chat (a server maps OpenAI's levels first:
# `reasoning_mode`).
REASONING_EFFORTS = (None, "high", "max")
# OpenAI's reasoning_effort levels -> the release's: "none" is chat mode (no reasoning, None here);
# the release has no level below "high" (its default), so the lower ones reason at "high", and
# "xhigh" is its "max".
OPENAI_EFFORTS = {"none": None, "minimal": "high", "low": "high", "medium": "high", "high": "high",
                  "xhigh": "max", "max": "max"}
MAX_EFFORT_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve"
    " the root cause, rigorously stress-testing your logic against all potential paths, edge cases,"
    " and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step,"
    " considered alternative, and rejected hypothesis to ensure absolutely no assumption is left"
    " unchecked.\n\n"
)
RESPONSE_FORMAT_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


class ChatEncodingError(InvalidRequestError):
    """Messages or options the DeepSeek-V4 format cannot express; `param` names the culprit."""


@dataclass
class _Turn:
    """One turn of the prompt. Tool messages are folded into user turns, so there is no tool role."""

    role: str  # system | developer | user | assistant
    blocks: list[str] = field(default_factory=list)  # texts, joined by BLOCK_SEP
    results: list[tuple[int, str]] = field(default_factory=list)  # user: (call position, tool result)
    reasoning: str = ""  # assistant only
    calls: list[tuple[str, dict]] = field(default_factory=list)  # assistant only: (name, arguments)


def encode_chat(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = False,
                reasoning_effort: str | None = None, response_format: dict | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text (BOS first) for OpenAI-shaped messages.

    `thinking` picks the release's thinking mode (the reply opens with <think>) over chat mode
    (</think>). With add_generation_prompt=False a trailing user turn gets no <｜Assistant｜>
    opener (the release always writes one); a trailing assistant turn never gets one.
    Raises ChatEncodingError for what the format cannot express.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatEncodingError(
            f"reasoning_effort {reasoning_effort!r} is not one DeepSeek-V4 knows; "
            "use None, 'high' or 'max'", param="reasoning_effort")
    functions = _functions(tools)
    schema = _response_schema(response_format)
    turns = _to_turns(messages)
    if turns[0].role != "system":
        turns.insert(0, _Turn("system", [""]))
    if functions:
        turns[0].blocks.append(_tools_section(functions))
    if schema:  # an empty schema shows nothing, as an empty response_format in the release
        turns[0].blocks.append(RESPONSE_FORMAT_HEADER + _json(schema))
    keep_reasoning = bool(functions)  # the release keeps every turn's reasoning when tools are on
    if thinking and not keep_reasoning:
        last = _last_user_index(turns)
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last]
    preamble = MAX_EFFORT_PREAMBLE if thinking and reasoning_effort == "max" else ""
    return BOS + preamble + _render(turns, thinking=thinking, keep_reasoning=keep_reasoning,
                                    add_generation_prompt=add_generation_prompt)


def reasoning_mode(effort: str | None, thinking: bool | None) -> tuple[bool, str | None]:
    """(thinking, the release's effort) for a request's OpenAI `reasoning_effort` and its own
    `thinking` switch (None: not given, chat mode). "none" turns thinking off, so asking for
    thinking too is a contradiction (ChatEncodingError); any other level leaves the switch as
    the request set it and picks the depth of the reasoning when it is on."""
    if effort is not None and effort not in OPENAI_EFFORTS:
        raise ChatEncodingError(f"reasoning_effort {effort!r} is not one of {', '.join(OPENAI_EFFORTS)}",
                                param="reasoning_effort")
    if effort == "none":
        if thinking:
            raise ChatEncodingError("reasoning_effort 'none' turns thinking off, but chat_template_kwargs asks "
                                    "for thinking: drop one of them", param="reasoning_effort")
        return False, None
    return bool(thinking), OPENAI_EFFORTS.get(effort) if effort is not None else None


def opens_reasoning(prompt: str) -> bool:
    """Whether the model's reply to `prompt` starts inside a reasoning block (thinking mode; for
    any template whose generation prompt ends in "<think>", whitespace after it allowed)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _render(turns: list[_Turn], *, thinking: bool, keep_reasoning: bool,
            add_generation_prompt: bool) -> str:
    """The turns as text. Which turns show reasoning, and whether a reply opens with <think>,
    depends on where the last user turn is: only the reply to it is reasoned, unless tools
    keep every turn's reasoning."""
    last_user = _last_user_index(turns)
    out = []
    for i, turn in enumerate(turns):
        if turn.role == "system":
            out.append(BLOCK_SEP.join(turn.blocks))
        elif turn.role == "assistant":
            out.append(_assistant_text(turn, thinking and (keep_reasoning or i > last_user)))
        else:
            out.append(USER + _user_text(turn))
            answered = i + 1 < len(turns) and turns[i + 1].role == "assistant"
            if answered or (i + 1 == len(turns) and add_generation_prompt):
                reasons = thinking and (keep_reasoning or i >= last_user)
                out.append(ASSISTANT + (THINK_OPEN if reasons else THINK_CLOSE))
    return "".join(out)


def _user_text(turn: _Turn) -> str:
    """Tool results first, in the order of the calls they answer (stable for equal positions),
    then the user's own text."""
    results = [TOOL_RESULT_OPEN + text + TOOL_RESULT_CLOSE
               for _, text in sorted(turn.results, key=lambda r: r[0])]
    return BLOCK_SEP.join(results + turn.blocks)


def _assistant_text(turn: _Turn, show_reasoning: bool) -> str:
    """[reasoning</think>] text [tool-call block] EOS; the block is DSML, as the model writes it."""
    text = (turn.reasoning + THINK_CLOSE if show_reasoning else "") + "".join(turn.blocks)
    if turn.calls:
        invokes = [f'<{DSML}invoke name="{name}">\n{_dsml_parameters(args)}\n</{DSML}invoke>'
                   for name, args in turn.calls]
        text += f"{BLOCK_SEP}<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"
    return text + EOS


def _dsml_parameters(arguments: dict) -> str:
    """One line per argument: strings verbatim with string="true", anything else as JSON."""
    lines = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                     f"{value if is_str else _json(value)}</{DSML}parameter>")
    return "\n".join(lines)


def _tools_section(functions: list[dict]) -> str:
    """The system prompt's tools section: how to call (in DSML), then one JSON schema a line."""
    example = "\n".join([
        f"<{DSML}tool_calls>",
        f'<{DSML}invoke name="$TOOL_NAME">',
        f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>',
        "...",
        f"</{DSML}invoke>",
        f'<{DSML}invoke name="$TOOL_NAME2">',
        "...",
        f"</{DSML}invoke>",
        f"</{DSML}tool_calls>",
    ])
    paragraphs = [
        "## Tools",
        ("You have access to a set of tools to help answer the user's question. You can invoke tools"
         f' by writing a "<{DSML}tool_calls>" block like the following:'),
        example,
        ('String parameters should be specified as is and set `string="true"`. For all other types'
         ' (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'),
        (f"If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete"
         f" reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response."),
        f"Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.",
        "### Available Tool Schemas",
        "\n".join(_json(f) for f in functions),
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.",
    ]
    return BLOCK_SEP.join(paragraphs) + "\n"


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _json(value: Any) -> str:
    # the release's JSON: default separators, non-ASCII kept as is
    return json.dumps(value, ensure_ascii=False)


# --- OpenAI request shapes -> turns -------------------------------------------------------------


def _to_turns(messages: list[dict]) -> list[_Turn]:
    """Validate the messages and fold them into turns: tool results and the user text after them
    into one user turn, consecutive user messages into one."""
    if not isinstance(messages, list) or not messages:
        raise ChatEncodingError("messages must be a non-empty list of chat messages", param="messages")
    turns: list[_Turn] = []
    call_ids: list | None = None  # ids of the calls that tool messages may answer now
    for i, msg in enumerate(messages):
        at = f"messages.{i}"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "tool":
            _add_tool_result(turns, msg, at, call_ids)
            continue
        call_ids = None
        if role == "system":
            if any(t.role != "system" for t in turns):
                raise ChatEncodingError(
                    f"{at} is a system message after the conversation started; DeepSeek-V4 has no "
                    "place for it there: move it to the start or make it a user message", param=f"{at}.role")
            turns.append(_Turn("system", [_text(msg.get("content"), f"{at}.content")]))
        elif role == "developer":
            text = _text(msg.get("content"), f"{at}.content")
            if not text:
                raise ChatEncodingError(f"{at} is a developer message with no text", param=f"{at}.content")
            turns.append(_Turn("developer", [text]))
        elif role == "user":
            text = _text(msg.get("content"), f"{at}.content")
            if not turns or turns[-1].role != "user":
                turns.append(_Turn("user"))
            turns[-1].blocks.append(text)
        elif role == "assistant":
            turn, ids = _assistant_turn(msg, at, turns)
            turns.append(turn)
            call_ids = ids if turn.calls else None
        else:
            raise ChatEncodingError(
                f"{at} has role {role!r}; DeepSeek-V4 messages are system, developer, user, assistant "
                "or tool", param=f"{at}.role")
    return turns


def _assistant_turn(msg: dict, at: str, turns: list[_Turn]) -> tuple[_Turn, list]:
    """An assistant turn and its calls' ids; it must answer a user or developer turn (tool
    results count as user)."""
    if not turns or turns[-1].role not in ("user", "developer"):
        raise ChatEncodingError(
            f"{at} is an assistant message that answers no user, developer or tool message; "
            "DeepSeek-V4 cannot open an assistant turn there", param=f"{at}.role")
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatEncodingError(f"{at}.reasoning_content must be a string", param=f"{at}.reasoning_content")
    calls = _calls(msg.get("tool_calls"), f"{at}.tool_calls")
    turn = _Turn("assistant", [_text(msg.get("content"), f"{at}.content")], reasoning=reasoning or "",
                 calls=[(name, args) for _, name, args in calls])
    return turn, [call_id for call_id, _, _ in calls]


def _add_tool_result(turns: list[_Turn], msg: dict, at: str, call_ids: list | None) -> None:
    """Fold a tool message into the user turn after the assistant turn whose call it answers."""
    if call_ids is None:
        raise ChatEncodingError(
            f"{at} is a tool result that follows no assistant message with tool_calls; "
            "put it right after the assistant message that made the call", param=f"{at}.role")
    ref = msg.get("tool_call_id")
    known = [c for c in call_ids if c]
    if known and ref not in known:
        raise ChatEncodingError(
            f"{at}.tool_call_id {ref!r} names none of the preceding assistant's calls {known}",
            param=f"{at}.tool_call_id")
    position = call_ids.index(ref) if ref in known else 0  # calls without ids: order as given
    if turns[-1].role != "user":
        turns.append(_Turn("user"))
    turns[-1].results.append((position, _text(msg.get("content"), f"{at}.content")))


def _calls(raw: Any, at: str) -> list[tuple[Any, str, dict]]:
    """(id, name, arguments) of an assistant message's OpenAI tool_calls."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ChatEncodingError(f"{at} must be a list of tool calls", param=at)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ChatEncodingError(f"{at}.{j} has no function name", param=f"{at}.{j}.function.name")
        calls.append((call.get("id"), name, _arguments(fn.get("arguments"), f"{at}.{j}.function.arguments")))
    return calls


def _arguments(raw: Any, at: str) -> dict:
    """A call's arguments as an object: DSML writes one parameter per key, so nothing else fits."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ChatEncodingError(f"{at} is not valid JSON ({e.msg})", param=at) from None
    if not isinstance(raw, dict):
        raise ChatEncodingError(f"{at} must be a JSON object of named arguments", param=at)
    return raw


def _text(content: Any, at: str) -> str:
    """A message's content as text: a string, None (empty), or text parts joined by a blank line
    (the release's separator for the parts of a tool result)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatEncodingError(f"{at} must be a string, null or a list of text parts", param=at)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatEncodingError(f"{at}.{j} is a {kind!r} part; DeepSeek-V4 prompts hold text only",
                                    param=f"{at}.{j}")
        texts.append(part["text"])
    return BLOCK_SEP.join(texts)


def _functions(tools: list[dict] | None) -> list[dict]:
    """The function definitions of OpenAI tools, each rendered as JSON in the tools section."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatEncodingError("tools must be a list of function tools", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatEncodingError(f"tools.{i} is not a function tool", param=f"tools.{i}.type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatEncodingError(f"tools.{i} has no function name", param=f"tools.{i}.function.name")
        functions.append(fn)
    return functions


def _response_schema(response_format: dict | None) -> dict | None:
    """The JSON schema the response-format section shows; json_object asks for any object."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ChatEncodingError("response_format json_schema needs a schema object",
                                    param="response_format.json_schema.schema")
        return schema
    raise ChatEncodingError(f"response_format type {kind!r} is not text, json_object or json_schema",
                            param="response_format.type")

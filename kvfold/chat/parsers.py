"""Model output -> OpenAI `reasoning_content`, `content` and `tool_calls`, whole or streamed.

Two output formats are understood (learned from public references, re-implemented here):

* DeepSeek-V4 ("deepseek_v4"). Reasoning is ``<think>…</think>``; in thinking mode the prompt
  already ends with ``<think>``. Tool calls are DSML, as the release encoder writes them
  (sgl-project/sglang ``python/sglang/srt/entrypoints/openai/encoding_dsv4.py``)::

      {content}\\n\\n<｜DSML｜tool_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="P" string="true">raw text</｜DSML｜parameter>
      <｜DSML｜parameter name="Q" string="false">JSON</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  The bars are U+FF5C. Whitespace between tags is free, as in vLLM's parser
  (vllm-project/vllm ``vllm/tool_parsers/deepseekv32_tool_parser.py``, which
  ``vllm/tool_parsers/deepseekv4_tool_parser.py`` reuses with the ``tool_calls`` block name).
  As in ``vllm/reasoning/deepseek_v4_reasoning_parser.py``, a tool-call block met inside the
  reasoning ends the reasoning.
* GLM-4.5 / 4.7 / 5.x ("glm"). Reasoning is ``<think>…</think>``; a tool call is
  ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`` with optional
  whitespace (GLM-4.5 puts newlines) between the parts, as in vLLM's
  ``vllm/tool_parsers/glm4_moe_tool_parser.py`` and ``glm47_moe_tool_parser.py``. Values are
  raw text; a value whose parameter the tool's schema types as non-string is parsed.

A tool-call block (DSV4: the whole ``tool_calls`` block; GLM: one ``<tool_call>``) is emitted
only once it is complete and valid. Anything malformed (unclosed at the end, no name, bad
attributes, stray text between tags, a duplicate parameter, a ``string="false"`` value that is
not JSON, a block with no call) is returned verbatim as content. So while streaming, markup is
held back until it is known valid or invalid (invalid is reported as soon as no continuation
could be valid); a valid block's calls then come in one Delta, one argument fragment per
parameter. Under a forced tool choice (`OutputParser(forced=True)`: the grammar makes the output
a call) a call streams as it is written instead, never taken back. The whole-output parse runs the same machine on the whole text, so a streamed parse
always equals the whole parse.

Choices where the references differ or are silent:

* A function name not among the request's tools is still a call (vLLM's DSML and GLM parsers do
  not check either); its values are just not coerced. Names must be one word without
  ``<>"{}[]``, so JSON or prose after ``<tool_call>`` is not mistaken for a call.
* Whitespace after ``</think>`` is content, as in vLLM. Whitespace right before a valid block,
  and after the last one, is dropped: the encoder/template put it there as a separator.
* Content after a tool-call block stays content (vLLM keeps it when streaming, not in its
  whole-output parse; here both must agree, and dropping text loses it).
* Reasoning that never closes stays reasoning (vLLM's glm45 whole-output parser would call it
  content, its streaming parser reasoning).
* Coercion follows vLLM's ``coerce_to_schema_type``: a parameter typed string (or without type
  information) keeps its text; otherwise null/integer/number/boolean/object/array in that order,
  falling back to the text. A DSML ``string="true"`` value is coerced the same way, so a model
  that quotes a number for an integer parameter still yields a number (vLLM keeps it a string).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from .coercion import coerce_json, coerce_text, schema_types, tool_properties

FAMILIES = ("deepseek_v4", "glm", "plain")

THINK_START = "<think>"
THINK_END = "</think>"

_DSML = "｜DSML｜"
DSML_BLOCK_START = f"<{_DSML}tool_calls>"
DSML_BLOCK_END = f"</{_DSML}tool_calls>"
_DSML_INVOKE = f"<{_DSML}invoke"
_DSML_INVOKE_END = f"</{_DSML}invoke>"
_DSML_PARAM = f"<{_DSML}parameter"
_DSML_PARAM_END = f"</{_DSML}parameter>"

GLM_CALL_START = "<tool_call>"
GLM_CALL_END = "</tool_call>"
_GLM_KEY, _GLM_KEY_END = "<arg_key>", "</arg_key>"
_GLM_VALUE, _GLM_VALUE_END = "<arg_value>", "</arg_value>"

# The scanners below answer NEED (the text so far is a viable prefix: wait for more) or FAIL
# (no continuation can be valid).
NEED = "need"
FAIL = "fail"


@dataclass
class ToolCall:
    id: str  # "call_" + 24 random hex chars, like vLLM's
    name: str
    arguments: str  # JSON text of an object


@dataclass
class Delta:
    """One streaming increment. `tool_calls` holds (index, id or None, name or None, fragment):
    the first fragment of call i carries its id and name, later ones only argument text; the
    fragments of call i concatenate to its `arguments`."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


# ---------------------------------------------------------------- scanning helpers


def _tag_overlap(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: the
    part of the text that must be held back because it may be the start of a tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def _match(s: str, pos: int, literals: tuple[str, ...]) -> tuple[str, int] | str:
    """Which of `literals` starts at `pos` -> (literal, end); NEED if the text runs out inside a
    possible match; FAIL if none can match."""
    rest = s[pos:]
    for lit in literals:
        if rest.startswith(lit):
            return lit, pos + len(lit)
    return NEED if any(lit.startswith(rest) for lit in literals) else FAIL


def _skip_ws(s: str, pos: int) -> int:
    while pos < len(s) and s[pos].isspace():
        pos += 1
    return pos


def _ws1(s: str, pos: int) -> int | str:
    """At least one whitespace character (between a tag name and its attribute)."""
    if pos >= len(s):
        return NEED
    return _skip_ws(s, pos) if s[pos].isspace() else FAIL


_NOT_IN_NAMES = set('<>"{}[]')


def _bad_name_chars(name: str) -> bool:
    """Function and parameter names are identifiers (OpenAI's are [a-zA-Z0-9_-]; MCP adds dots
    and slashes): whitespace or JSON/markup punctuation in one means this is not a tool call."""
    return any(c.isspace() or c in _NOT_IN_NAMES for c in name)


def _quoted_name(s: str, pos: int, prefix: str, *, strict: bool) -> tuple[str, int] | str:
    """`prefix` (e.g. ``name="``) then a non-empty name, then ``"``. `strict` (function names)
    also refuses whitespace and punctuation; a parameter name may hold anything but ``"``."""
    m = _match(s, pos, (prefix,))
    if isinstance(m, str):
        return m
    start = m[1]
    end = s.find('"', start)
    name = s[start:] if end == -1 else s[start:end]
    if strict and _bad_name_chars(name):
        return FAIL
    if end == -1:
        return NEED
    return (name, end + 1) if name else FAIL


def _until(s: str, pos: int, close: str) -> tuple[str, int] | str:
    """Raw text up to `close` -> (text, end after close); NEED while `close` has not come."""
    end = s.find(close, pos)
    return NEED if end == -1 else (s[pos:end], end + len(close))


# ---------------------------------------------------------------- DSML (DeepSeek-V4)


class _Progress:
    """How far a scan of tool-call markup got, for streaming a forced call as it is written:
    `calls` [name, complete (key, value) pairs, closed], and the value being written when the
    text ran out (`open`: key, raw text so far, whether it stays that text, its closing tag)."""

    def __init__(self):
        self.calls: list[list] = []
        self.open: tuple[str, str, bool, str] | None = None


def _keeps_text(types: set[str]) -> bool:
    """Whether `coerce_text` returns a value's raw text whatever it turns out to be (so the text
    can stream before the value ends): a string parameter, or one without type information, that
    cannot be null."""
    return (not types or "string" in types) and "null" not in types


def _scan_dsml_param(s: str, pos: int, types_of, progress: _Progress | None = None) -> tuple[str, Any, int] | str:
    """One ``<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>`` whose
    opening ``<｜DSML｜parameter`` ends before `pos` -> (name, coerced value, end)."""
    pos = _ws1(s, pos)
    if isinstance(pos, str):
        return pos
    named = _quoted_name(s, pos, 'name="', strict=False)
    if isinstance(named, str):
        return named
    name, pos = named
    pos = _ws1(s, pos)
    if isinstance(pos, str):
        return pos
    flag = _match(s, pos, ('string="true"', 'string="false"'))
    if isinstance(flag, str):
        return flag
    gt = _match(s, _skip_ws(s, flag[1]), (">",))
    if isinstance(gt, str):
        return gt
    value = _until(s, gt[1], _DSML_PARAM_END)
    if isinstance(value, str):
        if progress is not None:
            progress.open = (name, s[gt[1]:], flag[0] == 'string="true"' and _keeps_text(types_of(name)),
                             _DSML_PARAM_END)
        return value
    raw, end = value
    if flag[0] == 'string="true"':
        return name, coerce_text(raw, types_of(name)), end
    ok, parsed = coerce_json(raw, types_of(name))
    return (name, parsed, end) if ok else FAIL


def _scan_dsml_invoke(s: str, pos: int, props: dict,
                      progress: _Progress | None = None) -> tuple[tuple[str, list], int] | str:
    """One invoke whose opening ``<｜DSML｜invoke`` ends before `pos`: ``name="N">``, its
    parameters, ``</｜DSML｜invoke>`` -> ((name, [(key, value)]), end)."""
    pos = _ws1(s, pos)
    if isinstance(pos, str):
        return pos
    named = _quoted_name(s, pos, 'name="', strict=True)
    if isinstance(named, str):
        return named
    name, pos = named
    gt = _match(s, _skip_ws(s, pos), (">",))
    if isinstance(gt, str):
        return gt
    pos = gt[1]
    schema = props.get(name, {})

    def types_of(key: str) -> set[str]:
        return schema_types(schema.get(key)) if isinstance(schema, dict) else set()

    args: list[tuple[str, Any]] = []
    if progress is not None:
        progress.calls.append([name, args, False])
    while True:
        tag = _match(s, _skip_ws(s, pos), (_DSML_PARAM, _DSML_INVOKE_END))
        if isinstance(tag, str):
            return tag
        if tag[0] == _DSML_INVOKE_END:
            if progress is not None:
                progress.calls[-1][2] = True
            return (name, args), tag[1]
        param = _scan_dsml_param(s, tag[1], types_of, progress)
        if isinstance(param, str):
            return param
        key, value, pos = param
        if any(key == k for k, _ in args):
            return FAIL  # a duplicate parameter (the release encoder refuses one too)
        args.append((key, value))


def scan_dsml_block(s: str, props: dict, progress: _Progress | None = None) -> tuple[list, int] | str:
    """The body of a ``<｜DSML｜tool_calls>`` block (`s` starts right after that tag) up to and
    including ``</｜DSML｜tool_calls>`` -> (calls, end), or NEED / FAIL. A block without any
    invoke is not a tool call (FAIL)."""
    calls: list[tuple[str, list]] = []
    pos = 0
    while True:
        tag = _match(s, _skip_ws(s, pos), (_DSML_INVOKE, DSML_BLOCK_END))
        if isinstance(tag, str):
            return tag
        if tag[0] == DSML_BLOCK_END:
            return (calls, tag[1]) if calls else FAIL
        invoke = _scan_dsml_invoke(s, tag[1], props, progress)
        if isinstance(invoke, str):
            return invoke
        call, pos = invoke
        calls.append(call)


# ---------------------------------------------------------------- GLM


def _glm_name(s: str) -> tuple[str, int] | str:
    """The function name: the text before the first ``<``, stripped; one word, not empty."""
    lt = s.find("<")
    words = (s if lt == -1 else s[:lt]).split()
    if len(words) > 1 or (words and _bad_name_chars(words[0])):
        return FAIL
    if lt == -1:
        return NEED
    return (words[0], lt) if words else FAIL


def _glm_key(s: str, pos: int) -> tuple[str, int] | str:
    """An argument key up to ``</arg_key>``: stripped, not empty, no ``<`` in it."""
    end = s.find(_GLM_KEY_END, pos)
    if end == -1:
        lt = s.find("<", pos)
        return FAIL if lt != -1 and not _GLM_KEY_END.startswith(s[lt:]) else NEED
    key = s[pos:end].strip()
    return (key, end + len(_GLM_KEY_END)) if key and "<" not in key else FAIL


def scan_glm_call(s: str, props: dict, progress: _Progress | None = None) -> tuple[list, int] | str:
    """The body of one ``<tool_call>`` (`s` starts right after it) up to and including
    ``</tool_call>`` -> ([(name, [(key, value)])], end), or NEED / FAIL."""
    named = _glm_name(s)
    if isinstance(named, str):
        return named
    name, pos = named
    schema = props.get(name, {})
    args: list[tuple[str, Any]] = []
    if progress is not None:
        progress.calls.append([name, args, False])
    while True:
        tag = _match(s, _skip_ws(s, pos), (_GLM_KEY, GLM_CALL_END))
        if isinstance(tag, str):
            return tag
        if tag[0] == GLM_CALL_END:
            if progress is not None:
                progress.calls[-1][2] = True
            return [(name, args)], tag[1]
        keyed = _glm_key(s, tag[1])
        if isinstance(keyed, str):
            return keyed
        key, pos = keyed
        opened = _match(s, _skip_ws(s, pos), (_GLM_VALUE,))
        if isinstance(opened, str):
            return opened
        types = schema_types(schema.get(key)) if isinstance(schema, dict) else set()
        value = _until(s, opened[1], _GLM_VALUE_END)
        if isinstance(value, str):
            if progress is not None:
                progress.open = (key, s[opened[1]:], _keeps_text(types), _GLM_VALUE_END)
            return value
        raw, pos = value
        if any(key == k for k, _ in args):
            return FAIL
        args.append((key, coerce_text(raw, types)))


# ---------------------------------------------------------------- the streaming parser


def _argument_fragments(args: list[tuple[str, Any]]) -> list[str]:
    """The arguments JSON of one call in pieces, one per parameter (as vLLM streams them):
    ``{"a": 1``, ``, "b": "x"``, ``}``. Joined they equal ``json.dumps(dict(args))``."""
    parts = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
             for k, v in args]
    if not parts:
        return ["{}"]
    return ["{" + parts[0]] + [", " + p for p in parts[1:]] + ["}"]


def _streamed_arguments(args: list[tuple[str, Any]], closed: bool, open_value, final: bool) -> str:
    """The arguments JSON of a call being written, as far as it is known: whole once the call is
    closed; else its complete parameters and, when the value being written stays text
    (`_Progress.open`), that text so far (less a possible start of its closing tag, unless the
    output ended). Always a prefix of the JSON the finished call will have."""
    whole = "".join(_argument_fragments(args))
    if closed:
        return whole
    text = "{" + whole[1:-1] if args else "{"
    if open_value is not None and open_value[2]:
        key, raw, _, close = open_value
        raw = raw if final else raw[:len(raw) - _tag_overlap(raw, (close,))]
        text += (", " if args else "") + json.dumps(key, ensure_ascii=False) + ': "' + \
            json.dumps(raw, ensure_ascii=False)[1:-1]
    return text


class OutputParser:
    """One choice's output, fed text as it is decoded.

    `feed` returns only what is safe to emit now; `finish` flushes the rest. Modes: "start"
    (is a ``<think>`` coming?), "reasoning", "content", "block" (inside tool-call markup that is
    not yet known valid or invalid).

    `end_token`: the id of ``</think>`` where the tokenizer has one (with `decode`, its decoding of
    ids). A caller that feeds every text with its ids then gets the reasoning ended by that token
    only, the event structured output waits for (`grammar_after`): a model that writes ``</``,
    ``think``, ``>`` as three pieces is still reasoning, and so is the grammar still waiting. A
    feed without ids falls back to the text for the rest of the output.

    `forced`: the output is constrained to tool calls (tool_choice "required" or a named tool, by
    the grammar), so tool-call markup is a call from its first token: a call's id and name go
    out as soon as its name is read and its arguments as they are written (a value that stays
    text character by character, others whole), never taken back. A call the output ends
    inside (the token limit, a stop sequence) keeps the arguments streamed so far, which are
    then not complete JSON; markup that turns invalid after a call's name (the grammar rules it
    out) ends the block there, its calls as streamed."""

    def __init__(self, family: str, *, tools: list[dict] | None = None,
                 in_reasoning: bool = False, end_token: int | None = None, decode=None, forced: bool = False):
        if family not in FAMILIES:
            raise ValueError(f"unknown output family {family!r}; use one of {FAMILIES}")
        self.family = family
        self._props = tool_properties(tools)
        self._tools_on = bool(tools) and family != "plain"
        self._block_start = DSML_BLOCK_START if family == "deepseek_v4" else GLM_CALL_START
        self._reasoning_ends = (THINK_END, DSML_BLOCK_START) if family == "deepseek_v4" \
            else (THINK_END,)
        self._mode = "reasoning" if in_reasoning else "start"
        self.reasoning_started = in_reasoning  # None vs "" for parse_output's reasoning
        self._buf = ""
        self._pending_ws = ""  # whitespace right before a block: dropped if the block is valid
        self._after_block = False  # just after a valid block: trailing whitespace is dropped
        self._calls: list[ToolCall] = []
        self._finished = False
        self._end_token = end_token if decode is not None else None
        self._decode = decode
        self._ids: list[int] = []  # ids fed until end_token came
        self._end_at: int | None = None  # where end_token's text starts in the output
        self._fed = 0  # characters fed so far: _buf is the output from _fed - len(_buf) on
        self._forced = forced and self._tools_on
        self._live: list[list] = []  # forced: the open block's calls streamed so far [id, name, sent, recorded]
        self._live_base = 0

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls so far."""
        return list(self._calls)

    def feed(self, text: str, token_ids: list[int] | None = None) -> Delta:
        """More decoded text (and the ids it came from) -> what can be emitted now. Text fed
        after `finish` is ignored."""
        if self._finished:
            return Delta()
        if token_ids is None:
            self._end_token = None  # the text alone decides from here on
        elif self._end_token is not None and self._end_at is None:
            self._find_end_token(token_ids)
        if not text:
            return Delta()
        self._buf += text
        self._fed += len(text)
        return self._run(final=False)

    def _find_end_token(self, token_ids: list[int]) -> None:
        """Note where end_token's text starts in the output, once it comes: the text of the ids
        before it (ids come no later than their text, so this is known before the text is)."""
        start = len(self._ids)
        self._ids += token_ids
        if self._end_token in token_ids:
            self._end_at = len(self._decode(self._ids[:self._ids.index(self._end_token, start)]))
            self._ids = []

    def finish(self) -> Delta:
        """End of output: everything still held is resolved (unresolved markup is content)."""
        if self._finished:
            return Delta()
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        step = {"start": self._step_start, "reasoning": self._step_reasoning,
                "content": self._step_content, "block": self._step_block}
        while step[self._mode](out, final):
            pass
        return out

    def _step_start(self, out: Delta, final: bool) -> bool:
        """Before anything is emitted: output that opens with ``<think>`` (after optional
        whitespace, as GLM-4.5 writes ``\\n<think>``) starts in the reasoning."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf = head[len(THINK_START):]
            self._mode, self.reasoning_started = "reasoning", True
            return True
        if THINK_START.startswith(head) and not final:
            return False
        self._mode = "content"
        return True

    def _step_reasoning(self, out: Delta, final: bool) -> bool:
        """Reasoning runs to ``</think>`` (dropped) or, for DeepSeek-V4, to a tool-call block
        (kept for the content step), as vLLM's deepseek_v4 reasoning parser does."""
        tags = self._reasoning_ends if self._end_token is None else \
            tuple(t for t in self._reasoning_ends if t != THINK_END)  # the token ends it, not its text
        ends = [(i, tag) for tag in tags if (i := self._buf.find(tag)) != -1]
        here = None if self._end_at is None else max(0, self._end_at - (self._fed - len(self._buf)))
        if self._end_token is not None and here is not None and (i := self._buf.find(THINK_END, here)) != -1:
            ends.append((i, THINK_END))
        if ends:
            i, tag = min(ends)
            out.reasoning += self._buf[:i]
            self._buf = self._buf[i + len(tag):] if tag == THINK_END else self._buf[i:]
            self._mode = "content"
            return True
        keep = 0 if final else _tag_overlap(self._buf, tags)
        if here is not None and self._end_token is not None and not final:
            keep = max(keep, len(self._buf) - here)  # the token's text has begun: hold it back
        out.reasoning += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_content(self, out: Delta, final: bool) -> bool:
        """Content, looking for a tool-call block when tools were given. Whitespace right before
        a block is held back and dropped if the block turns out valid: the encoder/template put
        it there as a separator (DSV4 writes ``content + "\\n\\n" + block``, GLM strips the
        content). Whitespace after a valid block is dropped only if nothing else follows (or
        another block does)."""
        if self._after_block:
            if not self._buf.strip():
                if final:
                    self._buf = ""  # only whitespace after the last block: not content
                return False
            self._after_block = False
        if not self._tools_on:
            out.content, self._buf = out.content + self._buf, ""
            return False
        i = self._buf.find(self._block_start)
        if i != -1:
            before = self._buf[:i]
            kept = before.rstrip()
            out.content += kept
            self._pending_ws, self._buf = before[len(kept):], self._buf[i:]
            self._mode = "block"
            return True
        if final:
            out.content, self._buf = out.content + self._buf, ""
            return False
        safe = self._buf[:len(self._buf) - _tag_overlap(self._buf, (self._block_start,))]
        kept = safe.rstrip()
        out.content += kept
        self._buf = self._buf[len(kept):]
        return False

    def _step_block(self, out: Delta, final: bool) -> bool:
        """A buffer starting with the block tag: emit its calls once it is complete and valid;
        once it cannot be valid (or the output ends first), its opening tag is content and the
        text after it is scanned again as content."""
        body = self._buf[len(self._block_start):]
        progress = _Progress() if self._forced else None
        if self.family == "deepseek_v4":
            result = scan_dsml_block(body, self._props, progress)
        else:
            result = scan_glm_call(body, self._props, progress)
        if progress is not None and (progress.calls or self._live):
            return self._stream_block(out, progress, result, body, final)
        if result == NEED and not final:
            return False
        if isinstance(result, str):
            out.content += self._pending_ws + self._block_start
            self._after_block = False
        else:
            calls, end = result
            for name, args in calls:
                self._emit_call(out, name, args)
            body = body[end:]
            self._after_block = True
        self._buf, self._pending_ws, self._mode = body, "", "content"
        return True

    def _stream_block(self, out: Delta, progress: _Progress, result, body: str, final: bool) -> bool:
        """A forced block whose first call's name has been read: stream what is new in each call
        (its id and name once, then its arguments' JSON as far as it is known); record a call
        once it closes. When the block ends (complete, invalid, or the output ended inside it),
        the calls not yet recorded are recorded as they stand."""
        done = result != NEED or final
        if not self._live:
            self._live_base = len(self._calls)  # the index of the block's first call
        for j, (name, args, closed) in enumerate(progress.calls):
            index = self._live_base + j
            if j == len(self._live):
                call_id = "call_" + secrets.token_hex(12)
                out.tool_calls.append((index, call_id, name, ""))
                self._live.append([call_id, name, "", False])
            live = self._live[j]
            is_last = j == len(progress.calls) - 1
            target = _streamed_arguments(args, closed, progress.open if is_last else None,
                                         final and result == NEED)
            if target.startswith(live[2]) and len(target) > len(live[2]):
                out.tool_calls.append((index, None, None, target[len(live[2]):]))
                live[2] = target
            if (closed or done) and not live[3]:
                self._calls.append(ToolCall(id=live[0], name=live[1], arguments=live[2]))
                live[3] = True
        if not done:
            return False
        self._live, self._pending_ws, self._mode = [], "", "content"
        if isinstance(result, str):  # the output ended inside the block, or it turned invalid
            self._buf, self._after_block = "", False
            return True
        self._buf, self._after_block = body[result[1]:], True
        return True

    def _emit_call(self, out: Delta, name: str, args: list[tuple[str, Any]]) -> None:
        index = len(self._calls)
        call_id = "call_" + secrets.token_hex(12)
        fragments = _argument_fragments(args)
        out.tool_calls.append((index, call_id, name, ""))
        out.tool_calls.extend((index, None, None, f) for f in fragments)
        self._calls.append(ToolCall(id=call_id, name=name, arguments="".join(fragments)))


def parse_output(family: str, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False,
                 token_ids: list[int] | None = None, end_token: int | None = None,
                 decode=None, forced: bool = False) -> tuple[str | None, str, list[ToolCall]]:
    """A whole output -> (reasoning or None when there was no reasoning, content, tool calls).
    It is the streaming parser fed everything at once, so both ways agree by construction.
    With `token_ids` (the output's), `end_token` and `decode`: the reasoning ends at that token."""
    parser = OutputParser(family, tools=tools, in_reasoning=in_reasoning, end_token=end_token, decode=decode,
                          forced=forced)
    first, last = parser.feed(text, token_ids), parser.finish()
    reasoning = first.reasoning + last.reasoning if parser.reasoning_started else None
    return reasoning, first.content + last.content, parser.tool_calls


__all__ = ["FAMILIES", "Delta", "OutputParser", "ToolCall", "parse_output"]

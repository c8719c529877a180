"""Scanners of the tool-call markup the chat formats write: DeepSeek-V4's DSML blocks and GLM's
`<tool_call>` blocks. Each reads a prefix of the model's text and answers with what it parsed,
NEED (a viable prefix: wait for more text) or FAIL (no continuation can be valid); the streaming
parser (parsers.py) drives them, and a `ScanProgress` records how far a forced call has got so its
arguments can stream as they are written."""
from __future__ import annotations

from typing import Any

from .coercion import coerce_json, coerce_text, schema_types

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


# ---------------------------------------------------------------- scanning helpers


def tag_overlap(text: str, tags: tuple[str, ...]) -> int:
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


class ScanProgress:
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


def _scan_dsml_param(s: str, pos: int, types_of, progress: ScanProgress | None = None) -> tuple[str, Any, int] | str:
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
                      progress: ScanProgress | None = None) -> tuple[tuple[str, list], int] | str:
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


def scan_dsml_block(s: str, props: dict, progress: ScanProgress | None = None) -> tuple[list, int] | str:
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


def scan_glm_call(s: str, props: dict, progress: ScanProgress | None = None) -> tuple[list, int] | str:
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

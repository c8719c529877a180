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

from .coercion import tool_properties
from .tool_markup import (DSML_BLOCK_START, GLM_CALL_START, NEED, ScanProgress, scan_dsml_block, scan_glm_call,
                          tag_overlap)

FAMILIES = ("deepseek_v4", "glm", "plain")

THINK_START = "<think>"
THINK_END = "</think>"


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
    (`ScanProgress.open`), that text so far (less a possible start of its closing tag, unless the
    output ended). Always a prefix of the JSON the finished call will have."""
    whole = "".join(_argument_fragments(args))
    if closed:
        return whole
    text = "{" + whole[1:-1] if args else "{"
    if open_value is not None and open_value[2]:
        key, raw, _, close = open_value
        raw = raw if final else raw[:len(raw) - tag_overlap(raw, (close,))]
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
        keep = 0 if final else tag_overlap(self._buf, tags)
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
        safe = self._buf[:len(self._buf) - tag_overlap(self._buf, (self._block_start,))]
        kept = safe.rstrip()
        out.content += kept
        self._buf = self._buf[len(kept):]
        return False

    def _step_block(self, out: Delta, final: bool) -> bool:
        """A buffer starting with the block tag: emit its calls once it is complete and valid;
        once it cannot be valid (or the output ends first), its opening tag is content and the
        text after it is scanned again as content."""
        body = self._buf[len(self._block_start):]
        progress = ScanProgress() if self._forced else None
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

    def _stream_block(self, out: Delta, progress: ScanProgress, result, body: str, final: bool) -> bool:
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

"""Text from users and tools never becomes a control token.

A chat format renders messages to text, and the tokenizer maps the text of each added token
("<｜User｜>", "</think>", "｜DSML｜", GLM's "<|observation|>", ...) to its one id wherever it
meets it. Rendering a tool result that holds "<｜end▁of▁sentence｜><｜User｜>..." and encoding
the whole string would close the turn and open a new one: a web page an agent reads could write
the conversation. The DeepSeek-V4 release encoder and transformers' apply_chat_template both do
that; kvfold does not, unless a request asks for it (chat_template_kwargs
{"allow_control_tokens_in_content": true}).

How (`ContentGuard`): every string the template is handed (message contents, reasoning, tool-call
names and arguments, tool definitions, the response-format schema, chat_template_kwargs values)
has each marker replaced by a placeholder of private-use characters (U+E000 <index> U+E001), which
no template mistakes for markup and `strip`, `split` or `tojson` leave alone. The rendered text
then holds markers only where the template wrote them. It is cut at those (found by the tokenizer
itself, with its own matching rules), each becomes its id, and the text between them, placeholders
turned back into the marker text, is encoded with added-token matching off (`encode_text`): a
marker from a message is plain text, the text around it tokenized as any other.

A prompt whose strings hold no marker renders and encodes exactly as without the guard.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any

ESC, END = "\ue000", "\ue001"  # a placeholder is ESC <index in the marker table> END
_PLACEHOLDER = re.compile(f"{ESC}([0-9]+){END}")
_guards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its ContentGuard
_lock = threading.Lock()


def _trie_pattern(words: list[str]) -> re.Pattern:
    """A regex matching any of `words`, longest first, as a trie: the work at a position is the
    length of the longest marker prefix there, not the number of markers (an alternation of 1,283
    markers takes seconds on a megabyte of "<")."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch != ""]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body  # a word may end here: longer ones are tried first

    return re.compile(pattern(trie))


class ContentGuard:
    """Escapes what a template renders from a request, and encodes the rendered text so that only
    the template's own markers become control ids (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._table = (ESC, *sorted(set(tokenizer.control_tokens()) - {"", ESC}))
        self._index = {m: i for i, m in enumerate(self._table)}
        self._pattern = _trie_pattern(list(self._table))
        backend = getattr(tokenizer, "backend", None)
        self._control_ids = set(backend.get_added_tokens_decoder()) if backend is not None else set()

    @classmethod
    def of(cls, tokenizer: Any) -> "ContentGuard | None":
        """The guard of `tokenizer` (built once), or None when no text maps to a control id (the
        byte tokenizer: BOS and EOS have no text)."""
        if tokenizer is None or not getattr(tokenizer, "control_tokens", lambda: ())():
            return None
        with _lock:
            if tokenizer not in _guards:
                _guards[tokenizer] = cls(tokenizer)
            return _guards[tokenizer]

    def escape(self, value: Any) -> Any:
        """`value` with every string in it (dict keys too) escaped; other values as they are."""
        if isinstance(value, str):
            return self._pattern.sub(lambda m: f"{ESC}{self._index[m.group()]}{END}", value)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def escape_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A chat message escaped. Tool-call arguments are JSON text that the formats parse, where
        a \\u escape could spell a marker: their values are escaped after parsing."""
        out = self.escape({k: v for k, v in message.items() if k != "tool_calls"})
        if isinstance(message.get("tool_calls"), list):
            out["tool_calls"] = [self._escape_call(c) for c in message["tool_calls"]]
        elif "tool_calls" in message:
            out["tool_calls"] = self.escape(message["tool_calls"])
        return out

    def _escape_call(self, call: Any) -> Any:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        escaped = self.escape(call)
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                return escaped  # not JSON: the formats take (or refuse) the text as it is
            safe = self.escape(parsed)
            if safe != parsed:
                escaped["function"]["arguments"] = json.dumps(safe, ensure_ascii=False)
        return escaped

    def restore(self, text: str) -> str:
        """The rendered text as the model reads it: placeholders back to their marker text."""
        if ESC not in text:
            return text
        return _PLACEHOLDER.sub(lambda m: self._table[int(m.group(1))] if int(m.group(1)) < len(self._table)
                                else m.group(), text)

    def encode(self, rendered: str) -> list[int]:
        """The ids of a text rendered from escaped strings: the template's markers as their ids,
        everything else (a marker from a message included) as text."""
        if ESC not in rendered:  # nothing was escaped: the tokenizer's own encoding is the answer
            return self.tokenizer.encode(rendered)
        enc = self.tokenizer.backend.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for token_id, (lo, hi) in zip(enc.ids, enc.offsets):
            if token_id in self._control_ids:  # a marker the template wrote (placeholders are not markers)
                ids += self._text_ids(rendered[start:lo]) + [token_id]
                start = hi
        return ids + self._text_ids(rendered[start:])

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode_text(self.restore(text)) if text else []

"""Conversations kvfold produced, so that a client that sends one back continues its exact state.

Coding agents are stateless: every turn re-sends the whole conversation, its earlier assistant
turns as text (and tool calls as JSON). Rendered and encoded again, an assistant turn's text
need not give back the ids the model chose (a sampled token sequence is seldom the tokenizer's
own encoding of its text), so the prompt would diverge from the conversation's state where the
first reply starts. The engine keeps a bounded list of the conversations it produced
(`Transcript`: every id so far, and which positions were decoded one token a call). A new prompt
that renders such a conversation again, the same ids up to a point and then the same text
(`align`), takes the conversation's own ids and decode spans instead: its earlier outputs are
fed one token a model call, as they were decoded, so each turn computes exactly what a single
state growing through the whole conversation computes (bit for bit in batch-invariant mode, the
prefill chunks ending at the same multiples of the block). The prefix cache holds each finished
conversation's last state (`PrefixCache.insert_tail`), so the next turn restores it and runs
only the new tokens; when that entry has been evicted, the engine replays the decode spans and
gets the same bits, slower. So a request's bits never depend on what the cache holds.

Text is compared between the ids that decode to no text (special tokens such as the end of a
sentence), which must match id for id: a text run matches where the re-encoded ids decode to the
transcript's text, up to the whitespace by markup tags (`same_text`: a tool call the
model wrote with the grammar's free whitespace, rendered again canonically), and end on a token
boundary.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence as Seq

Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Transcript:
    ids: tuple[int, ...]  # every token of the conversation: its prompts and its outputs
    spans: Spans  # positions [a, b) that were fed one token a model call, ascending


class TranscriptStore:
    """The last `max_tokens` tokens' worth of finished conversations, most recent kept (thread-safe:
    the server aligns prompts while the engine's thread records)."""

    def __init__(self, tokenizer: Any, max_tokens: int = 1 << 22):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._items: OrderedDict[tuple[int, ...], Transcript] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._control: frozenset[int] | None = None
        self.aligned = 0  # prompts that took a transcript's ids

    def __len__(self) -> int:
        return len(self._items)

    def record(self, prompt: Seq[int], spans: Spans, output: Seq[int]) -> Transcript:
        """A finished request: its prompt (with the spans it was fed by) and its output. Every
        output token but the last was fed back one per call: positions len(prompt) ..
        len(prompt) + len(output) - 2 (a span that may be empty: it still marks where the
        prompt's prefill ended, which a cold run's chunks would cross)."""
        n = len(prompt)
        t = Transcript(tuple(prompt) + tuple(output), tuple(spans) + ((n, n + len(output) - 1),))
        with self._lock:
            if t.ids in self._items:
                self._items.move_to_end(t.ids)
                return t
            self._items[t.ids] = t
            self._tokens += len(t.ids)
            while self._tokens > self.max_tokens and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._tokens -= len(old.ids)
        return t

    def align(self, prompt: Seq[int]) -> tuple[list[int], Spans]:
        """The prompt as the continuation of the longest stored conversation it renders again
        (that conversation's ids, then the prompt's ids after its text), and that conversation's
        decode spans; the prompt unchanged, with none, when it continues none."""
        prompt = list(prompt)
        with self._lock:
            candidates = list(reversed(self._items.values()))
        best_ids, best_spans, best_len = prompt, (), 0
        for t in candidates:
            if len(t.ids) <= best_len:
                continue
            end = self._match(t, prompt)
            if end is None or end >= len(prompt):  # the prompt must go on past the conversation
                continue
            best_ids, best_spans, best_len = list(t.ids) + prompt[end:], t.spans, len(t.ids)
        if best_len:
            with self._lock:
                self.aligned += 1
        return best_ids, best_spans

    def _match(self, t: Transcript, prompt: list[int]) -> int | None:
        """Where in `prompt` the transcript `t` ends, if the prompt renders all of it: the same ids
        up to a point, then the same control ids and the same text between them. A control id the
        model wrote that no text shows (a special token in an output) is the transcript's own: a
        client re-sending the output's text cannot carry it."""
        ids = t.ids
        j = _common_prefix(ids, prompt)
        if j == len(ids):
            return j
        if not t.spans or j < t.spans[0][0]:  # it differs before its first reply: another conversation
            return None
        control = self._control_ids()
        k, at = j, j
        for run_is_control, run in _runs(ids[j:], control):
            if run_is_control:
                if prompt[k:k + 1] == list(run):
                    k += 1
                elif not any(a <= at <= b for a, b in t.spans):
                    return None
            else:
                k = self._text_end(run, prompt, k, control)
                if k is None:
                    return None
            at += len(run)
        return k

    def _text_end(self, run: Seq[int], prompt: list[int], k: int, control: frozenset[int]) -> int | None:
        """The end e of prompt[k:e], no control id in it, whose text is `run`'s (`same_text`)."""
        def text(ids) -> str:
            return same_text(self.tokenizer.decode(list(ids)))
        want = text(run)
        stop = k
        while stop < len(prompt) and prompt[stop] not in control:
            stop += 1
        lo, hi = k, stop  # the shortest e whose text is at least as long as the run's
        while lo < hi:
            mid = (lo + hi) // 2
            if len(text(prompt[k:mid])) >= len(want):
                hi = mid
            else:
                lo = mid + 1
        for e in range(lo, min(stop, lo + 3) + 1):  # (tokens of no text of their own at the boundary)
            if text(prompt[k:e]) == want:
                return e
        return None

    def _control_ids(self) -> frozenset[int]:
        """The ids that decode to no text (special tokens: end of sentence, ...), which text cannot
        stand for: they must match id for id. Markers that decode to their text ("｜DSML｜",
        "</think>") compare as text: a model may write one as a single id or as pieces, and a
        chat format renders it as the single id."""
        if self._control is None:
            ids = set()
            for text in getattr(self.tokenizer, "control_tokens", lambda: ())():
                enc = self.tokenizer.encode(text)
                if len(enc) == 1 and self.tokenizer.decode(enc) == "":
                    ids.add(enc[0])
            self._control = frozenset(ids)
        return self._control


def _common_prefix(a: Seq[int], b: list[int]) -> int:
    """The length of the longest common prefix, by slices compared whole (a few C-speed compares,
    not one Python step a token)."""
    a = list(a[:len(b)])
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_BY_TAGS = re.compile(r"(?<=>)[ \t\r\n]+|[ \t\r\n]+(?=<)")


def same_text(text: str) -> str:
    """`text` without the whitespace after a ">" or before a "<": a tool call's markup (DeepSeek-V4's
    DSML, GLM's XML) and the JSON of its non-string values leave it free, the grammar lets a model
    write some of it (MAX_TOOL_WHITESPACE, MAX_JSON_WHITESPACE), and a chat format renders the
    call again canonically; so an earlier call rendered again is the same text as the one the
    model wrote. (Whitespace by "<" or ">" in a reply's own text is compared the same way on both
    sides, and a client would have to edit just that for two texts to meet here.)"""
    return _BY_TAGS.sub("", text)


def _runs(ids: Seq[int], control: frozenset[int]):
    """(is control, ids) runs of `ids`: each control id alone, the text between them together."""
    run: list[int] = []
    for i in ids:
        if i in control:
            if run:
                yield False, run
                run = []
            yield True, [i]
        else:
            run.append(i)
    if run:
        yield False, run


# ---- what the engine calls (engine.py) ----------------------------------------------------------

def conversation_store(model: Any, max_tokens: int, decode_graphs: bool) -> TranscriptStore | None:
    """The engine's store, or None: off (0 tokens), no tokenizer to compare text with, or a decode
    path that a replay one token a call would not reproduce (graph decode's own step; speculative
    decoding's verify rows are decode rows, so its outputs replay to the same bits)."""
    if not max_tokens or model.tokenizer is None or decode_graphs:
        return None
    return TranscriptStore(model.tokenizer, max_tokens)


def continue_conversation(engine: Any, prompt: Any) -> tuple[Any, Spans]:
    """The prompt as the continuation of a conversation the engine produced, with its decode spans
    (`TranscriptStore.align`); unchanged, with none, when it continues none or the engine keeps none."""
    if engine.transcripts is None or engine._replicas is not None:
        return prompt, ()
    return engine.transcripts.align(prompt.tolist() if hasattr(prompt, "tolist") else prompt)


def record_conversation(engine: Any, seq: Any) -> None:
    """Keep a request that ended by a stop or its length as a conversation, and its last state in
    the prefix cache: the state after the prompt and every output token but the last."""
    store = engine.transcripts
    if store is None or seq.ghost or seq.finish_reason not in ("stop", "length") or not seq.output:
        return
    if seq.state is None or seq.state.pos != len(seq.prompt) + len(seq.output) - 1:
        return
    t = store.record(seq.prompt, seq.decode_spans, seq.output)
    if engine.prefix_cache is not None and seq.params.prompt_logprobs is None:
        engine.prefix_cache.insert_tail(t.ids[:-1], t.spans, seq.state.snapshot())

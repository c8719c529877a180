"""Structured output: constrain sampling to a JSON schema, any JSON object, a regex, a list of
choices or an EBNF grammar. xgrammar does the grammar work; this module adapts it to kvfold's
tokenizers, caches what is costly to build, and follows one sequence (`GrammarMatcher`).

    compiled = compile_grammar(GrammarSpec("json_schema", schema), tokenizer, model_vocab_size)
    matcher = GrammarMatcher(compiled)  # per sequence; then per step: mask_, sample, accept

xgrammar is an optional dependency (`pip install 'kvfold[structured]'`), imported on first use:
`import kvfold` and unconstrained requests never pay its ~3 s import.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..tokenizer import BYTE_EOS_ID, ByteTokenizer, HFTokenizer

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "tool_calls")
# kvfold's chat families -> xgrammar's built-in structural tags of their tool-call syntax
TOOL_CALL_FORMATS = {"deepseek_v4": "deepseek_v4", "glm": "glm_4_7"}
COMPILED_CACHE_SIZE = 64  # compiled grammars kept; a server sees a few schemas again and again
# Whitespace allowed between JSON tokens: unbounded, a weak model can loop on "\n" forever; 32
# still fits JSON pretty-printed 15 levels deep at indent 2.
MAX_JSON_WHITESPACE = 32
MAX_TOOL_WHITESPACE = 2  # between the parts of a tool call, whose syntax puts at most a newline there


class GrammarError(InvalidRequestError):
    """An invalid schema / regex / grammar, refused before any work. `.param` names the request
    field to blame (None when the caller gave none)."""


class GrammarUnavailableError(GrammarError):
    """Structured output was asked for, but xgrammar is not installed."""


class GrammarViolationError(ValueError):
    """`accept` got a token the grammar forbids: the caller sampled without `mask_`."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarUnavailableError("structured output needs the xgrammar package: "
                                      "pip install 'kvfold[structured]' (or pip install xgrammar)") from None
    return xgrammar


# ---- what to constrain to ---------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """What the output must match. `value`: None (json_object), a dict or JSON-text schema
    (json_schema), a regex string (regex), a non-empty list of strings (choice), EBNF text with
    a `root` rule (ebnf), or {"family", "tools", "tool_choice"} (tool_calls: the output must be
    one or more calls in the family's own syntax, "required", or a call of the one named tool,
    "forced"; built from xgrammar's structural tag of that syntax). Malformed values are
    refused here, at construction. Equality and hashing go by `key`, so equal specs share one
    compiled grammar."""

    kind: str
    value: Any = None
    param: str | None = field(default=None, repr=False)  # the request field errors blame
    key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.kind, self._canonical_value()))

    def _canonical_value(self) -> str | tuple[str, ...] | None:
        """A hashable form of `value`. Schema keys keep their order: xgrammar emits properties in
        schema order, so a reordered schema is another grammar."""
        kind, value = self.kind, self.value
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}", self.param)
        if kind == "json_object":
            if value is not None:
                raise GrammarError("a json_object grammar takes no value", self.param)
            return None
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise GrammarError("choice takes a non-empty list of strings", self.param)
            return tuple(value)
        if kind == "tool_calls":
            ok = isinstance(value, dict) and value.get("family") in TOOL_CALL_FORMATS and \
                value.get("tool_choice") in ("required", "forced") and isinstance(value.get("tools"), list) and \
                value["tools"]
            if not ok:
                raise GrammarError("tool_calls takes {family, tools, tool_choice: required|forced}", self.param)
            return json.dumps(value, ensure_ascii=False, sort_keys=True)
        if kind == "json_schema":
            try:
                schema = json.loads(value) if isinstance(value, str) else value
                if isinstance(schema, dict):
                    return json.dumps(schema, ensure_ascii=False)
            except (TypeError, ValueError) as exc:  # not JSON text, or not JSON-serializable
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}", self.param) from None
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}", self.param)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"a {kind} grammar takes a non-empty string", self.param)
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GrammarSpec) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def from_response_format(cls, response_format: Any) -> GrammarSpec | None:
        """The spec of an OpenAI `response_format`; None for {"type": "text"} (unconstrained)."""
        def fail(what: str) -> GrammarError:
            return GrammarError(f"response_format {what}", "response_format")

        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", None, param="response_format")
        if kind != "json_schema":
            raise fail(f'must be an object whose type is "text", "json_object" or "json_schema", '
                       f'got {response_format!r:.200}')
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise fail('of type "json_schema" needs a "json_schema" object')
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise fail('json_schema needs a "name" string')
        if not isinstance(spec.get("schema"), dict):
            raise fail('json_schema needs a "schema" object')
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise fail(f'json_schema "strict" must be a boolean, got {spec["strict"]!r}')
        return cls("json_schema", spec["schema"], param="response_format")


# ---- compiling ----------------------------------------------------------------------------------

_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def _length_bounds_as_patterns(node: Any) -> Any:
    """Work around xgrammar 0.2.9 (mlc-ai/xgrammar#800): minLength/maxLength compile to a rule
    that admits raw control characters (invalid JSON) and no escapes, while the `pattern` path
    keeps strings valid JSON. So a length-bounded string without a pattern gets the pattern
    ^.{min,max}$, which xgrammar counts in characters, as JSON Schema does."""
    if isinstance(node, list):
        return [_length_bounds_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else _length_bounds_as_patterns(v) for k, v in node.items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    lo, hi = (out.get(k) if type(out.get(k)) is int else None for k in ("minLength", "maxLength"))
    if "string" in types and "pattern" not in out and (lo, hi) != (None, None):
        out.pop("minLength", None), out.pop("maxLength", None)  # beside a pattern xgrammar ignores them
        out["pattern"] = f"^.{{{lo or 0},{'' if hi is None else hi}}}$"
    return out


def _build_grammar(xgr, spec: GrammarSpec):
    """The tokenizer-independent xgrammar.Grammar of `spec`; cheap, so a bad spec is refused
    before the slow per-tokenizer setup."""
    try:
        if spec.kind in ("json_object", "json_schema"):
            # xgrammar's strict_mode (vLLM keeps it too): an object that declares properties takes
            # no others; one that declares none, as {"type": "object"}, takes any
            schema = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.key[1])
            return xgr.Grammar.from_json_schema(_length_bounds_as_patterns(schema),
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "tool_calls":  # reasoning, if any, is over: the matcher starts after it
            v = spec.value
            tools, choice = v["tools"], v["tool_choice"]
            if choice == "forced":  # xgrammar names the forced tool OpenAI's way
                choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
            tag = xgr.get_model_structural_tag(TOOL_CALL_FORMATS[v["family"]], tools=tools, tool_choice=choice,
                                               reasoning="disabled", parallel_tool_calls=v.get("parallel", True),
                                               max_whitespace_cnt=MAX_TOOL_WHITESPACE)
            return xgr.Grammar.from_structural_tag(tag)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":  # a JSON string literal is also an EBNF one (\" \\ \n \uXXXX)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.value))
        return xgr.Grammar.from_ebnf(spec.value)
    except RuntimeError as exc:  # every xgrammar parse error; drop its "[time] file.cc:line: " prefix
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {message}", spec.param) from None
    except (UnicodeError, RecursionError, ValueError, TypeError) as exc:
        # what else client text can make xgrammar raise: an error message it cannot decode (seen
        # for EBNF holding non-ASCII), a schema nested past the stack; still the client's input
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: xgrammar could not read it "
                           f"({type(exc).__name__})", spec.param) from None


def _encoded_vocab(tokenizer) -> tuple[list[bytes | str], str]:
    """Token strings by id, and xgrammar's VocabType name for them.

    "" marks a token xgrammar must never allow (its rule for special tokens): BOS, and a
    tokenizer.json's special tokens, whose text `decode` drops; letting the grammar spell "<s>"
    with one would lose that text from the output. The EOS ids become the stop tokens."""
    if isinstance(tokenizer, ByteTokenizer):  # ids 0..255 are the bytes themselves: RAW
        return [bytes((b,)) for b in range(256)] + [""] * (BYTE_EOS_ID + 1 - 256), "RAW"
    if not isinstance(tokenizer, HFTokenizer):
        raise GrammarError(f"structured output supports ByteTokenizer and HFTokenizer, not {type(tokenizer).__name__}")
    hf = tokenizer.backend
    vocab = hf.get_vocab(with_added_tokens=True)
    encoded: list[bytes | str] = [""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    for token_id, added in hf.get_added_tokens_decoder().items():
        if added.special:
            encoded[token_id] = ""
    # Read off the decoder, as xgrammar does: ByteLevel means GPT-2 byte-to-unicode tokens ("Ġ"
    # for space); ByteFallback "▁" for space plus <0xHH> byte pieces, which xgrammar's
    # BYTE_FALLBACK also decodes for a Metaspace decoder alone (xgrammar would say RAW: "▁" kept).
    decoder = json.loads(hf.to_str()).get("decoder") or {}
    steps = decoder.get("decoders") or [] if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in types:
        return encoded, "BYTE_LEVEL"
    return encoded, "BYTE_FALLBACK" if types & {"ByteFallback", "Metaspace"} else "RAW"


@dataclass(frozen=True, eq=False)
class _Vocab:
    """One tokenizer at one model vocab_size: xgrammar's compiler for it, and each token's first
    and last byte (-1: no bytes) for the UTF-8 guard of `GrammarMatcher.mask_`."""

    compiler: Any  # xgrammar.GrammarCompiler
    stop_ids: tuple[int, ...]
    first_byte: torch.Tensor  # int16 [vocab_size]
    last_byte: list[int]


_serials = itertools.count()  # cache keys for tokenizers: unlike id(), never reused
_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (serial, {vocab_size: _Vocab})
_compiled: OrderedDict[tuple, CompiledGrammar] = OrderedDict()  # LRU, newest last


def _vocab(xgr, tokenizer, vocab_size: int) -> tuple[int, _Vocab]:
    """The cached setup of (tokenizer, vocab_size): building a TokenizerInfo walks the whole vocab."""
    with _lock:
        if tokenizer not in _tokenizers:
            _tokenizers[tokenizer] = (next(_serials), {})
        serial, vocabs = _tokenizers[tokenizer]
        if vocab_size not in vocabs:
            encoded, vocab_type = _encoded_vocab(tokenizer)
            if len(encoded) > vocab_size:
                raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(encoded)} ids")
            stop_ids = tuple(sorted(set(tokenizer.eos_ids)))
            info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                                     stop_token_ids=list(stop_ids))
            # xgrammar's own cache is unbounded: ours is the LRU. Threads: as many as torch may use.
            compiler = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads(), cache_enabled=False)
            decoded = info.decoded_vocab + [b""] * (vocab_size - len(encoded))
            vocabs[vocab_size] = _Vocab(compiler, stop_ids, torch.tensor([t[0] if t else -1 for t in decoded],
                                                                         dtype=torch.int16),
                                        [t[-1] if t else -1 for t in decoded])
        return serial, vocabs[vocab_size]


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer and model vocab_size; many matchers share it."""

    spec: GrammarSpec
    vocab_size: int  # the model's: the width of the logits the mask covers
    vocab: _Vocab
    xgr_compiled: Any  # xgrammar.CompiledGrammar


def compile_grammar(spec: GrammarSpec, tokenizer, vocab_size: int) -> CompiledGrammar:
    """`spec` compiled for `tokenizer` and logits `vocab_size` wide (ids past the tokenizer's
    are padding, never allowed). GrammarError for a bad spec, before any other work. Cached in
    an LRU of COMPILED_CACHE_SIZE per (tokenizer, vocab_size, spec)."""
    if not isinstance(spec, GrammarSpec):
        raise TypeError(f"compile_grammar takes a GrammarSpec, got {type(spec).__name__}")
    xgr = _xgrammar()
    with _lock:
        known = _tokenizers.get(tokenizer)
        key = known and (known[0], vocab_size, spec)
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    grammar = _build_grammar(xgr, spec)
    serial, vocab = _vocab(xgr, tokenizer, vocab_size)
    key = (serial, vocab_size, spec)
    compiled = CompiledGrammar(spec, vocab_size, vocab, vocab.compiler.compile_grammar(grammar))
    with _lock:
        _compiled[key] = compiled
        while len(_compiled) > COMPILED_CACHE_SIZE:
            _compiled.popitem(last=False)
    return compiled


def request_grammar(spec: GrammarSpec | CompiledGrammar | None, tokenizer, vocab_size: int) -> CompiledGrammar | None:
    """The compiled grammar of a request's `grammar` (GrammarError if invalid): a GrammarSpec
    compiled here, or one already compiled for this vocabulary (the server does that off the
    engine's thread); None for none."""
    if spec is None:
        return None
    if tokenizer is None:
        raise InvalidRequestError("structured output needs a tokenizer; this model has none", param="grammar")
    if isinstance(spec, CompiledGrammar):
        if spec.vocab_size != vocab_size:
            raise InvalidRequestError(f"grammar compiled for vocab_size {spec.vocab_size}, not this model's "
                                      f"{vocab_size}", param="grammar")
        return spec
    return compile_grammar(spec, tokenizer, vocab_size)


def clear_caches() -> None:
    """Forget every compiled grammar and tokenizer setup (tests; after reinstalling xgrammar)."""
    with _lock:
        _tokenizers.clear()
        _compiled.clear()


# ---- per-sequence matching ---------------------------------------------------------------------

# After these lead bytes xgrammar 0.2.9 lets any continuation byte through, so a byte-level vocab
# could spell an overlong form (E0 80, F0 80) or a surrogate (ED A0), which decodes to U+FFFD.
_SECOND_BYTE_RANGE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF)}


_SPARSE_PATH_MIN_VOCAB = 8192  # below it xgrammar's kernel is as fast as `GrammarMatcher._apply`'s other path


def _keep_only(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Set every logit but those of `ids` to -inf, in place."""
    ids = ids.to(logits.device)
    kept = logits[ids]
    logits.fill_(float("-inf"))[ids] = kept
    return logits


class GrammarMatcher:
    """One sequence's place in its grammar: masks the next token's logits, follows the tokens
    kept. `start_after` (e.g. the ids of "</think>") holds the grammar back until those ids have
    been generated, so a reasoning model thinks freely, then answers in the format.
    `max_rollback` bounds one `rollback`, as a state's max_rewind bounds one rewind."""

    def __init__(self, compiled: CompiledGrammar, *, start_after: Sequence[int] = (), max_rollback: int = 16) -> None:
        xgr = _xgrammar()
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self._compiled, self._vocab, self.max_rollback = compiled, compiled.vocab, max_rollback
        # no stop id to accept at the end: let the grammar end on its own
        self._xgr = xgr.GrammarMatcher(compiled.xgr_compiled, terminate_without_stop_token=not compiled.vocab.stop_ids)
        self._bitmask = xgr.allocate_token_bitmask(1, compiled.vocab_size)
        self._apply_bitmask = xgr.apply_token_bitmask_inplace
        self._start_after = tuple(int(t) for t in start_after)
        self._accepted: list[int] = []  # every id accepted: rollback may have to find start_after again
        self._grammar_from: int | None = None if self._start_after else 0  # index of the first constrained id

    @property
    def started(self) -> bool:
        """Whether the grammar applies to the next token (start_after has been generated)."""
        return self._grammar_from is not None

    @property
    def terminated(self) -> bool:
        """The grammar has reached its end: it accepted a stop token."""
        return self._xgr.is_terminated()

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set to -inf, in place, the logits of every token the grammar forbids next; returns
        `logits`. A no-op before start_after; once terminated only the stop tokens stay."""
        if logits.dim() != 1 or logits.shape[0] != self._compiled.vocab_size:
            raise ValueError(f"mask_ takes 1-D logits of the grammar's vocab_size {self._compiled.vocab_size}, "
                             f"got shape {tuple(logits.shape)}")
        if not self.started:
            return logits
        if self.terminated:
            return _keep_only(logits, torch.tensor(self._vocab.stop_ids, dtype=torch.long))
        self._xgr.fill_next_token_bitmask(self._bitmask)
        self._apply(logits)
        last = self._accepted[-1] if len(self._accepted) > self._grammar_from else None  # constrained ids only
        second = _SECOND_BYTE_RANGE.get(self._vocab.last_byte[last]) if last is not None else None
        if second is not None:
            first = self._vocab.first_byte
            logits.masked_fill_(((first < second[0]) | (first > second[1])).to(logits.device), float("-inf"))
        return logits

    def _apply(self, logits: torch.Tensor) -> None:
        """-inf where the bitmask has a 0. xgrammar's CPU kernel writes the forbidden logits one by
        one: ~1 ms over a 128k vocab when few tokens are allowed, as at most JSON positions, where
        clearing the row and restoring the allowed few takes a tenth of that."""
        vocab_size = self._compiled.vocab_size
        if logits.device.type == "cpu" and vocab_size >= _SPARSE_PATH_MIN_VOCAB and sys.byteorder == "little":
            words = self._bitmask[0].numpy()
            nonzero = np.flatnonzero(words)  # unpack only words with an allowed token in them
            # on a little-endian host bit j of word w is bit j % 8 of its byte j // 8
            bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32).view(np.bool_)
            if np.count_nonzero(bits) * 2 < vocab_size:
                ids = (nonzero[:, None] * 32 + np.arange(32))[bits]
                _keep_only(logits, torch.from_numpy(ids[ids < vocab_size]))  # bits past the vocab: not ids
                return
        # xgrammar's CPU kernel takes float32/bf16/fp16 only; its torch kernel takes the rest
        native = logits.device.type == "cpu" and logits.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        self._apply_bitmask(logits, self._bitmask[0].to(logits.device, non_blocking=True),
                            vocab_size=vocab_size, backend="torch_native" if native else "auto")

    def allowed_ids(self) -> torch.Tensor:
        """The ids `mask_` would leave, ascending (int64, CPU)."""
        return torch.nonzero(self.mask_(torch.zeros(self._compiled.vocab_size)) == 0).flatten()

    def accept(self, token: int) -> None:
        """Move past `token`, the id just kept. GrammarViolationError (nothing changes) if the
        grammar forbids it."""
        token = int(token)
        if self.started:
            if self.terminated:
                raise GrammarViolationError(f"token {token} came after the grammar terminated (accepted a stop token)")
            # the range check first: for an id out of range xgrammar also logs a warning to stderr
            if not (0 <= token < self._compiled.vocab_size and self._xgr.accept_token(token)):
                raise GrammarViolationError(f"token {token} is not allowed by the grammar here; "
                                            "sample from logits passed through mask_")
        self._accepted.append(token)
        k = len(self._start_after)
        if not self.started and tuple(self._accepted[-k:]) == self._start_after:
            self._grammar_from = len(self._accepted)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted ids (a rejected speculative draft), those accepted before
        the grammar started included: undoing part of start_after holds the grammar back again."""
        if not 0 <= n <= min(self.max_rollback, len(self._accepted)):
            raise ValueError(f"rollback({n}) must undo between 0 and min(max_rollback={self.max_rollback}, "
                             f"accepted={len(self._accepted)}) tokens")
        keep = len(self._accepted) - n
        if self._grammar_from is not None:
            if len(self._accepted) > max(keep, self._grammar_from):
                self._xgr.rollback(len(self._accepted) - max(keep, self._grammar_from))
            if keep < self._grammar_from:
                self._grammar_from = None
        del self._accepted[keep:]

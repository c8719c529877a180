"""Tokenizers: a built-in byte-level one for the tiny model, and a wrapper around `tokenizer.json`.

Both share one interface: `encode(text)`, `encode_text(text)` (no added token recognized: for
text that must not become a control token), `control_tokens()`, `decode(ids)`, `bos_id`,
`eos_id`, `eos_ids`, `vocab_size` and `stream_decoder()`. A stream decoder takes generated ids one at a time
(`push`) and returns only the text they completed, so a CLI can print as tokens arrive
without ever printing half a UTF-8 character; `flush()` returns whatever is left.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol, Sequence

from .errors import ConfigError, InvalidInputError

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_MIN_VOCAB = 258
_REPLACEMENT = "\ufffd"


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Add one id; return the text it completed (possibly empty)."""
        ...

    def flush(self) -> str:
        """Return any text still held back (an incomplete sequence decodes to U+FFFD)."""
        ...


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]:
        """Like `encode`, but no text becomes an added (control) token's id."""
        ...

    def control_tokens(self) -> tuple[str, ...]:
        """The texts `encode` maps to added tokens' ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


def utf8(text: str) -> bytes:
    """text as UTF-8, or InvalidInputError where it holds a lone surrogate (no UTF-8 form)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"text holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, "
                                f"which has no UTF-8 form; send valid Unicode text") from None


# --- byte-level ---------------------------------------------------------------------------


class ByteStreamDecoder:
    """Incremental UTF-8 decoding of byte ids; ids >= 256 (specials) produce no text."""

    def __init__(self) -> None:
        # The codec keeps the bytes of an unfinished character between calls.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._utf8.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    """Ids 0..255 are raw UTF-8 bytes; 256 is BOS, 257 is EOS; any higher id is unused padding."""

    def __init__(self, vocab_size: int = BYTE_MIN_VOCAB) -> None:
        if vocab_size < BYTE_MIN_VOCAB:
            raise ConfigError(
                f"a byte tokenizer needs vocab_size >= {BYTE_MIN_VOCAB}, got {vocab_size}; "
                "provide a tokenizer.json next to config.json"
            )
        self.vocab_size = vocab_size
        self.bos_id: int | None = BYTE_BOS_ID
        self.eos_id: int | None = BYTE_EOS_ID
        self.eos_ids: tuple[int, ...] = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text)  # no text maps to BOS or EOS: every text is plain

    def control_tokens(self) -> tuple[str, ...]:
        return ()

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()


# --- tokenizer.json -----------------------------------------------------------------------


class HFStreamDecoder:
    """Re-decodes all ids pushed so far and emits the new suffix.

    Decoding the whole list (not token by token) keeps merges such as leading-space
    markers and byte fallback right; text ending in U+FFFD is held back because the
    next token may complete that character.
    """

    def __init__(self, tokenizer: "HFTokenizer") -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of the full decode already returned

    def _new_text(self, final: bool) -> str:
        text = self._tok.decode(self._ids)
        if not final and text.endswith(_REPLACEMENT):
            return ""
        new = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return new

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._new_text(final=False)

    def flush(self) -> str:
        return self._new_text(final=True)


def _id_list(ids: int | Sequence[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(int(i) for i in ids)


class HFTokenizer:
    """`tokenizers.Tokenizer` loaded from `<model_dir>/tokenizer.json`; BOS/EOS come from the model config."""

    def __init__(
        self,
        model_dir: str | Path,
        bos_id: int | None,
        eos_id: int | Sequence[int] | None,
        vocab_size: int | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _HFTok  # imported here: only needed for real checkpoints

        path = Path(model_dir) / "tokenizer.json"
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise ConfigError(f"cannot load {path}: {exc}") from exc
        n = self._tok.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and n > vocab_size:
            raise ConfigError(
                f"{path} has {n} tokens but config.json vocab_size is {vocab_size}; "
                "the tokenizer does not belong to this model"
            )
        self.vocab_size = vocab_size if vocab_size is not None else n
        self.bos_id = bos_id
        self.eos_ids = _id_list(eos_id)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self._plain = None  # `encode_text`'s tokenizer, built on first use

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself, for code that needs its vocabulary and decoder
        (structured output builds its token table from them)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        # BOS is the caller's choice (the CLI prepends `bos_id`), so no template specials here.
        utf8(text)  # a text that is not valid Unicode is refused before the tokenizer sees it
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids with no added token recognized: "<think>" in it is "<", "think", ">", not the
        one id `encode` gives (chat formats encode message contents so: kvfold.chat.content)."""
        utf8(text)
        if self._plain is None:
            # the same tokenizer less its added tokens (their ids lie outside the model's vocabulary
            # or are strings byte-level BPE never forms, so the text between them encodes alike)
            spec = json.loads(self._tok.to_str())
            spec["added_tokens"] = []
            self._plain = type(self._tok).from_str(json.dumps(spec))
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def control_tokens(self) -> tuple[str, ...]:
        """The text of every added token, special or not: each is one id wherever `encode` meets it."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values())

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)


def load_tokenizer(
    model_dir: str | Path | None,
    bos_id: int | None,
    eos_id: int | Sequence[int] | None,
    vocab_size: int,
) -> HFTokenizer | ByteTokenizer:
    """`tokenizer.json` in `model_dir` if present, else the byte tokenizer when the vocab fits it."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir, bos_id, eos_id, vocab_size)
    if vocab_size >= BYTE_MIN_VOCAB:
        return ByteTokenizer(vocab_size)
    where = f"in {model_dir}" if model_dir is not None else "(no model directory given)"
    raise ConfigError(
        f"no tokenizer.json {where}, and vocab_size {vocab_size} is too small for the built-in "
        f"byte tokenizer (needs >= {BYTE_MIN_VOCAB}); a tokenizer.json is needed"
    )

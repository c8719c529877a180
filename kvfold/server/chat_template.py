"""Chat messages -> prompt ids: the checkpoint's own template when it ships one, else a plain one.

The checkpoint's template is `chat_template` in `tokenizer_config.json`, rendered with jinja2
in a sandbox the way transformers does (`add_generation_prompt=True`, `bos_token`,
`eos_token`); it writes its own special tokens as text, which the tokenizer maps back to ids.
Without one, kvfold uses this plain template, BOS id first:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

PLAIN_TEMPLATE = "<|{role}|>\n{content}\n"
PLAIN_GENERATION_PROMPT = "<|assistant|>\n"


def _token_text(v: Any) -> str:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None = None, special: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.source = template
        self.special = special or {}
        self._compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(template)

    @classmethod
    def for_model(cls, tokenizer: Any, model_dir: str | Path | None) -> "ChatTemplate":
        """The template of `model_dir/tokenizer_config.json` when it has one, else the plain one."""
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text(encoding="utf-8"))
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
                return cls(tokenizer, template, special)
        return cls(tokenizer)

    def text(self, messages: Sequence[dict[str, str]]) -> str:
        """The rendered text of `messages` ([{"role", "content"}]), ending where the assistant replies
        (without the plain template's BOS, which `render` adds as an id)."""
        if self._compiled is not None:
            return self._compiled.render(messages=list(messages), add_generation_prompt=True, **self.special)
        return "".join(PLAIN_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + \
            PLAIN_GENERATION_PROMPT

    def render(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids for `messages`: `text`, encoded."""
        return self.ids(self.text(messages))

    def ids(self, text: str) -> list[int]:
        """A rendered text's ids (the plain template's start with BOS)."""
        tok = self.tokenizer
        if self._compiled is not None:
            return tok.encode(text)
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)

    @staticmethod
    def opens_reasoning(text: str) -> bool:
        """Whether a rendered prompt leaves the reply inside a reasoning block (ends in "<think>")."""
        return text.rstrip().endswith("<think>")

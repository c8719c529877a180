"""Chat messages -> prompt ids, in the model's own chat format, and which output syntax it reads
back (`family`: how its reasoning and tool calls look, for `kvfold.chat.parsers`).

Three kinds:
- the checkpoint's own template, `chat_template` in `tokenizer_config.json` (GLM-5.3 ships one),
  rendered with jinja2 in a sandbox the way transformers' `apply_chat_template` does
  (`messages`, `tools`, `add_generation_prompt=True`, the special tokens, and the request's
  `chat_template_kwargs`); assistant tool-call arguments are handed over as objects, as vLLM
  does, since templates iterate them. It writes its own special tokens as text, which the
  tokenizer maps back to ids;
- DeepSeek-V4, whose release ships no Jinja template but a Python encoder: kvfold's own
  implementation of it (`kvfold.chat.dsv4_encoding`);
- otherwise (the built-in tiny model) a plain template, BOS id first, with no tool syntax:

      <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

Whatever the kind, a marker inside the request's own strings (a tool result holding "</think>" or
"<｜User｜>") is encoded as text, never as the control token the template writes
(`kvfold.chat.content`); chat_template_kwargs {"allow_control_tokens_in_content": true} restores
the release's behaviour, which encodes the whole rendered string.
"""
from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from .content import ContentGuard
from .dsv4_encoding import encode_chat, opens_reasoning, reasoning_mode
from ..errors import InvalidRequestError

PLAIN_TEMPLATE = "<|{role}|>\n{content}\n"
PLAIN_GENERATION_PROMPT = "<|assistant|>\n"
FAMILY_OF_MODEL = {"glm5_next": "glm", "deepseek_v4": "deepseek_v4"}  # registry family -> output syntax
# chat_template_kwargs option: encode markers in message contents as control tokens (the release's
# and transformers' behaviour); off by default, so text from users and tools stays text
ALLOW_CONTROL_TOKENS = "allow_control_tokens_in_content"


def raw_placeholder() -> str:
    """A string standing for token ids in a message's text (`ChatTemplate.prompt`'s `raw`):
    private-use characters no marker holds, and a nonce no request can guess."""
    return f"\ue002{secrets.token_hex(12)}\ue003"


class Prompt(NamedTuple):
    text: str  # as the model reads it
    ids: list[int]
    opens_reasoning: bool  # the reply starts inside a reasoning block (the text ends in "<think>")


def _token_text(v: Any) -> str:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


class ChatTemplateError(InvalidRequestError):
    """Messages (or options) this chat format cannot express; `param` names the field."""


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None = None, special: dict[str, str] | None = None,
                 family: str = "plain"):
        """`template`: Jinja source (None: the plain template); `family`: the output syntax the
        model writes ("deepseek_v4", "glm" or "plain"), which the server parses."""
        self.tokenizer = tokenizer
        self.source = template
        self.special = special or {}
        self.family = family
        self.kind = "jinja" if template is not None else "plain"
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
    def deepseek_v4(cls, tokenizer: Any) -> "ChatTemplate":
        """The DeepSeek-V4 release's encoding (kvfold's own implementation of it)."""
        t = cls(tokenizer, family="deepseek_v4")
        t.kind = "deepseek_v4"
        return t

    @classmethod
    def for_model(cls, tokenizer: Any, model_dir: str | Path | None, model_family: str | None = None) -> "ChatTemplate":
        """The template of `model_dir/tokenizer_config.json` when it has one; else, for a
        DeepSeek-V4 checkpoint, the release encoding; else the plain one. `model_family`: the
        registry's family name (models/registry.py), which sets the output syntax."""
        family = FAMILY_OF_MODEL.get(model_family or "", "plain")
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text(encoding="utf-8"))
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
                return cls(tokenizer, template, special, family)
        if model_dir is not None and family == "deepseek_v4":
            return cls.deepseek_v4(tokenizer)
        return cls(tokenizer)

    def prompt(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
               options: dict[str, Any] | None = None, raw: dict[str, list[int]] | None = None) -> Prompt:
        """`messages` rendered and encoded. Markers (added tokens' text) in any string of the
        request stay text (`kvfold.chat.content`) unless options[ALLOW_CONTROL_TOKENS] is True,
        which encodes the rendered string whole, as the release and transformers do.
        `raw`: placeholder string -> token ids: wherever the format wrote a placeholder (put in a
        message's text by the caller; private-use characters and a random nonce, see
        `raw_placeholder`), the prompt holds those ids verbatim, the text on either side encoded
        on its own (as the tokenizer encodes text between markers)."""
        rendered, guard = self._render(messages, tools, options)
        encode = guard.encode if guard is not None else self.tokenizer.encode
        if raw:
            pieces = re.split("(" + "|".join(re.escape(k) for k in raw) + ")", rendered)
            ids = [i for k, piece in enumerate(pieces)
                   for i in (raw[piece] if k % 2 else encode(piece) if piece else [])]
            rendered = "".join(self.tokenizer.decode(raw[p]) if k % 2 else p for k, p in enumerate(pieces))
        else:
            ids = encode(rendered)
        if self.kind == "plain" and self.tokenizer.bos_id is not None:
            ids = [self.tokenizer.bos_id] + ids
        text = guard.restore(rendered) if guard is not None else rendered
        return Prompt(text, ids, opens_reasoning(text))

    def text(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
             options: dict[str, Any] | None = None) -> str:
        """The rendered text of OpenAI-shaped `messages` (content already one string), ending
        where the assistant replies (without the plain template's BOS, which `ids` adds).
        `options`: the request's chat_template_kwargs, plus `reasoning_effort` and
        `response_format` when it set them."""
        rendered, guard = self._render(messages, tools, options)
        return guard.restore(rendered) if guard is not None else rendered

    def _render(self, messages, tools, options) -> tuple[str, ContentGuard | None]:
        """The rendered text, from escaped strings unless the options allow control tokens in
        content, and the guard that escaped them (None: nothing was)."""
        options = dict(options or {})
        allow = options.pop(ALLOW_CONTROL_TOKENS, False)
        if not isinstance(allow, bool):
            raise ChatTemplateError(f"chat_template_kwargs.{ALLOW_CONTROL_TOKENS} must be a boolean",
                                    "chat_template_kwargs")
        guard = None if allow else ContentGuard.of(self.tokenizer)
        if guard is not None:
            messages = [guard.escape_message(m) if isinstance(m, dict) else m for m in messages]
            tools, options = guard.escape(tools), {k: guard.escape(v) for k, v in options.items()}
        if self.kind == "deepseek_v4":
            thinking = options.pop("thinking", options.pop("enable_thinking", None))
            if thinking is not None and not isinstance(thinking, bool):
                raise ChatTemplateError("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
            thinking, effort = reasoning_mode(options.pop("reasoning_effort", None), thinking)
            return encode_chat(list(messages), tools=tools, thinking=thinking, reasoning_effort=effort,
                               response_format=options.pop("response_format", None)), guard
        if self.kind == "jinja":
            options.pop("response_format", None)  # a Jinja template has no place for it; the grammar holds it
            return self._compiled.render(messages=[_with_argument_objects(m) for m in messages], tools=tools or None,
                                         add_generation_prompt=True, **{**self.special, **options}), guard
        return self._plain(messages, tools, options), guard

    @staticmethod
    def _plain(messages: Sequence[dict[str, Any]], tools, options) -> str:
        """The plain template: roles and contents only, so anything else is refused, not dropped."""
        if tools:
            raise ChatTemplateError("this model's chat format has no tool syntax (plain template)", "tools")
        for i, m in enumerate(messages):
            extra = [k for k in ("tool_calls", "tool_call_id", "reasoning_content") if k in m]
            if extra:
                raise ChatTemplateError(f"the plain chat template cannot show {extra[0]}", f"messages.{i}.{extra[0]}")
        unused = [k for k in options if k != "response_format"]
        if unused:
            raise ChatTemplateError(f"the plain chat template takes no {unused[0]}",
                                    unused[0] if unused[0] == "reasoning_effort" else "chat_template_kwargs")
        return "".join(PLAIN_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + \
            PLAIN_GENERATION_PROMPT

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
               options: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids for `messages` (`prompt`'s)."""
        return self.prompt(messages, tools, options).ids

    def ids(self, text: str) -> list[int]:
        """A rendered text's ids, every marker in it a control id (the plain template's start with
        BOS). For a request's messages use `prompt`, which keeps their markers text."""
        tok = self.tokenizer
        if self.kind != "plain":
            return tok.encode(text)
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)

    # whether a rendered prompt leaves the reply inside a reasoning block (it ends in "<think>")
    opens_reasoning = staticmethod(opens_reasoning)


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' arguments are objects (templates iterate them), not JSON text."""
    if "tool_calls" not in message:
        return message
    calls = []
    for c in message["tool_calls"]:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = c["function"]["arguments"]  # not JSON: the template gets the text as it came
        calls.append({**c, "function": {**c["function"], "arguments": args}})
    return {**message, "tool_calls": calls}

"""Structured output through `kvfold serve`, with the real clients: OpenAI's `response_format`
(and the openai client's `parse`), vLLM's `structured_outputs` / `guided_*`, and langchain's
`with_structured_output`. Even the random tiny model's output must parse and validate."""
import json
import sys
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

import kvfold
from kvfold.decoding import grammar
from kvfold.server.app import create_app
from kvfold.chat.template import ChatTemplate

from helpers import serving

MSGS = [{"role": "user", "content": "Describe a cat as JSON."}]
MAX_TOKENS = 400  # room for the longest output the bounded schemas below allow

SCHEMAS = {
    "nested_objects": {"type": "object", "properties": {
        "cat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 30}},
                "required": ["name", "age"], "additionalProperties": False}},
        "required": ["cat"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"mood": {"enum": ["calm", "grumpy", "asleep"]},
                                               "color": {"type": "string", "enum": ["black", "white"]}},
              "required": ["mood", "color"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"weight": {"type": "number", "minimum": 0, "maximum": 20},
                                                 "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["weight", "lives"], "additionalProperties": False},
    "required_fields": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                         "ok": {"type": "boolean"}, "note": {"type": "null"}},
                        "required": ["id", "ok", "note"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def url(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=1024, max_running=8)
    with serving(create_app(engine, model_name="tiny-random")) as u:
        yield u


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def json_schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(url, name):
    c = client(url)
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=MAX_TOKENS, temperature=temperature,
                                      seed=seed, response_format=json_schema_format(name, SCHEMAS[name]))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_gives_a_json_object_for_each_of_n_choices(url):
    # a bias toward '"' and '}' makes the random model close its strings and objects soon
    r = client(url).chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=MAX_TOKENS, temperature=1.0,
                                            seed=5, n=3, response_format={"type": "json_object"},
                                            logit_bias={str(ord('"')): 6, str(ord("}")): 6})
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) > 1
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_vllms_structured_outputs_and_guided_fields(url):
    c = client(url)
    r = c.completions.create(model="tiny-random", prompt="The answer:", max_tokens=20, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert r.choices[0].text.count("-") == 1 and len(r.choices[0].text) == 6 and r.choices[0].text[:3].isdigit()
    r = c.completions.create(model="tiny-random", prompt="Pick:", max_tokens=20, temperature=1.0, seed=4,
                             extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny-random", prompt="x", max_tokens=4,
                             extra_body={"guided_regex": "a+", "guided_choice": ["a"]})
    assert e.value.response.json()["error"]["param"] == "guided_choice"


class Cat(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    mood: Literal["calm", "grumpy"]
    lives: int = pydantic.Field(ge=1, le=9)


def test_openai_parse_returns_the_pydantic_object(url):
    r = client(url).chat.completions.parse(model="tiny-random", messages=MSGS, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format=Cat)
    cat = r.choices[0].message.parsed
    assert isinstance(cat, Cat) and 1 <= cat.lives <= 9


def test_langchain_with_structured_output(url):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model="tiny-random", base_url=url + "/v1", api_key="none", temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0)
    cat = llm.with_structured_output(Cat, method="json_schema").invoke("Describe a cat.")
    assert isinstance(cat, Cat)
    as_dict = llm.with_structured_output(Cat.model_json_schema(), method="json_schema").invoke("A cat.")
    assert isinstance(as_dict, dict) and Cat.model_validate(as_dict)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema"},
    {"type": "xml"},
])
def test_an_invalid_response_format_is_a_400_before_any_work(url, fmt):
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=4, response_format=fmt)
    assert e.value.response.json()["error"]["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny-random", prompt="x", max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    assert e.value.response.json()["error"]["param"] == "guided_regex"


def test_the_mask_applies_after_the_reasoning_ends(tiny):
    """The grammar binds only what follows the end of the reasoning (vLLM #41132 masked the
    reasoning too). In the engine: with `grammar_after` = a token the free output reaches at its
    4th step, the first 4 tokens are the unconstrained ones and the rest validates."""
    prompt = [tiny.tokenizer.bos_id] + tiny.tokenizer.encode("Think first.")
    free = kvfold.generate(tiny, prompt, 8, stop_ids=[]).tokens
    end = free[3]
    k = free.index(end)  # the first time the free output emits it
    engine = kvfold.Engine(tiny, max_seq_len=1024)
    spec = grammar.GrammarSpec("json_schema", SCHEMAS["enums"])
    (c,) = engine.generate([prompt], kvfold.SamplingParams(max_tokens=MAX_TOKENS, grammar=spec, grammar_after=[end]))
    assert c.token_ids[:k + 1] == free[:k + 1] and c.finish_reason == "stop"
    jsonschema.validate(json.loads(tiny.tokenizer.decode(c.token_ids[k + 1:])), SCHEMAS["enums"])


def test_a_template_that_opens_reasoning_leaves_the_reasoning_unmasked(tiny):
    """Served with a template whose generation prompt ends in "<think>", a json_schema request's
    first tokens are the model's free choice (the random model never closes its reasoning),
    not the '{' the grammar would force."""
    template = ChatTemplate(tiny.tokenizer, "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>")
    engine = kvfold.Engine(tiny, max_seq_len=1024)
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enums"]}}
    with serving(create_app(engine, model_name="tiny-random", chat_template=template)) as u:
        kw = dict(model="tiny-random", messages=MSGS, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        free = client(u).chat.completions.create(**kw).choices[0].token_ids
        bound = client(u).chat.completions.create(response_format=fmt, **kw).choices[0].token_ids
    assert bound == free and tiny.tokenizer.decode(free)[:1] != "{"
    plain = ChatTemplate(tiny.tokenizer)  # the default template opens no reasoning: there the mask binds at once
    assert template.opens_reasoning(template.text(MSGS)) and not plain.opens_reasoning(plain.text(MSGS))


def test_without_xgrammar_structured_output_is_a_clear_400(url, monkeypatch):
    grammar.clear_caches()
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=4,
                                                response_format={"type": "json_object"})
        err = e.value.response.json()["error"]
        assert "xgrammar" in err["message"] and err["param"] == "response_format"
    finally:
        monkeypatch.undo()
        grammar.clear_caches()

"""`kvfold serve` refuses what it cannot honour and never answers 5xx to a client's input: options
kvfold lacks, unknown fields, wrong JSON types, malformed bodies and HTTP-level misuse get a 4xx
naming the field, and the connection serves on (the real `openai` client against a live server,
as in tests/test_server.py)."""
import json
from collections import Counter

import pytest

import kvfold

from test_server import KEY, _error, client, prompt_ids, server  # noqa: F401  (server: test_server's live server)


# ---- what an OpenAI client may send: refused, never silently ignored ------------------------------

CHAT = [{"role": "user", "content": "hi"}]

REFUSED_CHAT = [  # (arguments of chat.completions.create, the param the 400 names)
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "hi"}}, "prediction"),
    ({"verbosity": "low"}, "verbosity"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"store": True}, "store"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.0.type"),
]
REFUSED_COMPLETION = [({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix")]
# other servers' extensions kvfold does not implement
UNKNOWN = [{"typical_p": 0.9}, {"use_beam_search": True}, {"mirostat_tau": 5.0}, {"max_new_tokens": 4}]


@pytest.mark.parametrize("kw,param", REFUSED_CHAT, ids=lambda v: v if isinstance(v, str) else None)
def test_chat_option_kvfold_lacks_is_refused(server, kw, param):
    c = client(server[0])
    err = _error(lambda: c.chat.completions.create(**{"model": "tiny-random", "messages": CHAT, "max_tokens": 2, **kw}))
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert err["message"].startswith(param) and "is not supported by kvfold" in err["message"], err


@pytest.mark.parametrize("kw,param", REFUSED_COMPLETION, ids=lambda v: v if isinstance(v, str) else None)
def test_completion_option_kvfold_lacks_is_refused(server, kw, param):
    c = client(server[0])
    err = _error(lambda: c.completions.create(**{"model": "tiny-random", "prompt": "hi", "max_tokens": 2, **kw}))
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert err["message"].startswith(param) and "is not supported by kvfold" in err["message"], err


def test_unknown_fields_are_refused(server):
    """Fields OpenAI does not define (other servers' extensions among them), at the top level and
    inside known objects, are 400s naming the field."""
    c = client(server[0])
    for extra in UNKNOWN:
        for call in (lambda: c.completions.create(model="tiny-random", prompt="hi", max_tokens=2, extra_body=extra),
                     lambda: c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=2, extra_body=extra)):
            err = _error(call)
            (name,) = extra
            assert (err["param"], err["code"]) == (name, "unknown_parameter")
            assert "not supported by kvfold" in err["message"]
    nested = [({"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages.0.mood"),
              ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bold": True}]}]},
               "messages.0.content.0.bold"),
              ({"stream_options": {"include_usage": True, "every": 2}, "stream": True}, "stream_options.every")]
    for kw, param in nested:
        err = _error(lambda: c.chat.completions.create(**{"model": "tiny-random", "messages": CHAT, "max_tokens": 2, **kw}))
        assert (err["param"], err["code"]) == (param, "unknown_parameter")


def test_harmless_fields_are_accepted_and_change_nothing(server, tiny):
    """Metadata, cache hints and every option at its do-nothing value: the same tokens as without them."""
    c = client(server[0])
    harmless = dict(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u-1",
                    metadata={"k": "v"}, store=False, service_tier="auto", safety_identifier="s-1",
                    prompt_cache_key="pk", prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"},
                    response_format={"type": "text"}, modalities=["text"], tools=None, tool_choice=None,
                    stream_options=None, extra_body={"return_token_ids": True})
    plain = c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    r = c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=6, temperature=0, **harmless)
    assert r.choices[0].token_ids == plain.choices[0].token_ids
    parts = [{"type": "text", "text": "h", "prompt_cache_breakpoint": {"ttl": "30m"}}, {"type": "text", "text": "i"}]
    r = c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": parts}], max_tokens=6,
                                  temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == plain.choices[0].token_ids
    r = c.completions.create(model="tiny-random", prompt="hi", max_tokens=4, temperature=0, echo=False, best_of=1,
                             suffix="", n=1, logprobs=None, user="u", extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == kvfold.generate(tiny, prompt_ids(tiny, "hi"), 4).tokens


def test_every_field_of_the_openai_client_is_declared():
    """Each request field the installed openai client knows is a deliberate kvfold decision (accepted,
    or refused as unsupported), never an 'unrecognized parameter'."""
    from openai.types import completion_create_params as legacy
    from openai.types import chat

    from kvfold.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions, TextPart
    pairs = [(chat.completion_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
             (legacy.CompletionCreateParamsBase, CompletionRequest),
             (chat.ChatCompletionStreamOptionsParam, StreamOptions),
             (chat.ChatCompletionContentPartTextParam, TextPart)]
    pairs += [(getattr(chat, f"ChatCompletion{role}MessageParam"), ChatMessage)
              for role in ("System", "Developer", "User", "Assistant", "Tool", "Function")]
    for typed_dict, model in pairs:
        missing = set(typed_dict.__annotations__) - set(model.model_fields)
        assert not missing, (typed_dict.__name__, missing)


def test_types_are_strict(server):
    c = client(server[0])
    cases = [({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"), ({"stream": "yes"}, "stream"),
             ({"stream": 1}, "stream"), ({"temperature": "0.5"}, "temperature"), ({"seed": 1.5}, "seed"),
             ({"n": "1"}, "n"), ({"top_p": True}, "top_p"), ({"stop": 5}, "stop"), ({"user": 5}, "user"),
             ({"model": 1}, "model")]
    for kw, param in cases:
        err = _error(lambda: c.completions.create(**{"model": "tiny-random", "prompt": "hi", "max_tokens": 2, **kw}))
        assert err["param"] == param, (kw, err)
        err = _error(lambda: c.chat.completions.create(**{"model": "tiny-random", "messages": CHAT, "max_tokens": 2, **kw}))
        assert err["param"] == param, (kw, err)
    for value in ("true", 1, None, [True]):
        err = _error(lambda: c.completions.create(model="tiny-random", prompt="hi", max_tokens=2,
                                                  extra_body={"return_token_ids": value}))
        assert err["param"] == "return_token_ids" and "boolean" in err["message"]
    err = _error(lambda: c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": 5}]))
    assert err["param"] == "messages.0.content"
    err = _error(lambda: c.completions.create(model="tiny-random", prompt=[1, "a"], max_tokens=2))
    assert err["param"] == "prompt" and "list of token ids" in err["message"]


def test_http_level_refusals(server):
    """A body that is not declared JSON is a 415, a wrong method a 405 with its Allow header, both in
    OpenAI's shape."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlparse(server[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        for ctype in ("text/plain", None, "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": ctype} if ctype else {})}
            conn.request("POST", "/v1/completions", body=b'{"model": "tiny-random", "prompt": "hi"}', headers=headers)
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 415 and body["error"]["code"] == "unsupported_media_type", (ctype, body)
        for method, path, allow in (("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
                                    ("POST", "/v1/models", "GET"), ("PUT", "/v1/models/tiny", "GET")):
            conn.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 405 and r.getheader("Allow") == allow, (method, path)
            assert set(body["error"]) == {"message", "type", "param", "code"}
    finally:
        conn.close()


# ---- no input is the server's error: a 4xx in OpenAI's shape, and the connection serves on --------

_SAMPLES = [None, True, 7, 2.5, "x", [], [1], {}, {"a": 1}]
_HUGE = [10 ** 30, -10 ** 30, 1e308, -1e308]  # out of every field's range, or of its type
_RAW = ["NaN", "Infinity", "-Infinity", "1e400", "1" * 5000, "[" * 100_000 + "]" * 100_000]  # JSON text


def _kind(v) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}.get(type(v), "object")


def _nested(depth: int, obj: bool):
    v = {} if obj else []
    for _ in range(depth):
        v = {"a": v} if obj else [v]
    return v


COMMON_FIELDS = {  # path -> the JSON kinds it takes; any other kind must be refused
    ("model",): {"string"}, ("max_tokens",): {"integer", "null"}, ("temperature",): {"number", "null"},
    ("top_p",): {"number", "null"}, ("seed",): {"integer", "null"}, ("stop",): {"string", "array", "null"},
    ("stop", 0): {"string"}, ("stream",): {"boolean", "null"}, ("stream_options",): {"object", "null"},
    ("stream_options", "include_usage"): {"boolean", "null"}, ("n",): {"integer", "null"},
    ("presence_penalty",): {"number", "null"}, ("frequency_penalty",): {"number", "null"},
    ("logit_bias",): {"object", "null"}, ("user",): {"string", "null"}, ("return_token_ids",): {"boolean"},
}
COMPLETION_FIELDS = {**COMMON_FIELDS, ("prompt",): {"string", "array"}, ("prompt", 0): {"string", "array", "integer"},
                     ("prompt", 0, 0): {"integer"}, ("echo",): {"boolean", "null"}, ("best_of",): {"integer", "null"},
                     ("logprobs",): {"integer", "null"}, ("suffix",): {"string", "null"}}
CHAT_FIELDS = {**COMMON_FIELDS, ("messages",): {"array"}, ("messages", 0): {"object"},
               ("messages", 0, "role"): {"string"}, ("messages", 0, "content"): {"string", "array", "null"},
               ("messages", 0, "content", 0): {"object"}, ("messages", 0, "content", 0, "type"): {"string"},
               ("messages", 0, "content", 0, "text"): {"string"}, ("messages", 0, "name"): {"null"},
               ("max_completion_tokens",): {"integer", "null"}, ("logprobs",): {"boolean", "null"},
               ("top_logprobs",): {"integer", "null"}, ("response_format",): {"object", "null"},
               ("tools",): {"array", "null"}, ("tool_choice",): {"string", "object", "null"},
               ("functions",): {"null"}, ("function_call",): {"null"},
               ("metadata",): {"object", "null"}, ("metadata", "k"): {"string"}, ("store",): {"boolean", "null"},
               ("service_tier",): {"string", "null"}, ("modalities",): {"array", "null"},
               ("reasoning_effort",): {"string", "null"}, ("prompt_cache_key",): {"string", "null"}}


def _with(base: dict, path: tuple, value):
    """A copy of `base` with `value` at `path`, making the lists and objects on the way as needed."""
    body = json.loads(json.dumps(base))
    cur = body
    for p, nxt in zip(path, path[1:]):
        want = list if isinstance(nxt, int) else dict
        if isinstance(cur, list):
            cur.extend([None] * (p + 1 - len(cur)))
        if not isinstance(cur[p] if isinstance(cur, list) else cur.get(p), want):
            cur[p] = want()
        cur = cur[p]
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    cur[path[-1]] = value
    return body


def _bad_bodies(base: dict, fields: dict) -> list[tuple[str, str | None]]:
    """(JSON text, the top-level field the 400 must name or None) for every field of `base`: values of
    every wrong kind, huge numbers, NaN/Infinity and other invalid JSON text, deep nesting, and lone
    surrogates in every text field."""
    out = []
    for path, kinds in fields.items():
        kinds = kinds | ({"integer"} if "number" in kinds else set())
        wrong = [v for v in _SAMPLES + _HUGE + [_nested(500, False), _nested(500, True)]
                 if _kind(v) not in kinds or (isinstance(v, (int, float)) and abs(v) > 1e20)]
        out += [(json.dumps(_with(base, path, v)), path[0]) for v in wrong]
        out += [(json.dumps(_with(base, path, "@RAW@")).replace('"@RAW@"', raw), None) for raw in _RAW]
        if "string" in kinds:  # a lone surrogate, as the JSON escape that writes it
            out.append((json.dumps(_with(base, path, "a\ud800b")), path[0]))
    out.append((json.dumps({**base, "\udfff": 1}), None))
    return out


BAD_TEXTS = ["", " ", "{", "}", "[", '{"model": }', "{'model': 'tiny'}", '{"model": "tiny-random"} x', "nul", "[]", "[1]",
             '"text"', "5", "null", "true", "1.5", '"\\ud800"', "\ufeff{}", "[" * 100_000]


def test_malformed_bodies_get_a_4xx_and_the_connection_serves_on(server):
    """About 1,200 malformed bodies at both generation endpoints over one keep-alive connection:
    every answer is a 4xx in OpenAI's shape (a 400 naming the field when a field is at fault), the
    server never closes the connection, and valid requests on it succeed afterwards."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlparse(server[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bases = {"/v1/completions": ({"model": "tiny-random", "prompt": "hi", "max_tokens": 2}, COMPLETION_FIELDS),
             "/v1/chat/completions": ({"model": "tiny-random", "messages": [{"role": "user", "content": [
                                           {"type": "text", "text": "hi"}]}], "max_tokens": 2}, CHAT_FIELDS)}
    sock, statuses = None, Counter()
    try:
        for path, (base, fields) in bases.items():
            bodies = _bad_bodies(base, fields) + [(t, None) for t in BAD_TEXTS]
            bodies += [(b'{"model": "\xff\xfe"}', None), (b'\xff', None)]  # not UTF-8
            for body, field in bodies:
                raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
                conn.request("POST", path, body=raw, headers=headers)
                r = conn.getresponse()
                data = r.read()
                sock = sock or conn.sock
                assert conn.sock is sock, f"the server closed the connection after {body[:200]!r}"
                assert 400 <= r.status < 500, (r.status, body[:200], data[:300])
                err = json.loads(data)["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], err
                if field is not None:
                    assert r.status != 400 or (err["param"] or "").split(".")[0] == field, (body[:200], err)
                statuses[r.status] += 1
        for path, (base, _) in bases.items():
            conn.request("POST", path, body=json.dumps(base), headers=headers)
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"] in ("stop", "length")
            assert conn.sock is sock
    finally:
        conn.close()
    assert sum(statuses.values()) > 1000 and set(statuses) == {400}, statuses


# ---- the routes and request forms clients of other servers rely on ----------------------------------

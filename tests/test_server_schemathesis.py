"""`kvfold serve` against its own OpenAPI document: schemathesis generates requests from the
document, valid ones and invalid ones, and sends them to a live server; no answer may be a 5xx,
every answer must be one the document lists, with its content type and its schema, and every
invalid request must be refused. That includes Anthropic's Messages routes (errors in Anthropic's
shape, which the document lists for them) and OpenAI's Responses routes; after each operation the
engine is idle again (no live state, nothing running or queued), and a refused POST /v1/responses
stored nothing.

Each operation runs as its own Hypothesis test over `operation.as_strategy` (30 examples per
operation and mode, derandomized: the same requests every run). Schemathesis's own pytest
integration is not used: its lazy-fixture loader touches a pytest private (`Node._nodeid`) that
pytest 9 no longer has."""

import pytest

import kvfold
from kvfold.server.app import create_app

from helpers import serving, wait_engine_idle

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance)

pytestmark = pytest.mark.slow_api

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          negative_data_rejection]
OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
              ("GET", "/v1/responses/{response_id}/input_items")]
BODIES = {p for m, p in OPERATIONS if m == "POST" and "{" not in p}  # the operations with a JSON body


@pytest.fixture(scope="module")
def live(tiny):
    # a short context: every generated request, valid or not, is cheap for the tiny model
    engine = kvfold.Engine(tiny, max_seq_len=128, max_running=4, max_queue=64)
    app = create_app(engine, model_name="tiny-random")
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def live_url(live):
    return live[0]


@pytest.fixture(scope="module")
def api_schema(live_url):
    return schemathesis.openapi.from_url(live_url + "/openapi.json")


def test_document_lists_every_route(api_schema):
    ops = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert ops == set(OPERATIONS)


CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
    [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if p in BODIES]  # the others take nothing to spoil


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_operation_holds_to_the_document(api_schema, live, method, path, mode):
    live_url, app = live
    operation = api_schema[path][method]
    store = app.state.responses

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=30, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        stored = len(store)
        response = case.call_and_validate(base_url=live_url, checks=CHECKS, timeout=60)
        if (method, path) == ("POST", "/v1/responses") and response.status_code >= 400:
            assert len(store) == stored, "a refused request stored a response"

    run()
    wait_engine_idle(app.state.engine.engine)

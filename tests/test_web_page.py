"""`kvfold serve`'s chat page (GET /, kvfold/server/web/chat.html) in a real browser: Debian's
headless Chromium driven by Selenium through the system chromedriver (never Selenium Manager's
downloads), against a live server (tests/helpers.py `serving`) of the built-in trained "tiny"
model. It rarely ends a turn on its own, so a long generation really is long when the test stops it.

Without /usr/bin/chromium and /usr/bin/chromedriver these tests fail (they never skip, and
install nothing): `apt-get install -y chromium chromium-driver` (.ci/run does that in CI)."""
import json
import os
import tempfile
import time
import urllib.error
import urllib.request

import openai
import pytest

import kvfold
from kvfold.server import add_serve_parser, build_app
from kvfold.server.app import create_app
from kvfold.server.metrics import parse as parse_metrics

from helpers import serving

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"
MODEL = "tiny"
KEY = "page-test-key"
WAIT_S = 30


@pytest.fixture(scope="module")
def model():
    return kvfold.load_model(MODEL)


@pytest.fixture(scope="module")
def server(model):
    # room for a generation that lasts seconds (the stop test), on a model that ignores nothing
    engine = kvfold.Engine(model, max_seq_len=4096, max_running=4, max_queue=16)
    with serving(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"the chat page's browser tests need Chromium and its WebDriver ({', '.join(missing)} missing); "
                    f"install them (as root) with: {INSTALL}", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: pip install -e '.[dev]'", pytrace=False)
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download (the explicit paths skip it anyway)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="kvfold-chromium-") as profile:
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()
            if offline is None:
                os.environ.pop("SE_OFFLINE", None)
            else:
                os.environ["SE_OFFLINE"] = offline


# ---- helpers ---------------------------------------------------------------------------------

def wait(driver, condition, what, timeout=WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def by_id(driver, id_):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, id_)


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def open_page(driver, url):
    """Load the page and wait until it knows the model (then it can send)."""
    driver.get(url + "/")
    wait(driver, lambda d: by_id(d, "model").text == MODEL and by_id(d, "send").is_enabled(), "page ready")


def settings(driver, temperature, max_tokens):
    for id_, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        el = by_id(driver, id_)
        el.clear()
        el.send_keys(str(value))


def say(driver, text):
    """Type a message and press Enter; returns the new answer's <article>."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    before = len(driver.find_elements(By.CSS_SELECTOR, "article.assistant"))
    by_id(driver, "message").send_keys(text, Keys.ENTER)
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "article.assistant")) > before, "answer started")
    return driver.find_elements(By.CSS_SELECTOR, "article.assistant")[-1]


def state(answer):
    return answer.get_attribute("data-state")


def finished(driver, answer, expected="done"):
    wait(driver, lambda d: state(answer) != "streaming", "answer finished")
    assert state(answer) == expected, (state(answer), answer.text)


def content(driver, answer):
    """The answer's text exactly (textContent, no whitespace normalisation) and how many pieces it came in."""
    return js(driver, "const c = arguments[0].querySelector('.content'); return [c.textContent, c.childNodes.length]",
              answer)


def metrics(url) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics") as r:
        return parse_metrics(r.read().decode())


def greedy(url, messages, max_tokens, key="unused"):
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content


# ---- tests -----------------------------------------------------------------------------------

def test_streamed_answers_are_the_greedy_ones(server, browser):
    url, d = server, browser
    open_page(d, url)
    # the inline style ran under the page's Content-Security-Policy, and nothing came from elsewhere
    assert js(d, "return getComputedStyle(document.body).marginTop") == "0px"
    assert all(u.startswith(url) for u in js(d, "return performance.getEntriesByType('resource').map(e => e.name)"))
    settings(d, 0, 24)
    question = "What does the with statement do?"
    answer = say(d, question)
    finished(d, answer)
    text, pieces = content(d, answer)
    assert text == greedy(url, [{"role": "user", "content": question}], 24)
    assert pieces > 1  # streamed: appended delta by delta
    status = by_id(d, "status").text
    assert status.startswith("24 tokens · first token ") and "tokens/s" in status and status.endswith("finish: length")

    # the second turn carries the first; Shift+Enter is a new line, not a send
    from selenium.webdriver.common.keys import Keys
    follow_up = "And a for loop?\nBriefly."
    by_id(d, "message").send_keys("And a for loop?", Keys.SHIFT, Keys.ENTER, Keys.NULL, "Briefly.")
    answer2 = say(d, "")
    finished(d, answer2)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up}]
    assert content(d, answer2)[0] == greedy(url, messages, 24)


def test_stop_cancels_the_request_on_the_server(server, browser):
    url, d = server, browser
    open_page(d, url)
    settings(d, 0, 3000)  # seconds of generation: still running when Stop is pressed
    before = metrics(url)
    answer = say(d, "Tell me about modules.")
    wait(d, lambda _: content(d, answer)[0] and metrics(url)["kvfold_running_sequences"] == 1,
         "the answer streams and its sequence runs")
    by_id(d, "stop").click()
    finished(d, answer, "stopped")
    deadline = time.monotonic() + WAIT_S
    while True:  # the engine drops the sequence between two steps once the server sees the connection close
        m = metrics(url)
        if m["kvfold_running_sequences"] == 0 and m["kvfold_queue_depth"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["kvfold_requests_cancelled_total"] - before["kvfold_requests_cancelled_total"] == 1
    status = by_id(d, "status").text
    assert status.endswith("· stopped") and int(status.split()[0]) < 3000, status
    assert by_id(d, "send").is_enabled() and not by_id(d, "stop").is_enabled()


def test_reasoning_and_tool_calls_render(server, browser):
    """A canned stream (this model neither reasons nor calls tools): reasoning folded in a
    <details>, the call as a labelled block with its name and arguments; events split across reads."""
    url, d = server, browser
    open_page(d, url)

    def chunk(delta=None, finish=None, ids=(), usage=None):
        choices = [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                                     "token_ids": list(ids)}]
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices,
                                      **({"usage": usage} if usage else {})}) + "\n\n"
    events = "".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Let me "}, ids=[1]), chunk({"reasoning_content": "think."}, ids=[2]),
        chunk({"content": "Checking."}, ids=[3]),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}, ids=[4]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}, ids=[5]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}, finish="tool_calls", ids=[6]),
        chunk(usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}),
        "data: [DONE]\n\n"])
    pieces = [events[i:i + 37] for i in range(0, len(events), 37)]  # cut anywhere, mid-event too
    js(d, """
        const pieces = arguments[0], real = window.fetch;
        window.fetch = (resource, init) => {
          if (resource !== "/v1/chat/completions") return real(resource, init);
          const enc = new TextEncoder();
          const body = new ReadableStream({
            pull(c) { pieces.length ? c.enqueue(enc.encode(pieces.shift())) : c.close(); }});
          return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
        };""", pieces)
    answer = say(d, "Weather in Paris?")
    finished(d, answer)
    details = js(d, """const a = arguments[0], det = a.querySelector('details');
        return [det.open, det.querySelector('summary').textContent, det.querySelector('.reasoning-text').textContent,
                a.querySelector('.content').textContent, a.querySelector('.tool-call').getAttribute('aria-label'),
                a.querySelector('.tool-call .name').textContent, a.querySelector('.tool-call .args').textContent]""",
                 answer)
    assert details == [False, "Reasoning", "Let me think.", "Checking.", "Tool call", "get_weather",
                       '{"city": "Paris"}']
    assert by_id(d, "status").text.startswith("6 tokens") and by_id(d, "status").text.endswith("finish: tool_calls")


def test_api_key_is_asked_for_and_kept_in_session_storage(model, browser):
    from selenium.webdriver.common.keys import Keys
    engine = kvfold.Engine(model, max_seq_len=256, max_running=2, max_queue=4)
    with serving(create_app(engine, model_name=MODEL, api_key=KEY)) as url:
        with urllib.request.urlopen(url + "/") as r:  # the page itself needs no key
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        with pytest.raises(urllib.error.HTTPError) as e:  # the API still does
            urllib.request.urlopen(url + "/v1/models")
        assert e.value.code == 401
        d = browser
        d.get(url + "/")
        wait(d, lambda _: by_id(d, "key-form").is_displayed(), "the key form")
        assert not by_id(d, "send").is_enabled()
        by_id(d, "api-key").send_keys("wrong", Keys.ENTER)
        wait(d, lambda _: "incorrect API key" in by_id(d, "key-error").text, "the wrong key refused")
        by_id(d, "api-key").send_keys(KEY, Keys.ENTER)
        wait(d, lambda _: by_id(d, "model").text == MODEL and by_id(d, "send").is_enabled(), "page ready")
        assert not by_id(d, "key-form").is_displayed()
        assert js(d, "return [sessionStorage.getItem('kvfold.apiKey'), localStorage.length, document.cookie]") == \
            [KEY, 0, ""]
        settings(d, 0, 8)
        answer = say(d, "Hello")
        finished(d, answer)
        assert content(d, answer)[0] == greedy(url, [{"role": "user", "content": "Hello"}], 8, key=KEY)


def test_no_web_page(model):
    engine = kvfold.Engine(model, max_seq_len=256, max_running=2, max_queue=4)
    with serving(create_app(engine, model_name=MODEL, web_page=False)) as url:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/")
        assert e.value.code == 404 and json.load(e.value)["error"]["code"] == "not_found"
    # the command line: --no-web-page reaches create_app
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    base = ["serve", "--model", "tiny-random", "--max-seq-len", "64"]
    for extra, page in (([], True), (["--no-web-page"], False)):
        args = parser.parse_args(base + extra)
        assert args.web_page is page
        assert ("/" in {getattr(r, "path", None) for r in build_app(args).routes}) is page


def test_page_is_not_in_the_openapi_document(server):
    with urllib.request.urlopen(server + "/openapi.json") as r:
        assert "/" not in json.load(r)["paths"]
    with urllib.request.urlopen(server + "/") as r:
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp

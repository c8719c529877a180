"""`kvfold bench serve`: the load generator end to end on the tiny model (its own in-process
server, and a live server given by --url), its loopback-only rule, its caps and its deadline."""
from __future__ import annotations

import argparse
import json

import pytest

import kvfold
from helpers import serving
from kvfold.bench import runner as R
from kvfold.bench import serve as S
from kvfold.server.app import create_app

KEY = "bench-key"
SMALL = ["--requests", "8", "--concurrency", "4", "--prompt-tokens", "16", "--max-tokens", "4"]


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    ns = R.build_parser().parse_args(["serve", "--out", str(tmp_path / "out.json"), *extra])
    ns.command_line = "pytest"
    return ns


def _run(tmp_path, *extra: str) -> tuple[int, dict]:
    rc = R.run_bench(_args(tmp_path, *extra), log=None)
    return rc, json.loads((tmp_path / "out.json").read_text())




@pytest.fixture(scope="module")
def live(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=16, max_queue=64)
    with serving(create_app(engine, model_name="tiny-random", api_key=KEY)) as url:
        yield url


def _check_summary(res: dict, n: int, stream: bool) -> None:
    sm = res["summary"]
    assert (sm["requests"], sm["succeeded"], sm["errors"]) == (n, n, 0), sm
    assert not res["timed_out"] and sm["error_kinds"] == {}
    for k in ("duration_s", "requests_per_s", "output_tokens", "output_tokens_per_s", "prompt_tokens_per_s"):
        assert sm[k] > 0, (k, sm)
    assert sm["prompt_tokens"] == n * res["settings"]["prompt_tokens"]
    keys = ("latency_s",) + (("ttft_s", "itl_s", "tpot_s") if stream else ())
    for key in keys:
        d = sm[key]
        assert d is not None and d["count"] > 0, key
        assert 0 < d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
        assert d["min"] <= d["mean"] <= d["max"]
    if stream:
        assert sm["ttft_s"]["max"] <= sm["latency_s"]["max"]
    else:
        assert sm["ttft_s"] is None and sm["itl_s"] is None and sm["tpot_s"] is None
    for r in res["requests"]:
        assert r["ok"] and r["error"] is None and r["prompt_tokens"] == res["settings"]["prompt_tokens"]
        assert 1 <= r["output_tokens"] <= res["settings"]["max_tokens"]
        assert r["latency_s"] > 0 and r["start_s"] >= 0
        assert (0 < r["ttft_s"] <= r["latency_s"]) if stream else r["ttft_s"] is None
    assert sm["output_tokens"] == sum(r["output_tokens"] for r in res["requests"])
    if stream:  # every token after the first of a request has one inter-token latency
        assert sm["itl_s"]["count"] == sm["output_tokens"] - n
    rep = res["report"]
    assert "time to first token" in rep and "inter-token" in rep and "requests/s" in rep


def test_in_process_streamed(tmp_path):
    rc, res = _run(tmp_path, "--model", "tiny-random", "--stream", *SMALL)
    assert rc == 0
    assert res["settings"] == {**res["settings"], "requests": 8, "concurrency": 4, "prompt_tokens": 16,
                               "max_tokens": 4, "stream": True, "seed": 0, "url": None, "vocab_size": 258}
    assert res["model"] == "tiny-random" and res["server"].startswith("in-process") and res["command"] == "pytest"
    _check_summary(res, 8, stream=True)


def test_url_not_streamed_with_key(tmp_path, live):
    rc, res = _run(tmp_path, "--url", live, "--model", "tiny-random", "--api-key", KEY, *SMALL)
    assert rc == 0 and res["settings"]["url"] == live and res["server"].startswith(live)
    _check_summary(res, 8, stream=False)


def test_url_wrong_key_is_a_clear_error(tmp_path, live):
    with pytest.raises(S.BenchServeError, match="401|models"):
        R.run_bench(_args(tmp_path, "--url", live + "/v1", "--api-key", "wrong", *SMALL), log=None)


def test_deadline_counts_unfinished_requests_as_errors(tmp_path, live):
    # far more work than fits in the deadline: the run stops at it and says so
    rc, res = _run(tmp_path, "--url", live, "--model", "tiny-random", "--api-key", KEY, "--stream", "--requests", "200", "--concurrency", "2",
                   "--prompt-tokens", "8", "--max-tokens", "64", "--warmup", "0", "--timeout", "1.5")
    sm = res["summary"]
    assert rc == 1 and res["timed_out"]
    assert sm["requests"] == 200 and sm["errors"] > 0 and sm["succeeded"] + sm["errors"] == 200
    assert any("unfinished" in e for e in sm["error_kinds"])
    assert sm["duration_s"] < 5


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://127.0.0.1.example.com:80",
                                 "http://0.0.0.0:8000", "http://[::2]:8000", "http://192.168.1.1", "ftp://127.0.0.1",
                                 "127.0.0.1:8000", "http://", "http://127.0.0.1:99999"])
def test_non_loopback_url_refused(tmp_path, url):
    with pytest.raises(S.BenchServeError):
        S.check_loopback_url(url)
    with pytest.raises(SystemExit):
        _args(tmp_path, "--url", url)
    ns = _args(tmp_path)
    ns.url = url  # a Namespace not built by the parser is checked again, before anything runs
    with pytest.raises(S.BenchServeError):
        R.run_bench(ns, log=None)
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("url, base", [("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
                                       ("http://127.8.9.10/v1/", "http://127.8.9.10/v1"),
                                       ("http://[::1]:8000", "http://[::1]:8000/v1"),
                                       ("https://LOCALHOST:1", "https://LOCALHOST:1/v1"),
                                       ("http://[::ffff:127.0.0.1]:80", "http://[::ffff:127.0.0.1]:80/v1")])
def test_loopback_urls_accepted(url, base):
    assert S.check_loopback_url(url) == base


def test_cli_refuses_non_loopback_with_exit_2(capsys):
    from kvfold.cli import main
    with pytest.raises(SystemExit) as e:  # at parse time
        main(["bench", "serve", "--url", "http://8.8.8.8:80"])
    assert e.value.code == 2
    assert "only loads servers on this machine" in capsys.readouterr().err


@pytest.mark.parametrize("opt, value", [("--requests", "10001"), ("--requests", "0"), ("--concurrency", "257"),
                                        ("--concurrency", "0"), ("--prompt-tokens", "40000"),
                                        ("--max-tokens", "9000"), ("--timeout", "0"), ("--timeout", "3601"),
                                        ("--warmup", "17")])
def test_caps_enforced(tmp_path, opt, value):
    with pytest.raises(SystemExit):
        _args(tmp_path, opt, value)


@pytest.mark.parametrize("name, value", [("requests", S.MAX_REQUESTS + 1), ("concurrency", S.MAX_CONCURRENCY + 1),
                                         ("max_tokens", 0), ("timeout", S.MAX_TIMEOUT_S * 2)])
def test_caps_enforced_on_namespaces(tmp_path, name, value):
    ns = _args(tmp_path)
    setattr(ns, name, value)
    with pytest.raises(S.BenchServeError):
        R.run_bench(ns, log=None)


def test_without_openai_stops_with_how_to_install(tmp_path, monkeypatch, capsys):
    import sys

    from kvfold.bench.deps import MissingPackageError
    from kvfold.cli import main
    monkeypatch.setitem(sys.modules, "openai", None)  # what an uninstalled package looks like to import
    assert main(["bench", "serve", *SMALL, "--out", str(tmp_path / "out.json")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: kvfold bench serve needs the openai package: pip install 'kvfold[bench]'")
    with pytest.raises(MissingPackageError):  # before the server starts or any request is sent
        R.run_bench(_args(tmp_path, "--url", "http://127.0.0.1:9", *SMALL), log=None)
    assert not (tmp_path / "out.json").exists()


def test_plain_bench_parsing_unchanged():
    from kvfold.cli import _build_parser
    a = _build_parser().parse_args(["bench", "--config", "medium", "--contexts", "512", "--out", "x.json"])
    assert a.command == "bench" and a.mode is None and a.config == "medium" and a.out == "x.json"
    b = _build_parser().parse_args(["bench", "serve", "--concurrency", "8", "--requests", "64", "--prompt-tokens",
                                    "64", "--max-tokens", "32", "--stream", "--api-key", "k", "--out", "r.json"])
    assert (b.command, b.mode, b.concurrency, b.requests, b.prompt_tokens, b.max_tokens, b.stream, b.api_key,
            b.out, b.url, b.model) == ("bench", "serve", 8, 64, 64, 32, True, "k", "r.json", None, "tiny")


def test_prompts_and_percentiles():
    p = S.make_prompts(3, 5, 258, seed=7)
    assert p == S.make_prompts(3, 5, 258, seed=7) and p != S.make_prompts(3, 5, 258, seed=8)
    assert len(p) == 3 and all(len(x) == 5 and all(0 <= t < 258 for t in x) for x in p)
    assert S.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert S.percentile([5.0], 99) == 5.0
    assert S.percentile([float(i) for i in range(101)], 90) == pytest.approx(90.0)
    assert S.distribution([]) is None

"""`kvfold serve`'s start-up banner: its text for the tiny model (a pure function of the parsed
arguments and the engine), and that run_serve prints it once to stderr before uvicorn starts,
unless --quiet."""
from __future__ import annotations

import pytest

from kvfold import cli
from kvfold.server import base_url, build_engine, run_serve, startup_banner


def serve_args(*extra: str):
    return cli._build_parser().parse_args(["serve", *extra])


@pytest.fixture(scope="module")
def tiny():
    args = serve_args("--model", "tiny", "--threads", "1")
    return args, build_engine(args)


def test_the_banner_of_the_tiny_model(tiny):
    args, engine = tiny
    text = startup_banner(args, engine)
    lines = text.splitlines()
    assert lines[0] == "kvfold serve: tiny as 'tiny' (deepseek_v4)"
    weights_mib = engine.model.weight_bytes() / (1 << 20)
    assert f"  weights:      dequant, {weights_mib:.2f} MiB in memory" in lines
    assert "  device:       cpu, float32, 1 thread, batch-invariant " + ("on" if engine.batch_invariant else "off") in lines
    pool = engine.pages
    assert f"{pool.nbytes / (1 << 20):.2f} MiB page pool reserved now ({pool.num_pages} pages of 128 tokens)" in text
    assert f"a 4096-token sequence takes up to {engine.state_bytes(4096) / (1 << 20):.2f} MiB, 16 at once" in text
    assert "  prefix cache: 256.00 MiB in memory, blocks of 128 tokens" in lines
    assert "  page:         http://127.0.0.1:8000/" in lines and "  API:          http://127.0.0.1:8000/v1" in lines
    assert text.endswith("\n") and text == startup_banner(args, engine)  # pure: the same text again


def test_the_banner_follows_the_settings(tiny):
    _, engine = tiny
    args = serve_args("--model", "tiny", "--threads", "3", "--host", "0.0.0.0", "--port", "9001",
                      "--served-model-name", "docs", "--no-web-page")
    text = startup_banner(args, engine)
    assert text.startswith("kvfold serve: tiny as 'docs' (deepseek_v4)\n") and "3 threads" in text
    assert "page:         off" in text and "API:          http://0.0.0.0:9001/v1" in text


def test_private_pools_no_prefix_cache_and_a_port_picked_by_the_system():
    args = serve_args("--model", "tiny-random", "--kv-page-bytes", "0", "--prefix-cache-bytes", "0",
                      "--port", "0", "--max-seq-len", "256", "--max-running", "2")
    text = startup_banner(args, build_engine(args))
    assert "kvfold serve: tiny-random as 'tiny-random' (deepseek_v4)" in text
    assert "state:        private per-sequence pools, allocated per request; a 256-token sequence" in text
    assert "2 at once" in text and "prefix cache: off (--prefix-cache-bytes 0)" in text
    assert "http://127.0.0.1:0/v1 (port 0: the system picks one; uvicorn logs it)" in text


def test_urls_put_ipv6_addresses_in_brackets():
    assert base_url("::1", 8000) == "http://[::1]:8000" and base_url("localhost", 80) == "http://localhost:80"


@pytest.mark.parametrize("quiet", [False, True])
def test_run_serve_prints_it_once_before_uvicorn_unless_quiet(quiet, tiny, monkeypatch, capsys):
    import uvicorn

    import kvfold.server as server
    seen = []
    monkeypatch.setattr(server, "build_engine", lambda args: tiny[1])  # the model is loaded once per module
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # keep this test process's threads
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(capsys.readouterr().err))
    args = serve_args("--model", "tiny", "--threads", "1", *(["--quiet"] if quiet else []))
    assert run_serve(args) == 0
    assert len(seen) == 1  # uvicorn started once, with the banner already out (or not, quiet)
    if quiet:
        assert "kvfold serve:" not in seen[0]
    else:
        assert seen[0].count("kvfold serve: tiny as 'tiny'") == 1 and "http://127.0.0.1:8000/v1" in seen[0]

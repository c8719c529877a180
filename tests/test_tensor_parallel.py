"""Tensor and expert parallelism on torch.distributed (gloo, CPU; kvfold/parallel): DeepSeek-V4
sharded over 2 and 4 ranks gives the logits of one process within 1e-5 (prefill, chunked prefill,
decode), the same greedy tokens, replicated state bit-identical on every rank, and snapshots that
restore across layouts. Ranks are spawned processes (not forked), each test with its own group
and a timeout, so a hang fails the test instead of stalling CI."""
import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfold
from kvfold.models.deepseek_v4.checkpoint import save_checkpoint
from kvfold.models.deepseek_v4.model import Dsv4Model
from kvfold.models.deepseek_v4.mtp import MtpModule
from kvfold.models.deepseek_v4.tiny import init_random_, tiny_config
from helpers import fp32_paths_bound, random_ids

TIMEOUT_S = 240  # a whole spawned group, startup included; the group's own collective timeout is 60 s
HANG_TIMEOUT_S = 5  # the collective timeout of the hang test
PROMPT = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny DeepSeek-V4 with 4 output groups (so 1, 2 and 4 ranks divide heads, groups and experts)."""
    cfg = tiny_config(o_groups=4)
    model = Dsv4Model(cfg)
    model.mtp = MtpModule(cfg, model.dtype, model.device)
    init_random_(model, 7)
    return save_checkpoint(model, tmp_path_factory.mktemp("tp_ckpt"))


def scenario(model, ids):
    """What every layout runs: prefill, chunked prefill, decode, greedy generation."""
    st = model.new_state(capacity=80, max_rewind=4)
    full = model.forward(ids[:PROMPT], st)
    chunked_st = model.new_state(capacity=80)
    chunked = torch.cat([model.forward(ids[:17], chunked_st), model.forward(ids[17:PROMPT], chunked_st)])
    decode = torch.cat([model.forward(ids[PROMPT + i:PROMPT + i + 1], st) for i in range(5)])
    tokens = kvfold.generate(model, ids[:PROMPT].tolist(), 12, stop_ids=[]).tokens
    spec = [kvfold.generate(model, ids[:PROMPT].tolist(), 12, stop_ids=[], speculative=kind, num_draft=2).tokens
            for kind in ("mtp", "ngram")]
    return dict(full=full, chunked=chunked, decode=decode), tokens, spec, st


def _worker(rank: int, size: int, ckpt: str, out: str, mode: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=size,
                            timeout=timedelta(seconds=HANG_TIMEOUT_S if mode == "hang" else 60))
    try:
        if mode == "die":  # both ends of the mesh connected first: else rank 0's own join may fail instead
            dist.barrier()
        if mode == "die" and rank == 1:
            os._exit(3)  # a rank that dies before the model's first collective
        if mode == "hang" and rank == 1:
            import time
            time.sleep(TIMEOUT_S)  # a rank that hangs: alive, never joining the collective
            return
        model = kvfold.load_model(ckpt, tp=size)
        ids = random_ids(60, model.config.vocab_size, seed=3)
        if mode in ("die", "hang"):
            import time
            t0 = time.monotonic()
            try:
                model.forward(ids[:5], model.new_state(capacity=8))
                result = "no error"
            except kvfold.KvfoldError as exc:
                result = f"{type(exc).__name__}: {exc}"
            Path(out, f"{mode}.json").write_text(json.dumps([result, time.monotonic() - t0]))
            return
        attn, moe = model.model.layers[2].self_attn, model.model.layers[2].mlp
        if mode == "glm":
            st0 = model.new_state(capacity=8)
            Path(out, f"shard{rank}.json").write_text(json.dumps(dict(
                kda=model.kda_heads, rec=list(st0.layers[0].rec.shape), mla=model.model.layers[1].self_attn.nh,
                experts=model.model.layers[1].mlp.experts.gate_up_proj.shape[0])))
            st0.free()
        if mode == "run":  # (DeepSeek-V4's attribute names)
            Path(out, f"shard{rank}.json").write_text(json.dumps(dict(
                params=sum(p.numel() for p in model.parameters()), heads=attn.n_heads,
                q_b=attn.q_b_proj.weight.shape[0],
                experts=moe.experts.gate_up_proj.shape[0], first=moe.experts.first,
                shared=moe.shared_experts is not None)))
        logits, tokens, spec, st = scenario(model, ids)
        save_file(logits, f"{out}/logits{rank}.safetensors")
        Path(out, f"state{rank}.bin").write_bytes(st.snapshot())
        Path(out, f"tokens{rank}.json").write_text(json.dumps([tokens, spec]))
        blob = Path(out, "tp1.bin").read_bytes()  # a TP = 1 snapshot, continued here
        other = model.new_state(capacity=80, max_rewind=4)
        other.restore(blob)
        save_file({"cont": model.forward(ids[PROMPT + 5:PROMPT + 8], other)}, f"{out}/cont{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def run_group(size: int, ckpt: Path, out: Path, mode: str = "run", target=None) -> list[int]:
    """Spawn `size` ranks of `target` (default `_worker` in `mode`); their exit codes (the test fails
    if the group outlives TIMEOUT_S)."""
    ctx = multiprocessing.get_context("spawn")
    extra = (mode,) if target is None else ()
    procs = [ctx.Process(target=target or _worker, args=(r, size, str(ckpt), str(out), *extra)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} ranks still running after {TIMEOUT_S} s"
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def reference(ckpt):
    model = kvfold.load_model(ckpt)
    ids = random_ids(60, model.config.vocab_size, seed=3)
    logits, tokens, spec, st = scenario(model, ids)
    assert spec == [tokens, tokens]  # drafts change nothing (tests/test_speculative.py)
    return model, ids, logits, tokens, st.snapshot()


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_logits_tokens_state_and_snapshots_match_one_process(ckpt, reference, tmp_path, size):
    model, ids, want, tokens, blob = reference
    (tmp_path / "tp1.bin").write_bytes(blob)
    assert run_group(size, ckpt, tmp_path) == [0] * size
    cfg, full = model.config, sum(p.numel() for p in model.parameters())
    for r in range(size):  # each rank holds its heads and experts only, the shared expert on rank 0
        shard = json.loads((tmp_path / f"shard{r}.json").read_text())
        assert shard["heads"] == cfg.num_attention_heads // size and shard["q_b"] == shard["heads"] * cfg.head_dim
        assert shard["experts"] == cfg.n_routed_experts // size and shard["first"] == r * shard["experts"]
        assert shard["shared"] == (r == 0) and shard["params"] < full
    layers = cfg.num_hidden_layers
    for r in range(size):  # the heads' and experts' partial sums add in another order: two fp32 paths
        got = load_file(str(tmp_path / f"logits{r}.safetensors"))
        for k, w in want.items():
            assert (got[k] - w).abs().max().item() < fp32_paths_bound(w, layers), (r, k)
        assert json.loads((tmp_path / f"tokens{r}.json").read_text()) == [tokens, [tokens, tokens]]
    # the replicated state (all of V4's: K = V, compressors, indexers) holds the same bits on every rank
    states = [(tmp_path / f"state{r}.bin").read_bytes() for r in range(size)]
    assert all(s == states[0] for s in states)
    # and the blob is layout-free: TP = size's restores at TP = 1 and continues as TP = 1 does
    here = model.new_state(capacity=80, max_rewind=4)
    here.restore(states[0])
    mine = model.new_state(capacity=80, max_rewind=4)
    mine.restore(blob)
    cont_here = model.forward(ids[PROMPT + 5:PROMPT + 8], here)
    bound = fp32_paths_bound(cont_here, layers)  # states written under TP and TP = 1: two fp32 paths
    assert (cont_here - model.forward(ids[PROMPT + 5:PROMPT + 8], mine)).abs().max().item() < bound
    for r in range(size):  # TP = 1's restores at TP = size
        got = load_file(str(tmp_path / f"cont{r}.safetensors"))["cont"]
        assert (got - cont_here).abs().max().item() < bound


def test_a_dead_rank_ends_the_group_with_a_clear_error(ckpt, tmp_path):
    codes = run_group(2, ckpt, tmp_path, mode="die")
    assert codes[1] == 3
    msg, _ = json.loads((tmp_path / "die.json").read_text())
    assert msg.startswith("TensorParallelError") and "rank 0 of 2" in msg


def test_a_hung_rank_ends_the_group_within_the_timeout(ckpt, tmp_path):
    """A peer that stays alive but never joins: rank 0's first collective fails after the group's
    timeout (HANG_TIMEOUT_S here) with a TensorParallelError, instead of waiting forever."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, str(ckpt), str(tmp_path), "hang")) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(TIMEOUT_S)
    for p in procs[1:]:
        p.kill()
    assert procs[0].exitcode == 0
    msg, seconds = json.loads((tmp_path / "hang.json").read_text())
    assert msg.startswith("TensorParallelError") and seconds < 4 * HANG_TIMEOUT_S


def test_a_config_that_does_not_divide_is_refused_before_loading(ckpt):
    with pytest.raises(kvfold.ConfigError, match=r"tp=3 does not divide .*needs tp in \[1, 2, 4\]"):
        kvfold.load_model(ckpt, tp=3)
    with pytest.raises(kvfold.ConfigError, match="process group"):  # divides, but no group was started
        kvfold.load_model(ckpt, tp=2)


def test_torchrun_generate_with_tp_prints_what_one_process_prints(tmp_path):
    """`torchrun --nproc-per-node 2 -m kvfold generate --model tiny --tp 2`: the trained built-in
    model sharded over two ranks; rank 0 prints the text one process prints."""
    import shutil
    import subprocess
    import sys
    args = ["generate", "--model", "tiny", "--prompt", "The with statement is used to", "--max-new-tokens", "16"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "kvfold", *args], capture_output=True, text=True, env=env,
                         timeout=TIMEOUT_S)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    two = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "kvfold", *args, "--tp", "2"],
                         capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    text = lambda out: out.split("[kvfold] prompt")[0]  # noqa: E731  (the summary line's speeds differ)
    assert text(two.stdout) == text(one.stdout) and len(text(one.stdout)) > 20
    assert two.stdout.count("[kvfold] prompt") == 1  # one rank wrote


LONG = " ".join(f"Entry {i}: a context manager defines __enter__ and __exit__." for i in range(24))
QUERIES = [dict(prompt="The with statement is used to", max_tokens=12, temperature=0),
           dict(prompt=LONG, max_tokens=6, temperature=0),
           dict(prompt=LONG + " The", max_tokens=6, temperature=0),  # a prefix-cache hit
           dict(prompt="Return the", max_tokens=8, n=2, temperature=0.9, seed=5),
           # no seed: rank 0 draws it for every rank; past EOS, so it always makes its 8 tokens
           dict(prompt="x", max_tokens=8, temperature=0.8, extra_body={"ignore_eos": True})]


def ask(url):
    import openai
    c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
    out = []
    for q in QUERIES:
        r = c.completions.create(model="tiny", **q)
        out.append([[ch.text for ch in r.choices], r.usage.completion_tokens,
                    r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0])
    try:
        c.completions.create(model="tiny", prompt="x", max_tokens=10 ** 6)
        out.append("no error")
    except openai.BadRequestError as exc:
        out.append([exc.status_code, exc.body["type"]])
    return out


def _serve_worker(rank: int, size: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist
    from kvfold import Engine
    from kvfold.server.app import create_app
    from helpers import serving
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        engine = Engine(kvfold.load_model(ckpt, tp=size), max_seq_len=512, max_running=4)
        if rank != 0:
            engine.follow()  # until rank 0's app shuts down
            Path(out, f"followed{rank}.json").write_text(json.dumps(engine.metrics()["generation_tokens"]))
            return
        with serving(create_app(engine, model_name="tiny", api_key="k")) as url:
            Path(out, "answers.json").write_text(json.dumps(ask(url)))
        Path(out, "served.json").write_text(json.dumps(engine.metrics()["generation_tokens"]))
    finally:
        dist.destroy_process_group()


def test_kvfold_serve_under_tp_answers_the_openai_client_as_one_process(tmp_path):
    """Rank 0 serves HTTP and schedules, rank 1 follows: greedy, sampled (seeded and not), n = 2 and
    prefix-cache answers equal a one-process server's; a bad request keeps OpenAI's error shape; at
    shutdown the follower stops with the same token count."""
    from kvfold import Engine
    from kvfold.server.app import create_app
    from helpers import serving
    from kvfold.models.registry import TINY_DIR as ckpt
    assert run_group(2, ckpt, tmp_path, target=_serve_worker) == [0, 0]
    got = json.loads((tmp_path / "answers.json").read_text())
    with serving(create_app(Engine(kvfold.load_model(ckpt), max_seq_len=512, max_running=4), model_name="tiny",
                            api_key="k")) as url:
        want = ask(url)
    # every answer but the unseeded one (its seed is drawn per server) is the one-process answer
    assert got[:4] == want[:4] and got[5] == want[5] == [400, "invalid_request_error"]
    assert got[2][2] > 0  # the prefix-cache hit under tp
    assert got[4][1] == 8 and len(got[3][0]) == 2
    assert json.loads((tmp_path / "served.json").read_text()) == json.loads((tmp_path / "followed1.json").read_text())



@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory):
    """A tiny GLM-5.3 with 4 KDA heads, 4 MLA heads and 4 experts (so 2 and 4 ranks divide), and
    its MTP layer."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    from test_glm5_mtp import PREFIX, hf_mtp_layer
    from test_glm5_next import TEXT, VISION, _randomize
    torch.manual_seed(0)
    text = dict(TEXT, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=VISION))
    _randomize(hf)
    d = tmp_path_factory.mktemp("tp_glm")
    hf.save_pretrained(d)
    layer = hf_mtp_layer(hf.config.text_config)
    _randomize(layer, seed=1)
    save_file({PREFIX + k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()},
              d / "mtp.safetensors")
    return d


@pytest.mark.parametrize("size", [2, 4])
def test_glm5_sharded_by_heads_with_its_kda_state_matches_one_process(glm_ckpt, tmp_path, size):
    """GLM-5.3 at TP = 2 and 4: KDA and MLA heads and routed experts split, the KDA state with its
    heads; logits within fp32 rounding of one process (helpers.fp32_paths_bound: the heads' and
    experts' partial sums add in another order), the same greedy tokens with and without drafting, and
    a snapshot gathered into the whole layer's layout: equal on every rank, restorable at TP = 1,
    and a TP = 1 snapshot restores under TP."""
    d, model = glm_ckpt, kvfold.load_model(glm_ckpt)
    ids = random_ids(60, model.config.vocab_size, seed=3)
    want, tokens, spec, st = scenario(model, ids)
    assert spec == [tokens, tokens]
    (tmp_path / "tp1.bin").write_bytes(st.snapshot())
    assert run_group(size, d, tmp_path, mode="glm") == [0] * size
    cfg = model.config
    for r in range(size):
        got = load_file(str(tmp_path / f"logits{r}.safetensors"))
        for k, w in want.items():
            assert (got[k] - w).abs().max().item() < fp32_paths_bound(w, cfg.num_hidden_layers), (r, k)
        assert json.loads((tmp_path / f"tokens{r}.json").read_text()) == [tokens, [tokens, tokens]]
    for r in range(size):  # each rank holds its share of the heads (and their KDA state) and experts
        shard = json.loads((tmp_path / f"shard{r}.json").read_text())
        assert shard["kda"] == cfg.linear_num_heads // size and shard["rec"][0] == shard["kda"]
        assert shard["mla"] == cfg.num_attention_heads // size and shard["experts"] == cfg.n_routed_experts // size
    states = [(tmp_path / f"state{r}.bin").read_bytes() for r in range(size)]
    assert all(x == states[0] for x in states)
    here, mine = model.new_state(capacity=80, max_rewind=4), model.new_state(capacity=80, max_rewind=4)
    here.restore(states[0])
    mine.restore((tmp_path / "tp1.bin").read_bytes())
    cont = model.forward(ids[PROMPT + 5:PROMPT + 8], here)
    bound = fp32_paths_bound(cont, cfg.num_hidden_layers)  # states written under TP and TP = 1
    assert (cont - model.forward(ids[PROMPT + 5:PROMPT + 8], mine)).abs().max().item() < bound
    for r in range(size):
        assert (load_file(str(tmp_path / f"cont{r}.safetensors"))["cont"] - cont).abs().max().item() < bound


def _engine_worker(rank: int, size: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist
    from kvfold import Engine, SamplingParams
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        engine = Engine(kvfold.load_model(ckpt, tp=size), max_seq_len=300, speculative="mtp", num_draft=2)
        if rank != 0:
            engine.follow()
            return
        got = []
        for batch in ENGINE_PROMPTS:  # the second batch hits the prefix cache
            got += [c.token_ids for c in engine.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True))]
        m = engine.metrics()
        Path(out, "engine.json").write_text(json.dumps([got, m["prefix_cache_hits"], m["spec_draft_tokens"]]))
        engine.stop_followers()
    finally:
        dist.destroy_process_group()


_P = random_ids(150, 96, seed=8).tolist()
ENGINE_PROMPTS = [[_P[:140], _P[:9]], [_P[:135] + [1, 2]]]


def test_glm5_engine_under_tp_follows_rank_0(glm_ckpt, tmp_path):
    """The engine over a GLM-5.3 shard at TP = 2 (rank 0 schedules, rank 1 follows), with MTP
    speculation and a prefix-cache hit (latent pages by reference, the gathered KDA state and
    indexer rows from the snapshot): the tokens of a one-process engine."""
    from kvfold import Engine, SamplingParams
    assert run_group(2, glm_ckpt, tmp_path, target=_engine_worker) == [0, 0]
    got, hits, drafted = json.loads((tmp_path / "engine.json").read_text())
    engine = Engine(kvfold.load_model(glm_ckpt), max_seq_len=300, speculative="mtp", num_draft=2)
    want = []
    for batch in ENGINE_PROMPTS:
        want += [c.token_ids for c in engine.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert got == want and hits == engine.metrics()["prefix_cache_hits"] == 1 and drafted > 0

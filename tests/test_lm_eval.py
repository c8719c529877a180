"""lm-evaluation-harness (`lm_eval`, `--model local-completions`) against a live `kvfold serve`:
a multiple-choice task written here (no download) is scored through /v1/completions with
`echo` + `logprobs` (prompt logprobs), and every log-likelihood lm-eval reports must equal the
model's own: the sum of log_softmax(model.forward(prompt ids)) over the continuation's tokens,
up to fp32 rounding (`helpers.fp32_paths_bound`).

What lm-eval 0.4.13 does for a log-likelihood request (lm_eval/models/api_models.py and
openai_completions.py): it tokenizes client-side (here: a Hugging Face tokenizer directory
written below whose ids are the byte tokenizer's, BOS 256 added by its post-processor with
`add_bos_token=True`), and POSTs the token ids, batch_size prompts at a time, as
{"model", "prompt": [[ids], ...], "temperature": 0, "max_tokens": 1, "logprobs": 1,
"seed": 1234, "echo": true}. It then sorts choices by `index` and takes
sum(choices[i].logprobs.token_logprobs[ctxlen:-1]) (ctxlen: the context's ids, BOS included;
`-1` drops the one generated token), and is_greedy = every such logprob equals
max(top_logprobs[p].values()). So token_logprobs must hold one entry per prompt id, in order
(the first null), then the generated token's.

lm_eval (with its api extra) is in the dev extra, so `make test` runs this (about 25 s, most of
it lm-eval indexing its own task library).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

import kvfold
from kvfold.server.app import create_app

from helpers import fp32_paths_bound, serving

pytestmark = pytest.mark.lm_eval

KEY = "lm-eval-key"
TASK = "kvfold_mc"
EPS = torch.finfo(torch.float32).eps

# doc_to_text renders "Question: {question}\nAnswer:" and the task's target_delimiter is "", so
# each continuation is the choice exactly (a leading space is part of the choice)
QUESTIONS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "2 + 2 =", "choices": [" 3", " 4", " 22"], "answer": 1},
    {"question": "Which is a colour?", "choices": [" seven", " blue", " tomorrow"], "answer": 1},
    {"question": "Café is a word in which language?", "choices": [" français", " 日本語", " English"], "answer": 0},
]
# one more question gets the model's own greedy continuation as a choice (is_greedy must be true
# for it): the candidate whose greedy bytes give the longest valid UTF-8 text is used
GREEDY_CANDIDATES = ["What comes next?", "Continue the text.", "Say something.", "Finish this:", "And then?"]

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


# ---- the client-side tokenizer: a Hugging Face tokenizer.json with kvfold's byte ids ----------

def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one the ByteLevel pre-tokenizer maps bytes to."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_byte_tokenizer(path, bos_id: int, eos_id: int) -> None:
    """A tokenizer directory `transformers.AutoTokenizer` loads offline, whose ids equal kvfold's
    ByteTokenizer's: byte b is id b (BPE over ByteLevel characters, no merges), then BOS and EOS
    as special tokens, BOS prepended when special tokens are added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    b2u = _gpt2_bytes_to_unicode()
    assert set(b2u.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = "<|bos|>", "<|eos|>"
    tok.add_special_tokens([AddedToken(bos, special=True), AddedToken(eos, special=True)])
    assert (tok.token_to_id(bos), tok.token_to_id(eos)) == (bos_id, eos_id)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, bos_id)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False}))


def test_byte_tokenizer_ids(tmp_path, tiny):
    """The written tokenizer encodes text to exactly the byte tokenizer's ids (ASCII, multi-byte
    UTF-8, control characters, the ByteLevel alphabet's own characters), and back."""
    from tokenizers import Tokenizer

    bt = tiny.tokenizer
    write_byte_tokenizer(tmp_path, bt.bos_id, bt.eos_id)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = ["Question: What is the capital of France?\nAnswer: Paris", " leading  spaces ", "tab\tCR\r\n",
             "Café, français, 日本語, 🤖", "\x00\x04\x7f\x80\u07ff\uffff\U0010ffff", "Ġ Ċ ĉ ÿ", ""]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False).ids == bt.encode(text), text
        assert tok.encode(text).ids == [bt.bos_id] + bt.encode(text), text
        assert tok.decode(bt.encode(text)) == text


# ---- the model's own log-likelihoods (no server, no lm-eval) ------------------------------------

def direct_score(model, ctx: str, cont: str) -> dict:
    """log P(cont | BOS ctx) from one full forward, and what may separate the server's value
    from it by rounding alone."""
    tok = model.tokenizer
    ctx_ids = [tok.bos_id] + tok.encode(ctx)
    ids = ctx_ids + tok.encode(cont)  # bytes: encode(ctx + cont) == encode(ctx) + encode(cont)
    state = model.new_state(capacity=len(ids))
    try:
        logits = model.forward(ids, state)
    finally:
        state.free()
    lp = torch.log_softmax(logits.double(), dim=-1)  # float64: this side's own rounding is negligible
    # The server's logits are another fp32 evaluation (chunked prefill, prefix cache, batching):
    # within B of these in every entry. A logprob x_t - logsumexp(x) then moves by at most 2B
    # (logsumexp is 1-Lipschitz in the max norm), plus the server's fp32 log-softmax rounding:
    # a few ulps of its operands, and its sum over V terms within V * eps relative (a naive sum's
    # worst case), an absolute V * eps once through log.
    bound = fp32_paths_bound(logits, model.config.num_hidden_layers)
    vocab, scale = logits.shape[-1], logits.abs().max().item()
    positions = range(len(ctx_ids), len(ids))
    tols = [2 * bound + EPS * (vocab + 4 * (scale + abs(lp[p - 1, ids[p]].item()))) for p in positions]
    greedy, ambiguous = True, False
    for p, tol in zip(positions, tols):
        row = lp[p - 1]
        other = torch.cat([row[:ids[p]], row[ids[p] + 1:]]).max().item()
        greedy &= row[ids[p]].item() > other
        ambiguous |= abs(row[ids[p]].item() - other) <= 2 * tol  # both are the server's: each off by tol
    return {"ll": sum(lp[p - 1, ids[p]].item() for p in positions), "tol": sum(tols), "greedy": greedy,
            "greedy_ambiguous": ambiguous}


def greedy_choice(model, ctx: str, max_tokens: int = 4) -> str:
    """The model's greedy continuation of BOS ctx, cut to its longest prefix that is UTF-8 text
    (byte tokens only), each step's argmax clear of the runner-up."""
    tok = model.tokenizer
    ids = [tok.bos_id] + tok.encode(ctx)
    out: list[int] = []
    for _ in range(max_tokens):
        state = model.new_state(capacity=len(ids) + len(out))
        try:
            row = torch.log_softmax(model.forward(ids + out, state, last_only=True)[-1].double(), -1)
        finally:
            state.free()
        top = row.topk(2)
        if int(top.indices[0]) >= 256 or (top.values[0] - top.values[1]).item() < 1e-3:
            break
        out.append(int(top.indices[0]))
    for n in range(len(out), 0, -1):
        try:
            return bytes(out[:n]).decode("utf-8")
        except UnicodeDecodeError:
            pass
    return ""


def make_docs(model) -> list[dict]:
    choice, q = max(((greedy_choice(model, context({"question": q})), q) for q in GREEDY_CANDIDATES),
                    key=lambda cq: len(cq[0].encode()))
    assert choice, "no candidate question has a greedy continuation that is UTF-8 text"
    return QUESTIONS + [{"question": q, "choices": [" no", choice, " yes"], "answer": 1}]


# ---- the live server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny):
    engine = kvfold.Engine(tiny, max_seq_len=512, max_running=16, max_queue=64)
    app = create_app(engine, model_name="tiny-random", api_key=KEY)
    with serving(app) as url:
        yield url


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        pytest.fail(f"/v1/completions answered {e.code}: {e.read().decode(errors='replace')}")


def test_echo_logprobs_contract(server, tiny):
    """The body lm-eval sends, answered the way its parser reads it: per choice (sorted by
    `index`, one per prompt) token_logprobs holds one entry per prompt id (the first null) then
    the generated token's; each is the model's logprob; top_logprobs[p] is a dict whose max is
    the position's argmax logprob (bit-equal to token_logprobs[p] where that token is the argmax)."""
    tok = tiny.tokenizer
    prompts = [[tok.bos_id] + tok.encode(t) for t in ("Question: 2 + 2 =\nAnswer: 4", "Café: 日本語", "a")]
    body = {"model": "tiny-random", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = post(server, body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(prompts)))
    for ids, choice in zip(prompts, choices):
        lps, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
        assert len(lps) == len(tops) == len(ids) + 1, (len(lps), len(tops), len(ids))
        assert lps[0] is None and tops[0] is None
        if choice["logprobs"].get("tokens") is not None:
            assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
        state = tiny.new_state(capacity=len(ids))
        try:
            logits = tiny.forward(ids, state)
        finally:
            state.free()
        lp = torch.log_softmax(logits.double(), dim=-1)
        bound = fp32_paths_bound(logits, tiny.config.num_hidden_layers)
        gen = int(lp[-1].argmax())  # temperature 0: the generated token is the argmax
        for p, t in enumerate(ids[1:] + [gen], start=1):
            tol = 2 * bound + EPS * (logits.shape[-1] + 4 * (logits.abs().max().item() + abs(lp[p - 1, t].item())))
            assert isinstance(lps[p], float) and abs(lps[p] - lp[p - 1, t].item()) <= tol, (p, lps[p], lp[p - 1, t])
            assert isinstance(tops[p], dict) and len(tops[p]) >= 1
            assert abs(max(tops[p].values()) - lp[p - 1].max().item()) <= tol, p
            if t == int(lp[p - 1].argmax()):
                assert lps[p] == max(tops[p].values()), p  # lm-eval's is_greedy compares them exactly


# ---- lm-eval itself ----------------------------------------------------------------------------

def run_lm_eval(tmp_path, url: str, docs: list[dict]) -> tuple[dict, list[dict]]:
    """Write the task and the tokenizer under tmp_path, run the lm_eval CLI against `url`; return
    its results JSON and its logged samples (by doc_id)."""
    tasks, out, tokdir = tmp_path / "tasks", tmp_path / "out", tmp_path / "tokenizer"
    tasks.mkdir()
    data = tasks / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=json.dumps(str(data))), encoding="utf-8")
    write_byte_tokenizer(tokdir, 256, 257)
    model_args = ",".join([
        "model=tiny-random", f"base_url={url}/v1/completions", f"tokenizer={tokdir}",
        "tokenizer_backend=huggingface",  # not "auto": that probes /tokenizer_info first (3 tries)
        "add_bos_token=True",  # BOS then the bytes: what kvfold does with a text prompt
        "max_length=512", "max_retries=1", "timeout=120"])
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), OPENAI_API_KEY=KEY, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--batch_size", "4",  # several prompts per request: the server's choices come back by index
           "--include_path", str(tasks), "--tasks", TASK, "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"lm_eval exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    [results] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    [samples] = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    with open(results, encoding="utf-8") as f:
        res = json.load(f)
    with open(samples, encoding="utf-8") as f:
        logged = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["doc_id"])
    return res, logged


def test_lm_eval_multiple_choice(tmp_path, server, tiny):
    docs = make_docs(tiny)
    # the model's own scores, computed before any request reaches the engine (which shares the model)
    direct = [[direct_score(tiny, context(d), c) for c in d["choices"]] for d in docs]

    res, logged = run_lm_eval(tmp_path, server, docs)

    assert [s["doc_id"] for s in logged] == list(range(len(docs)))
    accs = []
    for doc, scores, sample in zip(docs, direct, logged):
        args = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert args == [(context(doc), c) for c in doc["choices"]], args
        resps = sample["filtered_resps"]  # one [loglikelihood, is_greedy] per choice (lm-eval logs them as text)
        assert len(resps) == len(doc["choices"])
        for choice, s, (ll, greedy) in zip(doc["choices"], scores, resps):
            ll = float(ll)
            assert abs(ll - s["ll"]) <= s["tol"], (doc["question"], choice, ll, s["ll"], s["tol"])
            if not s["greedy_ambiguous"]:
                assert str(greedy) == str(s["greedy"]), (doc["question"], choice, greedy, s["greedy"])
        # acc from the direct log-likelihoods: the argmax must be clear of rounding to compare
        lls = [s["ll"] for s in scores]
        best = max(range(len(lls)), key=lls.__getitem__)
        for j, s in enumerate(scores):
            assert j == best or lls[best] - lls[j] > scores[best]["tol"] + s["tol"], \
                f"test data: choices {best} and {j} of {doc['question']!r} are within rounding of each other"
        acc = float(best == doc["answer"])
        assert float(sample["acc"]) == acc, (doc["question"], sample["acc"], lls)
        accs.append(acc)
    greedy_doc = direct[-1][docs[-1]["answer"]]
    assert greedy_doc["greedy"] and not greedy_doc["greedy_ambiguous"]
    assert logged[-1]["filtered_resps"][docs[-1]["answer"]][1] in ("True", True)
    assert res["results"][TASK]["acc,none"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)

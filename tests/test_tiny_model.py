"""The shipped `tiny` model (kvfold/assets/tiny/, trained by tools/train_tiny.py) has learned its text,
and kvfold's perplexity, speculation and CLI give on it what independent computations give."""
from __future__ import annotations

import math
import re

import pytest
import torch

import kvfold
from kvfold import cli
from kvfold.decoding.perplexity import score_text, unigram_perplexity
from kvfold.models.deepseek_v4.config import CSA, HCA, SLIDING
from kvfold.models.registry import TINY_DIR

HELDOUT = TINY_DIR / "heldout.txt"


@pytest.fixture(scope="module")
def trained():
    return kvfold.load_model("tiny")


@pytest.fixture(scope="module")
def heldout_ids(trained):
    return trained.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))


def test_the_shipped_checkpoint_has_every_layer_and_routing_kind_and_fits_the_budget(trained):
    cfg = trained.config
    assert {SLIDING, CSA, HCA} <= set(cfg.layer_types)
    assert {"hash_moe", "moe"} <= set(cfg.mlp_layer_types)
    assert cfg.hc_mult > 1 and trained.supports_mtp
    assert 3e6 <= trained.num_parameters() <= 20e6
    assert (TINY_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    assert type(trained.tokenizer).__name__ == "HFTokenizer" and trained.tokenizer.vocab_size > 1000


def test_heldout_perplexity_is_far_below_the_texts_own_unigram_perplexity(trained, heldout_ids):
    """The unigram distribution fitted on the scored text itself is the best any model that ignores
    context can do on it (it is the maximum-likelihood one), so beating it by a wide margin takes
    context; a broken loader or tokenizer scores near or above it (random weights: about the vocab
    size). Measured: 71.5 against 501."""
    ppl = score_text(trained, heldout_ids, context=512).perplexity
    assert ppl < 0.3 * unigram_perplexity(heldout_ids), (ppl, unigram_perplexity(heldout_ids))


def test_eval_ppl_equals_a_token_by_token_decode_of_the_same_windows(trained, tmp_path, capsys):
    """The CLI's number, against an independent path: one decode step per token, each window
    behind BOS, log-softmax summed by hand. Prefill and decode logits differ by fp32 rounding
    (~1e-5 at logit scale ~10), which moves a mean NLL of ~3 by far less than 1e-4 relative."""
    text = HELDOUT.read_text(encoding="utf-8")[:1500]
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    ids = trained.tokenizer.encode(text)[:120]
    context = 50
    nll = 0.0
    for start in range(0, len(ids), context):
        window = ids[start:start + context]
        state = trained.new_state(capacity=context + 1)
        inputs = [trained.tokenizer.bos_id] + window[:-1]
        for tok, target in zip(inputs, window):
            logp = trained(torch.tensor([tok]), state)[0].double().log_softmax(-1)
            nll -= logp[target].item()
        state.free()
    want = math.exp(nll / len(ids))
    assert cli.main(["eval-ppl", "--model", "tiny", "--text", str(path), "--context", str(context),
                     "--max-tokens", str(len(ids))]) == 0
    got = float(re.search(r"perplexity ([0-9.]+) over (\d+) tokens", capsys.readouterr().out).group(1))
    assert got == pytest.approx(want, rel=1e-4)


def test_unigram_perplexity_matches_a_hand_computation():
    # p(1) = 2/3 twice, p(2) = 1/3 once
    assert unigram_perplexity([1, 2, 1]) == pytest.approx(math.exp(-(2 * math.log(2 / 3) + math.log(1 / 3)) / 3))


def test_greedy_output_is_identical_with_and_without_speculation(trained, heldout_ids):
    prompt = [trained.tokenizer.bos_id] + heldout_ids[200:248]
    plain = kvfold.generate(trained, prompt, 40, ignore_eos=True).tokens
    for speculative in ("mtp", "ngram"):
        for k in (1, 3):
            r = kvfold.generate(trained, prompt, 40, ignore_eos=True, speculative=speculative, num_draft=k)
            assert r.tokens == plain, (speculative, k)
            if speculative == "mtp":
                assert r.accepted > 0  # the trained MTP block predicts real text, not noise


def test_the_demo_continues_in_words_of_the_corpus(capsys):
    """Greedy continuation of a prompt from the docs: its words are words of Python's documentation
    (pydoc_data.topics, one of the training sources, read here independently of the model)."""
    from pydoc_data.topics import topics
    vocabulary = set(re.findall(r"[a-z]+", " ".join(topics.values()).lower()))
    assert cli.main(["generate", "--model", "tiny", "--prompt", "The with statement is used to",
                     "--max-new-tokens", "48"]) == 0
    text = capsys.readouterr().out.split("[kvfold]")[0]
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 20, text
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.9, (known, text)

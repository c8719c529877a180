"""A prompt that renders a conversation the engine produced again continues that conversation's
exact state (engine/transcripts.py): each turn's logits and tokens are bit-identical to those of
one state growing through the whole conversation (prompts prefilled in chunks ending at multiples
of the block, outputs fed one token a call), whether the last state comes from the prefix cache or
is rebuilt by replaying the outputs; and re-encoded text of an earlier output maps back to the
ids the model chose."""
import sys
from pathlib import Path

import pytest
import torch

import kvfold

from kvfold import Engine, SamplingParams
from kvfold.engine.transcripts import TranscriptStore
from kvfold.models.registry import TINY_DIR
from kvfold.tokenizer import load_tokenizer

from helpers import random_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (the GPU run's tiny models)

BLOCK = 128


def grow(model, state, ids: list[int]) -> torch.Tensor:
    """Feed `ids` to `state` as the engine prefills a prompt from state.pos: chunks ending at
    multiples of the block. Returns the last row's logits."""
    i, logits = 0, None
    while i < len(ids):
        take = min(len(ids) - i, (state.pos // BLOCK + 1) * BLOCK - state.pos)
        logits = model.forward(ids[i:i + take], state, last_only=True)
        i += take
    return logits[-1]


def growing_turns(model, turns: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy replies of one state growing through the conversation: each turn's new ids (after the
    previous reply, whose last token the state has not yet seen), then its reply decoded one token
    a call. Returns each turn's (reply ids, logits of every reply token)."""
    st = model.new_state(capacity=4096)
    out, pending = [], []
    for new in turns:
        logits = grow(model, st, pending + new)
        reply, rows = [], []
        for _ in range(max_tokens):
            rows.append(logits)
            tok = int(torch.argmax(logits))
            reply.append(tok)
            if len(reply) == max_tokens:
                break
            logits = model.forward([tok], st, last_only=True)[-1]
        out.append((reply, rows))
        pending = [reply[-1]]
    st.free()
    return out


def run(engine, prompt: list[int], params) -> tuple[list[int], list[float], int]:
    """One request to its end: (tokens, their logprobs, cached prompt tokens)."""
    rid = engine.add_request(prompt, params)
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                logprobs += [lp.logprob for lp in o.logprobs or ()]
                cached = o.cached_tokens
    return tokens, logprobs, cached


def converse(engine, turns: list[list[int]], want, max_tokens: int) -> list[int]:
    """Send the conversation turn by turn, each prompt the whole conversation so far; every reply's
    tokens and logprob bits must be the growing state's (log_softmax of its rows). Returns each
    turn's cached prompt tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    prompt, cached = [], []
    for k, (new, (reply, rows)) in enumerate(zip(turns, want)):
        prompt = prompt + new
        tokens, logprobs, n = run(engine, prompt, params)
        assert tokens == reply, k
        assert logprobs == [float(torch.log_softmax(r.float(), -1)[t]) for r, t in zip(rows, reply)], k
        cached.append(n)
        prompt = prompt + tokens
    return cached


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_each_turn_is_bit_identical_to_one_growing_state(tiny, glm_tiny, family):
    model = tiny if family == "deepseek_v4" else glm_tiny
    vocab = model.config.vocab_size
    turns = [random_ids(300, vocab, seed=1).tolist(), random_ids(40, vocab, seed=2).tolist(),
             random_ids(9, vocab, seed=3).tolist(), random_ids(150, vocab, seed=4).tolist()]
    want = growing_turns(model, turns, max_tokens=20)
    engine = Engine(model, max_seq_len=2048, conversations=1 << 16)
    cached = converse(engine, turns, want, max_tokens=20)
    # from turn 2 on, the whole conversation before the turn's new ids came from the last turn's state
    assert cached[1:] == [sum(map(len, turns[:k])) + 20 * k - 1 for k in range(1, len(turns))]
    assert engine.transcripts.aligned == 3


def test_a_turn_whose_last_state_was_evicted_replays_to_the_same_bits(tiny):
    vocab = tiny.config.vocab_size
    turns = [random_ids(200, vocab, seed=5).tolist(), random_ids(30, vocab, seed=6).tolist()]
    want = growing_turns(tiny, turns, max_tokens=12)
    engine = Engine(tiny, max_seq_len=1024, conversations=1 << 16)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    first, _, _ = run(engine, turns[0], params)
    engine.clear_prefix_cache()  # the conversation's last state is gone: replayed one token a call
    second, logprobs, cached = run(engine, turns[0] + first + turns[1], params)
    reply, rows = want[1]
    assert first == want[0][0] and second == reply and cached == 0
    assert logprobs == [float(torch.log_softmax(r.float(), -1)[t]) for r, t in zip(rows, reply)]


def test_re_encoded_text_of_an_output_maps_back_to_the_chosen_ids():
    """An output's text encoded again (as a chat format renders an earlier reply) need not give the
    ids the model chose; the store puts those ids back, and keeps the prompt's own ids after it."""
    tok = load_tokenizer(TINY_DIR, 0, 1, None)  # the trained tiny model's BPE tokenizer
    store = TranscriptStore(tok)
    prompt = tok.encode("The question is")
    chosen = tok.encode(" a") + tok.encode("n") + tok.encode(" answer")  # not how " an answer" encodes
    assert chosen != tok.encode(" an answer")
    store.record(prompt, (), chosen)
    again = prompt + tok.encode(" an answer") + tok.encode(". Next?")
    ids, spans = store.align(again)
    assert ids == prompt + chosen + tok.encode(". Next?")
    assert spans == ((len(prompt), len(prompt) + len(chosen) - 1),)
    # control ids must match id for id: the reply's end marker, then the next turn
    eot = tok.encode("<|end_of_text|>")
    store.record(prompt, (), chosen + eot)
    ids, _ = store.align(prompt + tok.encode(" an answer") + eot + tok.encode(" More"))
    assert ids == prompt + chosen + eot + tok.encode(" More")
    # text that differs from the output is another conversation: the prompt is left as it is
    other = prompt + tok.encode(" an answers") + tok.encode(". Next?")
    assert store.align(other) == (other, ())


@pytest.fixture(scope="module")
def glm_tiny(tiny):
    """GLM-5.3's tiny test model (the GPU check's), with a tokenizer for the engine to hold."""
    _, model = gpu_check.tiny_pair("glm5_next", torch.float32, torch.device("cpu"))
    model.tokenizer = tiny.tokenizer
    return model


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_a_speculative_engine_continues_conversations_to_the_same_bits(kind):
    """Verify rows are decode rows (tests/test_verify_rows.py), so a conversation decoded with drafts
    is the one a growing state decodes, and continues so."""
    model = kvfold.load_model("tiny")
    tok = model.tokenizer
    turns = [tok.encode("The state is explicit data. " * 12), tok.encode(" And then?"), tok.encode(" Why?")]
    want = growing_turns(model, turns, max_tokens=16)
    engine = Engine(model, max_seq_len=1024, conversations=1 << 16, speculative=kind, num_draft=3)
    converse(engine, turns, want, max_tokens=16)
    assert engine.transcripts.aligned == 2 and engine.spec.accepted > 0

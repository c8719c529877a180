"""A verify step's rows are decode rows (issue 45, item 1): with `decode_rows`, the
k + 1 rows of one sequence's verify run one after another through the decode row's path, each
seeing the state and the rows before it, so the logits at every verified position, accepted or
not, are the bits plain decoding computes there (batch-invariant mode: the token-parallel ops give
a row its bits in any batch). Hence speculative greedy output is plain greedy output by
construction, not to rounding."""
import sys
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold import Engine, SamplingParams

from helpers import random_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402  (the GPU run's tiny models)


def threads(n: int):
    class _T:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return _T()


def decoded(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits plain decoding computes after the prompt and each of `tokens`: [len, vocab]."""
    st = model.new_state(capacity=len(prompt) + len(tokens) + 1)
    model.forward(prompt, st, last_only=True)
    rows = torch.cat([model.forward([t], st) for t in tokens])
    st.free()
    return rows


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("prompt_len", [7, 130, 300])  # inside the window, past a block, past window and ratio
def test_verify_rows_are_plain_decodings_bits(tiny, n_threads, prompt_len):
    vocab = tiny.config.vocab_size
    prompt = random_ids(prompt_len, vocab, seed=prompt_len).tolist()
    drafts = random_ids(5, vocab, seed=prompt_len + 1).tolist()  # (the last token, then 4 drafts)
    with threads(n_threads):
        want = decoded(tiny, prompt, drafts)
        st = tiny.new_state(capacity=prompt_len + 8)
        tiny.forward(prompt, st, last_only=True)
        got = tiny.forward(drafts, st, decode_rows=True)
        assert torch.equal(got, want)
        # beside other sequences in one call: a prefill chunk and another verify
        a, b = tiny.new_state(capacity=prompt_len + 8), tiny.new_state(capacity=64)
        tiny.forward(prompt, a, last_only=True)
        other = random_ids(40, vocab, seed=9).tolist()
        out = tiny.forward_batch([(other, b), (drafts, a)], last_only=[True, False], decode_rows=[False, True])
        assert torch.equal(out[1], want)
        # the control: the same rows as one chunk are computed another way, not these bits
        c = tiny.new_state(capacity=prompt_len + 8)
        tiny.forward(prompt, c, last_only=True)
        assert not torch.equal(tiny.forward(drafts, c), want)
        for s in (st, a, b, c):
            s.free()


def test_a_rejected_draft_rewinds_to_the_decoded_state(tiny):
    """Verify rows write the state exactly as decoding would: after a rewind to the accepted
    prefix, the state continues as plain decoding does (the snapshot bytes are the same)."""
    vocab = tiny.config.vocab_size
    prompt, drafts = random_ids(150, vocab, seed=3).tolist(), random_ids(5, vocab, seed=4).tolist()
    plain = tiny.new_state(capacity=200, max_rewind=4)
    tiny.forward(prompt, plain, last_only=True)
    for t in drafts[:3]:
        tiny.forward([t], plain)
    spec = tiny.new_state(capacity=200, max_rewind=4)
    tiny.forward(prompt, spec, last_only=True)
    tiny.forward(drafts, spec, decode_rows=True)
    spec.rewind_to(plain.pos)
    assert spec.snapshot() == plain.snapshot()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_speculative_greedy_logprobs_are_plain_greedy_bits(kind):
    """Through the engine: every accepted token's logprob bits equal plain decoding's."""
    model = kvfold.load_model("tiny")
    prompts = [model.tokenizer.encode(t) for t in ("The engine keeps", "A state is explicit data and")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)

    def run(engine):
        outs = {}
        for rid in [engine.add_request(p, params) for p in prompts]:
            outs[rid] = []
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] += [(lp.token, lp.logprob) for lp in o.logprobs or ()]
        return list(outs.values())

    plain = run(Engine(model, max_seq_len=256))
    spec_engine = Engine(model, max_seq_len=256, speculative=kind, num_draft=3)
    spec = run(spec_engine)
    assert spec == plain
    assert spec_engine.spec.accepted > 0  # drafts were verified and kept, not all rejected


@pytest.mark.parametrize("n_threads", [1, 2])
def test_glm_verify_rows_are_plain_decodings_bits(n_threads):
    """GLM-5.3: MLA runs the verify rows one after another as decode rows; KDA runs them as its
    recurrence's single steps (the last max_rewind rows of any call are)."""
    _, glm = gpu_check.tiny_pair("glm5_next", torch.float32, torch.device("cpu"))
    vocab = glm.config.vocab_size
    for prompt_len in (7, 140):
        prompt, drafts = random_ids(prompt_len, vocab, seed=prompt_len).tolist(), random_ids(5, vocab, seed=2).tolist()
        with threads(n_threads):
            st = glm.new_state(capacity=prompt_len + 8, max_rewind=4)
            glm.forward(prompt, st, last_only=True)
            want = torch.cat([glm.forward([t], st) for t in drafts])
            spec = glm.new_state(capacity=prompt_len + 8, max_rewind=4)
            glm.forward(prompt, spec, last_only=True)
            got = glm.forward(drafts, spec, decode_rows=True)
            assert torch.equal(got, want), prompt_len
            # the control: with no rewind kept, KDA runs the 5 rows as one chunk of its closed form
            # (MLA's rows are row-invariant: absorb.py), and those bits differ from single steps
            chunk = glm.new_state(capacity=prompt_len + 8, max_rewind=0)
            glm.forward(prompt, chunk, last_only=True)
            assert not torch.equal(glm.forward(drafts, chunk), want)


def _counting_model_row(monkeypatch) -> list:
    """The results of every fused whole-model call (None where it declined) from now on."""
    from kvfold.models.deepseek_v4 import model as dsv4_model
    real, seen = dsv4_model.model_row, []

    def counted(model, batch):
        out = real(model, batch)
        seen.append(out)
        return out
    monkeypatch.setattr(dsv4_model, "model_row", counted)
    return seen


def _verify_beside_others(model, prompt_len: int, lengths=(5, 1, 3)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One call of a sequence per length: by default a verify of 5 rows, a decode row and a verify
    of 3 rows; with the logits plain decoding computes for each (got, want)."""
    vocab = model.config.vocab_size
    prompts = [random_ids(prompt_len + i, vocab, seed=20 + i).tolist() for i in range(len(lengths))]
    rows = [random_ids(n, vocab, seed=30 + n).tolist() for n in lengths]
    want = [decoded(model, p, r) for p, r in zip(prompts, rows)]
    states = [model.new_state(capacity=prompt_len + 10, max_rewind=4) for _ in prompts]
    for p, st in zip(prompts, states):
        model.forward(p, st, last_only=True)
    got = model.forward_batch(list(zip(rows, states)), last_only=False, decode_rows=[n > 1 for n in lengths])
    for st in states:
        st.free()
    return got, want


@pytest.mark.parametrize("n_threads", [1, 2])
def test_verify_rows_run_in_the_decode_steps_one_native_call(tiny, monkeypatch, n_threads):
    """Beside other sequences' decode and verify rows, a verify step's rows take the fused
    whole-model call (kv_model_decode_rows) a decode step takes, with plain decoding's bits."""
    with threads(n_threads):
        for prompt_len in (9, 131):  # a CSA window closes inside the verify at 131 + 1
            fused = _counting_model_row(monkeypatch)
            got, want = _verify_beside_others(tiny, prompt_len)
            assert fused and fused[-1] is not None  # the three sequences' rows in the one fused call
            for g, w in zip(got, want):
                assert torch.equal(g, w)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A random V4 in the release's formats (FP8 blocks, FP4 experts), read as stored."""
    from test_official_checkpoint import official_tensors, tiny_v4, write_official
    original = tiny_v4()
    path = write_official(tmp_path_factory.mktemp("official"), official_tensors(original), original.config)
    return kvfold.load_model(path, weights="quantized")


def test_verify_rows_on_quantized_weights_are_plain_decodings_bits(quantized, monkeypatch):
    assert quantized.quantized_weights()
    fused = _counting_model_row(monkeypatch)
    got, want = _verify_beside_others(quantized, 40)
    assert fused[-1] is not None
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_bf16_verify_rows_are_plain_decodings_bits_in_batch_invariant_mode(family):
    """bf16 runs batch-invariant on the Triton row kernels (CUDA's path; here in Triton's
    interpreter): there too a verify row is a decode row. (Outside batch-invariant mode a bf16
    row's bits depend on how many rows its matmuls take, for decoding too.)"""
    from test_gpu_invariance import CUDA_PATH
    model, _ = gpu_check.tiny_pair(family, torch.bfloat16, torch.device("cpu"))
    model.set_kernels(CUDA_PATH)
    model.set_batch_invariant(True)
    got, want = _verify_beside_others(model, 2, lengths=(3, 1))  # (Triton's interpreter is slow)
    for g, w in zip(got, want):
        assert torch.equal(g, w)

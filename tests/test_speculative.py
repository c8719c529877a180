"""Speculative decoding: greedy output equals plain greedy; rejection sampling preserves p."""
import re

import pytest
import torch

import kvfold
import kvfold.cli as cli
from kvfold.errors import MtpUnavailableError
from kvfold.decoding.drafters import Drafter, NgramDrafter
from kvfold.decoding.sampling import nucleus, sample_next, sampling_probs as target_probs
from kvfold.decoding.logits import Sampler, SamplingRule
from kvfold.decoding.speculative import rejection_step, verify_drafts
from helpers import fp32_paths_bound

BOS = 256
PROMPTS = {
    "hello": [BOS] + list(b"hello hello hello hello"),
    "abc": [BOS] + list(b"abcabcabcabcabc"),
    "cat": [BOS] + list(b"The cat sat on the mat. The cat sat on the"),
}
N_NEW = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The tiny model is overhead-bound; extra threads only contend on a busy machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain(tiny):
    return {name: kvfold.generate(tiny, p, N_NEW, stop_ids=[]).tokens for name, p in PROMPTS.items()}


class OracleDrafter(Drafter):
    """Proposes the known reference continuation: every draft should be accepted."""

    def __init__(self, prompt, reference):
        self.full = list(prompt) + list(reference)

    def propose(self, context, k):
        n = len(context)
        assert context == self.full[:n]
        return self.full[n:n + k], None


class RandomDrafter(Drafter):
    """Proposes random ids: (almost) every draft is rejected."""

    def __init__(self, seed=0, vocab=258):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def propose(self, context, k):
        return torch.randint(0, self.vocab, (k,), generator=self.g).tolist(), None


# ---- greedy: identical to plain -----------------------------------------------------------

def test_ngram_greedy_equals_plain_greedy(tiny, plain):
    accepted = 0
    for name, prompt in PROMPTS.items():
        for k in (1, 2, 4):
            res = kvfold.generate(tiny, prompt, N_NEW, stop_ids=[], speculative="ngram", num_draft=k)
            assert res.tokens == plain[name], (name, k)
            assert res.drafted >= res.accepted >= 0
            assert res.acceptance_rate == (res.accepted / res.drafted if res.drafted else 0.0)
            assert len(res.accepted_per_position) <= k and all(0 <= r <= 1 for r in res.accepted_per_position)
            assert res.mean_accepted_length == 0.0 or 1.0 <= res.mean_accepted_length <= k + 1
            # each verify step emits one token plus its accepted drafts; the prefill emits the first
            assert res.verify_steps + res.accepted == N_NEW - 1
            accepted += res.accepted
    assert accepted > 0  # drafts were actually accepted somewhere


@pytest.mark.parametrize("k", [1, 4])
def test_oracle_drafts_are_all_accepted(tiny, plain, k):
    prompt = PROMPTS["cat"]
    res = kvfold.generate(tiny, prompt, N_NEW, stop_ids=[], speculative=OracleDrafter(prompt, plain["cat"]),
                          num_draft=k)
    assert res.tokens == plain["cat"]
    assert res.accepted == res.drafted > 0
    assert res.verify_steps == -(-(N_NEW - 1) // (k + 1))


def test_random_drafts_are_rejected_without_changing_output(tiny, plain):
    res = kvfold.generate(tiny, PROMPTS["abc"], N_NEW, stop_ids=[], speculative=RandomDrafter(), num_draft=3)
    assert res.tokens == plain["abc"]
    assert res.drafted > 0 and res.acceptance_rate < 0.2


def test_stop_inside_accepted_drafts_truncates_and_leaves_state_consistent(tiny, plain):
    prompt, ref = PROMPTS["cat"], plain["cat"]
    j = 7  # a stop id that is first emitted at index j, inside a run of accepted drafts
    stop = ref[j]
    first = ref.index(stop)
    st = tiny.new_state(capacity=200, max_rewind=6)
    res = kvfold.generate(tiny, prompt, N_NEW, stop_ids=[stop], speculative=OracleDrafter(prompt, ref),
                          num_draft=5, state=st, history=[])
    assert res.tokens == ref[:first + 1]
    # consumed: prompt + every emitted token but the last (pending), nothing of the rejected tail
    assert st.pos == len(prompt) + len(res.tokens) - 1
    nxt = tiny.forward([res.tokens[-1]], st)
    again = tiny.new_state(capacity=200)
    tiny.forward(prompt, again)
    for t in res.tokens:
        want = tiny.forward([t], again)
    # same sequence, other chunk shapes: two fp32 evaluations of the same logits; a state that
    # kept a rejected draft or lost a row is off by orders of magnitude more
    assert (nxt - want).abs().max().item() < fp32_paths_bound(want, tiny.config.num_hidden_layers)
    st.free()
    again.free()


@pytest.mark.parametrize("n", [0, 1, 2, 5, 6])
def test_never_more_than_max_new_tokens(tiny, plain, n):
    prompt = PROMPTS["cat"]
    res = kvfold.generate(tiny, prompt, n, stop_ids=[], speculative=OracleDrafter(prompt, plain["cat"]),
                          num_draft=4)
    assert res.tokens == plain["cat"][:n]


# ---- the n-gram drafter ---------------------------------------------------------------------

def T(text):
    return [ord(c) for c in text]


def test_ngram_longest_suffix_wins():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    # suffix "b c" (n=2) matches at 1 (-> "x"); n=1 "c" alone matches later at 6 (-> "y"); longest wins
    ctx = T("abcxzzcybc")
    assert d.propose(ctx, 2) == (T("xz"), None)


def test_ngram_most_recent_occurrence():
    d = NgramDrafter(max_ngram=2)
    ctx = T("ab1__ab2__ab")
    assert d.propose(ctx, 1)[0] == T("2")
    assert d.propose(ctx, 3)[0] == T("2__")


def test_ngram_nothing_without_a_match():
    d = NgramDrafter()
    assert d.propose(T("abcdef"), 4) == ([], None)
    assert d.propose([], 4) == ([], None)
    assert d.propose([5], 4) == ([], None)
    assert d.propose([5, 5], 0) == ([], None)


def test_ngram_copies_on_periodically_when_the_match_is_recent():
    d = NgramDrafter(max_ngram=3)
    assert d.propose([7, 7, 7, 7], 3)[0] == [7, 7, 7]
    assert d.propose(T("xabab"), 5)[0] == T("ababa")


def test_ngram_min_ngram_and_incremental_index():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose(T("abxb"), 2) == ([], None)  # only a 1-gram matches
    ctx = T("abxab")
    assert d.propose(ctx, 2)[0] == T("xa")
    ctx += T("yab")  # extends: indexed incrementally; "a b" now last seen before "y"
    assert d.propose(ctx, 1)[0] == T("y")
    assert d.propose(T("qrsqr"), 1)[0] == T("s")  # a new sequence resets the index
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


# ---- rejection sampling preserves the target distribution -----------------------------------

def chi2(counts, p, n):
    p = torch.as_tensor(p, dtype=torch.float64)
    counts = torch.as_tensor(counts, dtype=torch.float64)
    support = p > 0
    assert counts[~support].sum() == 0, "a token with p = 0 was emitted"
    exp = p[support] * n
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# chi-square critical values at 99.9% by degrees of freedom
CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
N_SAMPLES = 6000

CASES = {
    "q differs": ([0.1, 0.2, 0.3, 0.15, 0.25], [0.4, 0.1, 0.1, 0.3, 0.1]),
    "q on p's zeros": ([0.5, 0.5, 0.0, 0.0, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2]),
    "q equals p": ([0.3, 0.3, 0.2, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]),
    "q peaked": ([0.2, 0.2, 0.2, 0.2, 0.2], [0.96, 0.01, 0.01, 0.01, 0.01]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_step_output_is_distributed_as_p(case):
    p, q = (torch.tensor(v, dtype=torch.float64) for v in CASES[case])
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(q, N_SAMPLES, replacement=True, generator=g).tolist()
    counts = [0] * 5
    accepted = 0
    for d in drafts:
        ok, tok = rejection_step(p, q, d, g)
        accepted += ok
        counts[tok] += 1
        assert not ok or tok == d
    stat, df = chi2(counts, p, N_SAMPLES)
    assert stat < CRIT[df], (case, counts)
    # acceptance rate is sum(min(p, q)); the count is binomial, its rate's std at most
    # sqrt(1/4 / N_SAMPLES) = 0.0065, so 0.03 is 4.6 sigma (two-sided chance 4e-6)
    want = float(torch.minimum(p, q).sum())
    assert abs(accepted / N_SAMPLES - want) < 0.03


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_rejection_step_with_a_deterministic_drafter(draft):
    p = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(draft)
    counts = [0] * 5
    for _ in range(N_SAMPLES):
        counts[rejection_step(p, None, draft, g)[1]] += 1
    stat, df = chi2(counts, p, N_SAMPLES)
    assert stat < CRIT[df], counts


def test_verify_drafts_two_positions_is_distributed_as_p():
    # position 0 and 1 targets; the main model's p at position 1 here does not depend on token 0
    p0 = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    p1 = torch.tensor([0.1, 0.1, 0.2, 0.6], dtype=torch.float64)
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    logits = torch.log(torch.stack([p0, p1, p2])).float()
    g = torch.Generator().manual_seed(5)
    first, second, n_second = [0] * 4, [0] * 4, 0
    for _ in range(N_SAMPLES):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        n, nxt = verify_drafts(logits, drafts, q, Sampler(SamplingRule(1.0, 1.0), generator=g))
        emitted = drafts[:n] + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
            n_second += 1
    stat, df = chi2(first, p0, N_SAMPLES)
    assert stat < CRIT[df], first
    stat, df = chi2(second, p1, n_second)
    assert stat < CRIT[df], second


GREEDY = Sampler(SamplingRule())


def test_verify_drafts_greedy_takes_longest_agreeing_prefix():
    logits = torch.tensor([[0.0, 5.0, 5.0], [9.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_drafts(logits, [1, 0], None, GREEDY) == (2, 2)  # tie -> lowest id (1)
    assert verify_drafts(logits, [2, 0], None, GREEDY) == (0, 1)
    assert verify_drafts(logits, [1, 2], None, GREEDY) == (1, 0)
    with pytest.raises(ValueError):
        verify_drafts(logits, [1], None, GREEDY)


def test_target_probs_is_sample_nexts_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    got = target_probs(torch.log(probs), 1.0, 0.7)  # nucleus: 0.5 + 0.3 reaches 0.7
    assert torch.allclose(got, torch.tensor([0.0, 0.625, 0.0, 0.375], dtype=torch.float64))
    hot = target_probs(torch.log(probs), 0.5, 1.0)  # temperature 0.5 squares and renormalises
    assert torch.allclose(hot, (probs.double() ** 2) / (probs.double() ** 2).sum(), atol=1e-6)
    # sample_next never leaves that support
    g = torch.Generator().manual_seed(0)
    seen = {sample_next(torch.log(probs), 1.0, 0.7, g) for _ in range(200)}
    assert seen == {1, 3}


# ---- sampling through generate ---------------------------------------------------------------

class UniformDrafter(Drafter):
    """A probabilistic drafter: drafts from a uniform q, with its own generator."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(99)

    def propose(self, context, k):
        return torch.randint(0, self.vocab, (k,), generator=self.g).tolist(), torch.full((k, self.vocab), 1 / self.vocab)


def test_sampled_speculative_generation_is_reproducible_and_valid(tiny):
    prompt = PROMPTS["hello"]
    kw = dict(temperature=0.8, top_p=0.95, stop_ids=[], speculative="ngram", num_draft=3)
    a = kvfold.generate(tiny, prompt, 30, seed=7, **kw)
    b = kvfold.generate(tiny, prompt, 30, seed=7, **kw)
    c = kvfold.generate(tiny, prompt, 30, seed=8, **kw)
    assert a.tokens == b.tokens and (a.drafted, a.accepted) == (b.drafted, b.accepted)
    assert a.tokens != c.tokens
    for res in (a, c):
        assert len(res.tokens) == 30
        assert all(0 <= t < tiny.config.vocab_size for t in res.tokens)
    u = [kvfold.generate(tiny, prompt, 12, seed=3, temperature=1.0, stop_ids=[], num_draft=2,
                         speculative=UniformDrafter(tiny.config.vocab_size)).tokens for _ in range(2)]
    assert u[0] == u[1] and len(u[0]) == 12


# ---- refusals ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_mtp(tiny):
    """The tiny model's config and weights, but no MTP block (as a checkpoint without mtp.*)."""
    from kvfold.models.deepseek_v4.model import Dsv4Model
    from kvfold.models.deepseek_v4.tiny import init_random_
    m = Dsv4Model(tiny.config)
    init_random_(m, 0)
    m.tokenizer = tiny.tokenizer
    assert m.mtp is None
    return m.eval()


def test_mtp_without_mtp_weights_is_refused_before_allocating(no_mtp, monkeypatch):
    def no_alloc(*a, **k):
        raise AssertionError("new_state must not be called")

    monkeypatch.setattr(no_mtp, "new_state", no_alloc)
    with pytest.raises(MtpUnavailableError, match=r"no mtp\.\* weights"):
        kvfold.generate(no_mtp, [BOS, 1, 2], 5, speculative="mtp")
    assert issubclass(MtpUnavailableError, kvfold.KvfoldError)


def test_mtp_greedy_equals_plain_greedy(tiny, plain):
    """The tiny model carries an MTP block: its drafts must not change greedy output."""
    for name in ("abc", "cat"):
        for k in (1, 2, 4):
            res = kvfold.generate(tiny, PROMPTS[name], N_NEW, stop_ids=[], speculative="mtp", num_draft=k)
            assert res.tokens == plain[name], (name, k)
    res = kvfold.generate(tiny, PROMPTS["abc"], N_NEW, stop_ids=[], speculative="mtp", num_draft=2)
    assert res.tokens == plain["abc"]
    assert res.verify_steps + res.accepted == N_NEW - 1 and res.drafted > 0


@pytest.mark.parametrize("kw", [dict(speculative="medusa"), dict(speculative=3), dict(speculative="ngram", num_draft=0),
                                dict(speculative="ngram", num_draft=1.5)])
def test_bad_speculative_arguments(tiny, kw):
    with pytest.raises(ValueError):
        kvfold.generate(tiny, [BOS, 1], 3, **kw)


def test_given_state_needs_enough_max_rewind(tiny):
    st = tiny.new_state(capacity=50, max_rewind=2)
    with pytest.raises(ValueError, match="max_rewind"):
        kvfold.generate(tiny, [BOS, 1], 3, speculative="ngram", num_draft=4, state=st)
    assert st.pos == 0 and not st.freed


# ---- CLI -----------------------------------------------------------------------------------------

def test_cli_speculative_summary(tiny, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_model", lambda path, device, dtype: tiny)
    rc = cli.main(["generate", "--prompt", "abab abab abab", "--max-new-tokens", "8", "--speculative", "ngram",
                   "--num-draft", "3"])
    assert rc == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    m = re.match(r"^\[kvfold\] prompt 15 tok \| generated \d+ tok \| .* \| state [\d.]+ MiB \(\d+ B/token\) \| "
                 r"accept (\d+\.\d)%(?: \(by position (\d+%(?:, \d+%){0,2}); ([\d.]+) tokens per verify step\))?$",
                 summary)
    assert m, summary
    # as peers report it, once anything was drafted: the share accepted at each draft position
    # (up to num_draft of them), and the tokens a verify step emitted
    if m.group(2) is not None:
        assert len(m.group(2).split(", ")) <= 3 and 1.0 <= float(m.group(3)) <= 4.0
    else:
        assert m.group(1) == "0.0"


def test_cli_mtp_without_mtp_weights_exits_2(no_mtp, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_model", lambda path, device, dtype: no_mtp)
    assert cli.main(["generate", "--prompt", "x", "--max-new-tokens", "3", "--speculative", "mtp"]) == 2
    assert "mtp.* weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x", "--max-new-tokens", "3", "--num-draft", "0"])


def naive_ngram(ctx, k, max_n=3, min_n=1):
    L = len(ctx)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if ctx[s:s + n] == ctx[L - n:]:
                ext = list(ctx)
                for j in range(k):
                    ext.append(ext[s + n + j])
                return ext[L:]
    return []


def test_ngram_incremental_index_matches_a_naive_scan():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=6))
    def check(tokens, steps):
        d = NgramDrafter()
        cut = 0
        for step in steps:  # growing contexts, as during generation
            cut = min(len(tokens), cut + step)
            assert d.propose(tokens[:cut], 4)[0] == naive_ngram(tokens[:cut], 4)

    check()


class RecordingDrafter(NgramDrafter):
    """An n-gram drafter that also reads the hidden streams and records every update."""

    needs_hidden = True

    def __init__(self):
        super().__init__()
        self.updates = []
        self.closed = False

    def update(self, hidden, start_pos, next_tokens):
        assert hidden is not None and hidden.shape[0] == len(next_tokens)
        self.updates.append((hidden.clone(), start_pos, list(next_tokens)))

    def close(self):
        self.closed = True


def test_drafter_updates_cover_every_position_once_with_the_right_hidden(tiny, plain, monkeypatch):
    monkeypatch.setattr(tiny, "max_chunk", 8)  # the prompt is fed (and digested) in pieces of 8
    prompt = PROMPTS["cat"]
    d = RecordingDrafter()
    res = kvfold.generate(tiny, prompt, N_NEW, stop_ids=[], speculative=d, num_draft=3)
    assert res.tokens == plain["cat"] and d.closed and res.accepted > 0
    full = prompt + res.tokens
    pos = 0
    for hidden, start, nxt in d.updates:
        assert start == pos  # contiguous, no gaps or repeats
        assert nxt == full[start + 1:start + 1 + len(nxt)]
        pos += len(nxt)
    # every fed position up to the last verify step (whose update is skipped: nothing drafts after it)
    assert len(full) - 1 - (3 + 1) <= pos < len(full) - 1
    assert [len(u[2]) for u in d.updates[:3]] == [8, 8, 8]  # prefill pieces
    monkeypatch.undo()
    st = tiny.new_state(capacity=len(full))
    _, ref = tiny.forward(full[:-1], st, return_hidden=True)
    got = torch.cat([u[0] for u in d.updates])
    ref = ref[:pos]
    # two fp32 evaluations of the same final streams, other chunk shapes: the logits' argument
    # (helpers.fp32_paths_bound) holds for the streams they are a normed projection of; another
    # position's streams differ by O(max|stream|)
    assert (got - ref).abs().max().item() < fp32_paths_bound(ref, tiny.config.num_hidden_layers)


# ---- structure ---------------------------------------------------------------------------------

def test_verification_targets_the_nucleus_even_at_top_p_1():
    # the softmax gives tokens 1 and 2 ~2e-9, but sample_next can never pick them (nucleus rule)
    logits = torch.tensor([[0.0, -20.0, -20.0], [0.0, 0.0, 0.0]])
    ids, _ = nucleus(logits[0], 1.0, 1.0)
    assert ids.tolist() == [0]
    assert target_probs(logits[0], 1.0, 1.0)[1:].tolist() == [0.0, 0.0]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # a deterministic draft outside the nucleus is always rejected
        assert verify_drafts(logits, [1], None, Sampler(SamplingRule(1.0, 1.0), generator=g))[0] == 0


def test_decoding_imports_point_one_way():
    """sampling <- logits <- (drafters) <- speculative <- generate, with every import at module level;
    draft_length (the draft count policy) imports nothing of the package, generate reads it."""
    import ast
    import pathlib

    import kvfold.decoding as pkg
    root = pathlib.Path(pkg.__file__).parent
    deps = {}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        deps[path.stem] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert id(node) in top, f"{path.name}: function-local import of .{node.module}"
                deps[path.stem].add(node.module)
    assert deps["sampling"] == set()
    assert deps["logits"] == {"sampling"}
    assert deps["drafters"] == {"sampling"}
    assert deps["speculative"] == {"drafters", "logits", "sampling"}
    assert deps["draft_length"] == set()
    assert deps["generate"] == {"draft_length", "logits", "sampling", "speculative"}


def test_supports_mtp_reads_the_checkpoint(tiny, no_mtp):
    assert tiny.supports_mtp and not no_mtp.supports_mtp


def test_generate_reports_acceptance_by_draft_position_as_peers_do():
    """The trained tiny's MTP drafts are accepted often: each draft position's share, and the
    tokens a verify step emits (1 + accepted / verify steps with drafts)."""
    model = kvfold.load_model("tiny")
    res = kvfold.generate(model, model.tokenizer.encode("The state is explicit data"), 32, stop_ids=[],
                          speculative="mtp", num_draft=3)
    assert len(res.accepted_per_position) == 3 and all(0 < r <= 1 for r in res.accepted_per_position)
    assert res.accepted_per_position[0] >= res.acceptance_rate  # the first draft is the likeliest kept
    # steps with drafts are at most all verify steps (the last may have no room left to draft)
    assert 1 + res.accepted / res.verify_steps <= res.mean_accepted_length <= 4

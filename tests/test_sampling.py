import pytest
import torch

from kvfold.decoding.sampling import SamplingArgumentError, check_sampling, draw, nucleus, sample_next, sampling_probs
from kvfold.engine import SamplingParams
from kvfold.errors import InvalidRequestError
from kvfold.server.schemas import ApiError, CompletionRequest, parse


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0, -2.0])
    assert sample_next(logits, 0.0, 1.0, None) == 1
    assert sample_next(torch.tensor([0.0, 0.0, 0.0]), 0.0, 1.0, None) == 0


def test_greedy_accepts_low_precision_logits():
    logits = torch.tensor([0.0, 2.0, 1.0], dtype=torch.bfloat16)
    assert sample_next(logits, 0.0, 1.0, None) == 1


def test_tiny_top_p_keeps_only_the_max():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    picks = {sample_next(logits, 1.5, 1e-6, gen(s)) for s in range(200)}
    assert picks == {1}


def test_tiny_top_p_tie_keeps_lowest_id():
    logits = torch.tensor([0.0, 5.0, 5.0])
    picks = {sample_next(logits, 1.0, 1e-6, gen(s)) for s in range(100)}
    assert picks == {1}


def test_top_p_cuts_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()
    g = gen(0)
    picks = {sample_next(logits, 1.0, 0.7, g) for _ in range(2000)}
    assert picks == {0, 1}  # 0.5 < 0.7 so id 1 is needed; 0.8 >= 0.7 so id 2 is not


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1000, generator=gen(123))

    def draw(seed: int) -> list[int]:
        g = gen(seed)
        return [sample_next(logits, 1.0, 0.9, g) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_distribution_matches_softmax():
    probs = torch.tensor([0.2, 0.3, 0.5])
    logits = probs.log() * 2.0  # temperature 2 undoes the scaling
    g = gen(0)
    n = 20000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[sample_next(logits, 2.0, 1.0, g)] += 1
    freq = counts / n
    # std of each frequency is <= 0.0036 here; 0.02 is > 5 sigma.
    assert torch.allclose(freq, probs, atol=0.02), freq


def test_never_samples_masked_tokens():
    logits = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0])
    g = gen(1)
    picks = {sample_next(logits, 1.0, 1.0, g) for _ in range(500)}
    assert picks == {1, 3}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0, top_p=1.0),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, top_p=1.5),
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        sample_next(torch.zeros(4), generator=None, **kwargs)


def test_bad_logits_raise():
    with pytest.raises(ValueError):
        sample_next(torch.zeros(2, 3), 0.0, 1.0, None)
    with pytest.raises(ValueError, match="NaN"):
        sample_next(torch.tensor([0.0, float("nan")]), 0.0, 1.0, None)
    with pytest.raises(ValueError):
        sample_next(torch.full((3,), float("-inf")), 1.0, 1.0, gen(0))


# ---- one nucleus rule ------------------------------------------------------------------------

def test_nucleus_is_what_sample_next_and_sampling_probs_share():
    logits = torch.tensor([0.3, 2.0, 2.0, -1.0, 1.0])
    ids, probs = nucleus(logits, 1.0, 0.8)
    assert ids.tolist() == [1, 2, 4]  # most likely first, the tie in id order
    dense = sampling_probs(logits, 1.0, 0.8)
    assert set(torch.nonzero(dense).flatten().tolist()) == set(ids.tolist())
    assert torch.allclose(dense[ids], probs / probs.sum()) and abs(float(dense.sum()) - 1.0) < 1e-12
    picks = {sample_next(logits, 1.0, 0.8, gen(s)) for s in range(300)}
    assert picks == set(ids.tolist())


def test_top_p_one_still_applies_the_nucleus_rule():
    # softmax rounds token 0 to 1.0 in float32: the mass before token 1 already reaches top_p = 1
    logits = torch.tensor([0.0, -20.0, -20.0])
    assert nucleus(logits, 1.0, 1.0)[0].tolist() == [0]
    assert sampling_probs(logits, 1.0, 1.0).tolist() == [1.0, 0.0, 0.0]


def test_draw_skips_zero_weights_at_the_edge():
    w = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert {draw(w, gen(s)) for s in range(50)} == {1}


# ---- one validator of sampling arguments ------------------------------------------------------

@pytest.mark.parametrize("kw, param, message", [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens", "max_tokens must be an int >= 1, got 2.0"),
    (dict(temperature=-0.5), "temperature", "temperature must be finite and >= 0, got -0.5"),
    (dict(temperature=float("inf")), "temperature", "temperature must be finite and >= 0, got inf"),
    (dict(temperature=2.5, max_temperature=2.0), "temperature", "temperature must be in [0, 2], got 2.5"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=float("nan")), "top_p", "top_p must be in (0, 1], got nan"),
    (dict(seed=1 << 64), "seed", f"seed must be a 64-bit int or None, got {1 << 64}"),
    (dict(seed=True), "seed", "seed must be a 64-bit int or None, got True"),
    (dict(stop_ids=[1, -2]), "stop_ids", "stop_ids must be token ids (ints >= 0), got [1, -2]"),
    (dict(stop=["a", ""]), "stop", "stop strings must be non-empty strings"),
    (dict(stop=["a"] * 5, max_stops=4), "stop", "stop takes up to 4 non-empty strings"),
])
def test_check_sampling_names_the_bad_argument(kw, param, message):
    with pytest.raises(SamplingArgumentError) as e:
        check_sampling(**kw)
    assert (e.value.param, str(e.value)) == (param, message)
    assert isinstance(e.value, ValueError)


def test_check_sampling_accepts_good_arguments_and_the_callers_names():
    check_sampling(max_tokens=1, temperature=0.7, top_p=1.0, seed=-(1 << 63), stop_ids=[0, 5], stop="x")
    check_sampling(max_tokens=0, max_tokens_floor=0)
    with pytest.raises(SamplingArgumentError) as e:
        check_sampling(max_tokens=-1, max_tokens_floor=0, names={"max_tokens": "max_new_tokens"})
    assert (e.value.param, str(e.value)) == ("max_new_tokens", "max_new_tokens must be an int >= 0, got -1")


def test_engine_and_server_refuse_with_the_same_rule():
    with pytest.raises(InvalidRequestError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5).validate()
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be token ids"):
        SamplingParams(stop_token_ids=[-1]).validate()
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": "hi", "top_p": 1.5})
    assert (e.value.status, e.value.param, e.value.message) == (400, "top_p", "top_p must be in (0, 1], got 1.5")
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 3.0})
    assert (e.value.status, e.value.param) == (400, "temperature")
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 2.0, "stop": "end"})
    assert req.stop == ["end"]

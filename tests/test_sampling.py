import pytest
import torch

from kvfold.decoding.sampling import sample_next


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

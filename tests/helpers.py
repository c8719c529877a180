import torch


def random_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))

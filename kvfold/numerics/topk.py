import torch


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k along the last dim with a defined tie rule: higher score first, ties to the lower
    index. Entries scored -inf are not selectable and come back as -1. The selected indices are
    returned in ascending order (-1 padding last), so results are reproducible.

    torch.topk leaves the order of ties undefined; a stable descending sort does not.
    """
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, order = values[..., :k], order[..., :k]
    order = torch.where(values == float("-inf"), torch.full_like(order, -1), order)
    # ascending with -1 last: sort on a key where -1 maps past every real index
    big = scores.shape[-1]
    key = torch.where(order < 0, torch.full_like(order, big), order)
    key, _ = torch.sort(key, dim=-1)
    return torch.where(key == big, torch.full_like(key, -1), key)

import torch


def topk_lower_index(scores: torch.Tensor, k: int, host_sync: bool = True) -> torch.Tensor:
    """Top-k along the last dim with a defined tie rule: higher score first, ties to the lower
    index. Entries scored -inf are not selectable and come back as -1. The selected indices are
    returned in ascending order (-1 padding last), so results are reproducible.

    torch.topk leaves the order of ties undefined; a stable descending sort does not.
    `host_sync=False` skips the torch.topk shortcut, whose check reads a value back to the host
    (a CUDA graph cannot capture that): the sort alone, the same picks.
    """
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    if host_sync and scores.shape[-1] > k and scores.numel() > 0:
        # torch.topk picks the same set whenever no entry outside it ties the k-th value (then
        # exactly k entries are >= it, and it is finite); the ascending order is then the same too
        values, order = torch.topk(scores, k, dim=-1)
        if int((scores >= values[..., -1:]).sum(dim=-1).max()) == k:
            return order.sort(dim=-1).values
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, order = values[..., :k], order[..., :k]
    # ascending with -1 last: sort on a key where -inf picks map past every real index
    big = scores.shape[-1]
    key = order.masked_fill(values == float("-inf"), big).sort(dim=-1).values
    return key.masked_fill(key == big, -1)

"""The compressor's pooling: per-channel softmax over a window's slots, in fp32."""
import torch

from .backend import Backend, KernelError


def pool_windows(ops: Backend, kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Pool consecutive windows of token rows into one entry each.

    kv, score: [..., L, m*c] rows of consecutive positions, fp32, `ape` already added to score.
      overlap (CSA, m=2): L = (n_w + 1) * ratio; the first `ratio` rows belong to the window
        before the first one pooled (their Ca halves `[:c]` fill slots 0..r-1; rows of positions
        before 0 must be kv=0, score=-inf). Each window's own rows give their Cb halves `[c:]`.
      no overlap (HCA, m=1): L = n_w * ratio.
    Returns [..., n_w, c] fp32. An all -inf column (cannot happen: every window has >= r real
    slots) would pool to 0.
    """
    c_total = kv.shape[-1]
    c = ops.pool_windows
    if (c.triton is not None or c.native is not None) and kv.dim() == 2:  # (the graph step's windows are 3-D)
        if score.shape != kv.shape:
            raise KernelError(f"pool_windows kernels take kv and score of one shape, got {tuple(kv.shape)}, "
                              f"{tuple(score.shape)}")
        if c.triton is not None:
            return c.triton.pool_windows(kv, score, ratio, overlap)
        if kv.dtype != torch.float32 or score.dtype != torch.float32 or not kv.is_cpu:
            raise KernelError(f"kv_pool_windows reads fp32 CPU rows, got {kv.dtype} on {kv.device}")
        kv, score = kv.contiguous(), score.contiguous()
        n_w = kv.shape[0] // ratio - (1 if overlap else 0)
        out = torch.empty(max(n_w, 0), c_total // 2 if overlap else c_total, dtype=torch.float32)
        if n_w > 0 and c.native.kv_pool_windows(kv.data_ptr(), score.data_ptr(), n_w, ratio, c_total, int(overlap),
                                                out.data_ptr()) != 0:
            raise MemoryError(f"kv_pool_windows could not allocate its scratch ({n_w} windows of {c_total})")
        return out
    lead = kv.shape[:-2]  # batch dims (a graph-captured decode step pools one window per row)
    if overlap:
        c = c_total // 2
        n_w = kv.shape[-2] // ratio - 1
        kv_w = kv.view(*lead, n_w + 1, ratio, c_total)
        sc_w = score.view(*lead, n_w + 1, ratio, c_total)
        slots_kv = torch.cat([kv_w[..., :-1, :, :c], kv_w[..., 1:, :, c:]], dim=-2)  # [..., n_w, 2r, c]
        slots_sc = torch.cat([sc_w[..., :-1, :, :c], sc_w[..., 1:, :, c:]], dim=-2)
    else:
        n_w = kv.shape[-2] // ratio
        slots_kv = kv.view(*lead, n_w, ratio, c_total)
        slots_sc = score.view(*lead, n_w, ratio, c_total)
    weights = torch.softmax(slots_sc.float(), dim=-2)
    weights = torch.nan_to_num(weights, nan=0.0)
    return (slots_kv.float() * weights).sum(dim=-2)

"""The absorbed products of GLM-5.3's indexed MLA (mla.py), one linear map per head:
q~_h = W_UK,h^T q_h [lat] and o_h = W_UV,h p_h [dv], where kv_b_proj [H (dn + dv), lat] stacks
W_UK,0 [dn, lat], W_UV,0 [dv, lat], W_UK,1, ... by rows. Each head's product runs as a `Linear`
holding that head's weight (W_UK,h^T [lat, dn], W_UV,h [dv, lat]) would run (layers/basic.py):

* where `weight_mm` reads a quantized weight as stored (`reads_as_stored`), native.c reads the
  codes: W_UV,h in place (descriptors of kv_b_proj's row blocks), W_UK,h^T from `uk_transposed`,
  the same codes and scales re-laid out once per loaded weight (8 MiB of FP8 a GLM-5.3-Flash
  layer). No decoded copy is kept: decoding all of kv_b_proj on every call cost GLM-5.3-Flash
  ~40 ms a decode token.
* elsewhere the rows a product needs are decoded for the call and run on `row_mm`, as `weight_mm`
  runs a weight it decodes; a float kv_b_proj runs as `Linear` runs a float parameter.
native.c's products equal `row_mm` over the decoded values bit for bit (weights_mm.py), so
weights="quantized" and "dequant" agree wherever they agree for any other projection, and a row's
product is the same in prefill, decode and the graph step, which all call these functions.
"""
from __future__ import annotations

import torch

from ...layers.basic import QuantizedWeight, reads_as_stored, weight_mm
from ...numerics.backend import Backend
from ...numerics.quant_formats import BF16, FP8
from ...numerics.rows import row_mm
from ...numerics.weights_mm import native_mm, row_blocks


def absorbed_q(mla, q: torch.Tensor, ops: Backend) -> torch.Tensor:
    """q [T, H, dn] of `mla` (an IndexedMLA) -> q~ [T, H, lat], q~_h = W_UK,h^T q_h."""
    w, nh, dn, per, lat = _kv_b(mla)
    if isinstance(w, QuantizedWeight):
        if _reads_codes(ops, w, q.shape[0]):
            held = w.derived(("uk_t", nh, dn), lambda w: uk_transposed(w, nh, dn))
            found = None if held is None else held.native(lib=ops.weight_mm.native)
            if found is not None:
                return _native_heads(ops, q, [(found[0], h) for h in range(nh)], lat, dn, w.dtype)
        heads = w.rows(_head_rows(nh, per, 0, dn, w.device)).view(nh, dn, lat).transpose(1, 2)
        return _decoded_heads(ops, q, heads)
    return _param_heads(ops, q, w.view(nh, per, lat)[:, :dn].transpose(1, 2))


def absorbed_v(mla, pooled: torch.Tensor, ops: Backend) -> torch.Tensor:
    """pooled [T, H, lat] of `mla` -> o [T, H, dv], o_h = W_UV,h pooled_h."""
    w, nh, dn, per, lat = _kv_b(mla)
    dv = per - dn
    if isinstance(w, QuantizedWeight):
        if _reads_codes(ops, w, pooled.shape[0]):
            parts = w.derived(("uv_rows", nh, dn, dv),
                              lambda w: row_blocks(w.native(lib=ops.weight_mm.native), range(dn, nh * per, per), dv))
            return _native_heads(ops, pooled, [(desc, 0) for desc, _, _ in parts], dv, lat, w.dtype)
        return _decoded_heads(ops, pooled, w.rows(_head_rows(nh, per, dn, dv, w.device)).view(nh, dv, lat))
    return _param_heads(ops, pooled, w.view(nh, per, lat)[:, dn:])


def uk_transposed(w: QuantizedWeight, nh: int, dn: int) -> QuantizedWeight | None:
    """Every head's W_UK,h^T as a stack [H, lat, dn] in w's format: w's codes (and scales) re-laid
    out, FP8 blocks (br, bc) becoming (bc, br), so it decodes to exactly the transposed values of
    w's decode. None for FP4 (never kv_b_proj's), or where a head's W_UK rows neither start a
    scale block nor fit in one (its transposed scale blocks would not start at column 0)."""
    if w.fmt not in (FP8, BF16) or w.q.dim() != 2:
        return None
    lat, per = w.shape[-1], w.shape[0] // nh
    raw = w.q.view(torch.uint8) if w.fmt == FP8 else w.q  # float8 copies go through bytes
    codes = raw.view(nh, per, lat)[:, :dn].transpose(1, 2).contiguous().view(w.q.dtype)
    br, bc = w.block
    held = QuantizedWeight(w.fmt, (nh, lat, dn), w.dtype, (bc, br) if w.fmt == FP8 else w.block, w.scale.dtype,
                           device="meta")
    held.q, held.scale, held.dot = codes, w.scale, w.dot
    if w.fmt == FP8:
        first = torch.arange(nh) * per  # each head's first W_UK row
        if not bool(((first % br == 0) | (first % br + dn <= br)).all()):
            return None
        blocks = (first[:, None] + torch.arange(-(-dn // br)) * br) // br  # [H, column blocks]: stored row blocks
        held.scale = w.scale[blocks.to(w.scale.device)].transpose(1, 2).contiguous()  # [H, lat blocks, dn blocks]
    return held


def _kv_b(mla):
    w = mla.kv_b_proj.weight
    return w, mla.nh, mla.dn, mla.dn + mla.dv, w.shape[-1]


def _reads_codes(ops: Backend, w: QuantizedWeight, rows: int) -> bool:
    """`weight_mm`'s rule for reading w as stored."""
    return w.dtype in (torch.float32, torch.bfloat16) and reads_as_stored(ops, rows) \
        and w.native(lib=ops.weight_mm.native) is not None


def _head_rows(nh: int, per: int, offset: int, n: int, device) -> torch.Tensor:
    """kv_b_proj's rows [offset, offset + n) of every head, head by head."""
    return (torch.arange(nh, device=device)[:, None] * per + offset + torch.arange(n, device=device)).flatten()


def _native_heads(ops: Backend, x: torch.Tensor, parts: list, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """out[:, h] = x[:, h] @ W_h^T in native.c, W_h matrix `index` of descriptor `desc` (parts[h])."""
    lib, xf = ops.weight_mm.native, x if x.dtype == torch.float32 else x.float()
    out = torch.empty(x.shape[0], len(parts), n, dtype=torch.float32)
    for h, (desc, index) in enumerate(parts):
        native_mm(lib, xf[:, h], desc, n, k, index=index, out=out[:, h])
    return out if dtype == torch.float32 else out.to(dtype)


def _decoded_heads(ops: Backend, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Each head's product over its decoded weight heads[h] [n, k], as `weight_mm` runs one."""
    return torch.stack([row_mm(ops, x[:, h].to(w.dtype), w) for h, w in enumerate(heads)], dim=1)


def _param_heads(ops: Backend, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Each head's product over a view heads[h] [n, k] of the float parameter, as `Linear` runs one."""
    return torch.stack([weight_mm(ops, x[:, h], w) if w.dtype is torch.bfloat16 else row_mm(ops, x[:, h].to(w.dtype), w)
                        for h, w in enumerate(heads)], dim=1)

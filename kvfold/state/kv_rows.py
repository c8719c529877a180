"""Rows of attention KV (window rows, compressed entries), stored in the model dtype or in FP8.

FP8 mode (`kv_dtype="fp8"`): the non-rope dims are stored as float8_e4m3fn at unit scale
(clamped to +-448) and the rope dims stay in the model dtype, so positions stay exact
(448 + 2*64 = 576 bytes per V4 row in bf16, against 1024). Reading decodes; decoding an FP8
value is exact, so re-encoding what was read gives the same bytes (snapshots stay exact).
"""
from __future__ import annotations

import torch

from ..numerics import native
from ..numerics.quant import e4m3_saturate


def fp8_roundtrip(x: torch.Tensor, nope: int) -> torch.Tensor:
    """What FP8 storage of the first `nope` dims gives back: used on a chunk's fresh rows so
    they attend exactly as they will when read back from the state later."""
    q = e4m3_saturate(x[..., :nope]).to(x.dtype)
    return torch.cat([q, x[..., nope:]], dim=-1)


def kv_row_bytes(width: int, dtype: torch.dtype, fp8_nope: int | None = None) -> int:
    """Bytes of one row: `width` values in `dtype`, or its first `fp8_nope` as FP8 and the rest in `dtype`."""
    esz = torch.empty(0, dtype=dtype).element_size()
    return width * esz if fp8_nope is None else fp8_nope + (width - fp8_nope) * esz


class KvRows:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device, fp8_nope: int | None = None,
                 fill: float = 0.0):
        self.dtype, self.width, self.fp8_nope = dtype, width, fp8_nope
        if fp8_nope is None:
            self.data = torch.full((rows, width), fill, dtype=dtype, device=device)
        else:
            self.nope = torch.zeros(rows, fp8_nope, dtype=torch.float8_e4m3fn, device=device)
            self.rope = torch.zeros(rows, width - fp8_nope, dtype=dtype, device=device)

    @classmethod
    def over(cls, data: torch.Tensor) -> "KvRows":
        """Plain rows held in `data` [rows, width], a tensor somebody else owns (a slot of a
        `SlotArena`): reads and writes go to it in place."""
        rows = cls.__new__(cls)
        rows.dtype, rows.width, rows.fp8_nope, rows.data = data.dtype, data.shape[1], None, data
        return rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0] if self.fp8_nope is None else self.nope.shape[0], self.width)

    @property
    def device(self) -> torch.device:
        return (self.data if self.fp8_nope is None else self.rope).device

    @property
    def row_bytes(self) -> int:
        return kv_row_bytes(self.width, self.dtype, self.fp8_nope)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def __getitem__(self, index) -> torch.Tensor:
        if self.fp8_nope is None:
            return self.data[index]
        return torch.cat([self.nope[index].to(self.dtype), self.rope[index]], dim=-1)

    def __setitem__(self, index, values: torch.Tensor) -> None:
        if self.fp8_nope is None:  # (a same-dtype .to() is still a dispatched op: skip it)
            self.data[index] = values if values.dtype == self.dtype else values.to(self.dtype)
            return
        n = self.fp8_nope
        self.nope[index] = e4m3_saturate(values[..., :n])
        self.rope[index] = values[..., n:].to(self.dtype)

    def clone_storage(self) -> list[torch.Tensor]:
        """Copies of the stored bytes (tests compare them to prove a refusal changed nothing)."""
        return [self.data.clone()] if self.fp8_nope is None else [self.nope.clone(), self.rope.clone()]


def plain_rows(rows) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(fp32 CPU storage, physical row of each logical row or None) behind plain (not FP8) rows,
    private `KvRows` or paged, for the native kernels to read in place; else None."""
    phys = None
    if type(rows) is not KvRows:
        phys, rows = getattr(rows, "phys", None), getattr(rows, "storage", None)
        if type(rows) is not KvRows or phys is None or phys.dtype != torch.int64 or not phys.is_contiguous():
            return None
    if rows.fp8_nope is None and native.fp32_cpu(rows.data):
        return rows.data, phys
    return None

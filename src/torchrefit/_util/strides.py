"""Rows two equally shaped strided regions have contiguous in common: what both the
batched copy kernel (``execute.batched.strided_runs``: runs of rows at a pitch) and NIXL's
descriptors (``transport.nixl.contiguous_runs``, one descriptor per row) are cut into."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dense_rows", "row_offsets"]


def dense_rows(shape: Sequence[int], a: Sequence[int], b: Sequence[int]
               ) -> tuple[list[int], list[int], list[int], int]:
    """The outer dims of a copy between strides ``a`` and ``b`` (elements) of ``shape``:
    their sizes and both sides' strides, and the row length in elements, the product of
    the innermost dims dense on both sides. Unit dims never break a row, whatever their
    stride, and are left out."""
    dims = [i for i, n in enumerate(shape) if n != 1]
    sizes, sa, sb = [shape[i] for i in dims], [a[i] for i in dims], [b[i] for i in dims]
    k, row = len(dims), 1
    while k and sa[k - 1] == row and sb[k - 1] == row:
        row *= sizes[k - 1]
        k -= 1
    return sizes[:k], sa[:k], sb[:k], row


def row_offsets(shape: Sequence[int], strides: Sequence[int], start: int = 0) -> torch.Tensor:
    """``start`` plus the offsets of every index of ``shape`` at ``strides``, row-major,
    int64 (in whatever unit the strides are: elements or bytes)."""
    if not shape:
        return torch.full((1,), start, dtype=torch.int64)
    # built from the first dim's arange, not a zero scalar: a first refit cuts hundreds
    # of strided halves into rows here, a few torch calls each
    off = torch.arange(start, start + shape[0] * strides[0], strides[0], dtype=torch.int64) \
        if strides[0] else torch.full((shape[0],), start, dtype=torch.int64)
    for n, stride in zip(shape[1:], strides[1:]):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return off.reshape(-1)

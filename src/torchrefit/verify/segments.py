"""Cutting the regions ``verify()`` sums into the segments of one kernel launch (pure).

A region is a strided view read as words (16-bit words, bytes for 1-byte dtypes):
leading dims over a dense last dim. Its leading dims are flattened into *rows*
(row-major, as :func:`torchrefit.verify.checksum.region_sum` weights them) and cut
into *runs*, rows at one fixed stride (a whole dense tensor is one run); runs are cut
into *segments* of about ``target`` words, one kernel program each: rows
``[r0, r0 + n)`` of a run and words ``[c0, c1)`` of each row.

The checksum's weight of word ``(row, col)`` is ``row_weight[row] * col_weight[col]``
mod ``2**32`` (the product of the per-dim hashes, split at the last dim), so the
kernel reads one row weight per row and one column weight per word, from small
tables built here once per region. Who calls it: ``verify.fused.FusedSums`` on every
rank, when it (re)builds its tables; nothing here touches a process group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..execute.kernels.region_checksums import FIELDS, VECTOR
from .checksum import MOD, coordinate_weights

__all__ = ["Region", "FIELDS", "VECTOR", "runs", "segment_rows", "row_weights", "col_weights"]



@dataclass(frozen=True, slots=True)
class Region:
    """One strided view to sum, counted in words of ``word`` bytes.

    ``address`` is the word address of its first word (absolute, or relative to a
    scratch buffer); ``shape`` the leading dims, then the last dim in words; ``strides``
    the leading dims' strides in words (the last dim is dense); ``offset`` its global
    coordinate (last dim in words); ``weight`` what every word's term is multiplied by
    (destination replicas holding it); ``slot`` the output it adds to."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: tuple[int, ...]
    weight: int
    slot: int
    word: int

    def __post_init__(self) -> None:
        if not self.shape or len(self.offset) != len(self.shape) or len(self.strides) != len(self.shape) - 1:
            raise ValueError(f"region shape {self.shape}, offset {self.offset}, strides {self.strides} disagree")

    @property
    def rows(self) -> int:
        n = 1
        for s in self.shape[:-1]:
            n *= s
        return n

    @property
    def width(self) -> int:
        return self.shape[-1]


def runs(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``(first row, address offset, rows, row stride)`` of every run of a view whose
    leading dims are ``shape`` with ``strides`` (words), in row order. Inner leading dims
    that continue each other's stride are merged, size-1 dims dropped (neither moves an
    address nor changes the row order)."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return []
    if not dims:
        return [(0, 0, 1, 0)]
    inner, stride = dims[-1]
    k = len(dims) - 1
    while k > 0 and dims[k - 1][1] == stride * inner:
        inner *= dims[k - 1][0]
        k -= 1
    outer = dims[:k]
    out = []
    for i, index in enumerate(itertools.product(*(range(n) for n, _ in outer))):
        offset = sum(j * s for j, (_, s) in zip(index, outer))
        out.append((i * inner, offset, inner, stride))
    return out


def segment_rows(region: Region, row_base: int, col_base: int, target: int) -> list[tuple[int, ...]]:
    """The table rows (see ``FIELDS``) of one region; ``row_base`` / ``col_base`` are where
    its row and column weights start in the launch's weight tables."""
    width = region.width
    out = []
    if width == 0:
        return out
    for first, offset, rows, stride in runs(region.shape[:-1], region.strides):
        address = region.address + offset
        if width >= target:  # long rows: one row per segment, cut in word ranges
            for r in range(rows):
                for c0 in range(0, width, target):
                    out.append((address + r * stride, stride, 1, row_base + first + r, col_base,
                                c0, min(width, c0 + target), region.slot))
            continue
        step = max(1, target // width)
        for r0 in range(0, rows, step):
            out.append((address + r0 * stride, stride, min(step, rows - r0), row_base + first + r0,
                        col_base, 0, width, region.slot))
    return out


def aligned(row: Sequence[int], word: int) -> bool:
    """Whether a segment can be read with 16-byte vector loads (addresses relative to a
    16-byte aligned base)."""
    v = VECTOR[word]
    address, stride, rows, _, _, c0, c1, _ = row
    return address % v == 0 and (stride % v == 0 or rows == 1) and c0 % v == 0 and c1 % v == 0


def row_weights(region: Region) -> torch.Tensor:
    """int64 ``[rows]``: ``weight * prod_d H_d(offset_d + i_d)`` mod ``2**32`` over the
    leading dims, rows in row-major order (CPU)."""
    w = torch.full((1,), region.weight % MOD, dtype=torch.int64)
    for d, (o, n) in enumerate(zip(region.offset[:-1], region.shape[:-1])):
        h = coordinate_weights(d, o, o + n, torch.device("cpu"))
        w = (w[:, None] * h[None, :]).bitwise_and_(MOD - 1).reshape(-1)
    return w


def col_weights(region: Region) -> torch.Tensor:
    """int64 ``[width]``: ``H_last(offset_last + j)`` (CPU)."""
    d = len(region.shape) - 1
    o = region.offset[-1]
    return coordinate_weights(d, o, o + region.width, torch.device("cpu"))


def as_int32(w: torch.Tensor) -> torch.Tensor:
    """Values in ``[0, 2**32)`` as int32 with the same bits (what the kernel reads as uint32)."""
    return torch.where(w >= (1 << 31), w - MOD, w).to(torch.int32)

"""The checksum of many regions in one device launch (Triton).

One program per segment (``verify.segments``): it reads each word of its rows once,
multiplies it by its column weight and its row weight in uint32 (which wraps mod
``2**32``: the checksum's ring, so the order of the products and sums does not
matter) and writes one partial sum; the caller adds the partials per output slot.
Bit for bit :func:`torchrefit.verify.checksum.region_sum` (``tests/test_verify_fused.py``
checks it under Triton's interpreter on CPU; on a GPU every ``verify()`` of the GPU tests
runs it, ``tests/test_gpu_refit.py``'s among them).

Addresses in the segment table are words from ``base_word``; the program reads
``base + (address - base_word)``, so one launch reads regions of any number of
tensors (they may lie below ``base``: offsets are signed).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import triton_runs

__all__ = ["available", "launch", "TILES", "FIELDS", "VECTOR"]

#: int64 fields per segment: address, row stride, rows, row-weight index,
#: column-weight index, first word, end word, output slot
FIELDS = 8
#: words of a 16-byte vector access: a segment whose address, row stride and word range
#: are multiples of it (in bytes: 16) is "aligned" and read with vector loads
VECTOR = {2: 8, 1: 16}

#: (rows, words) of one program's tile: wide rows, and narrow ones (last dim below 128 words)
TILES = {"wide": (1, 2048), "narrow": (64, 64)}
NARROW = 128


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def segment_sums(base, table, roww, colw, out, base_word, RB: tl.constexpr, CB: tl.constexpr,
                     WORD: tl.constexpr, VEC: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 8
        address = tl.load(row) - base_word
        stride = tl.load(row + 1)
        rows = tl.load(row + 2)
        rw = tl.load(row + 3)
        cw = tl.load(row + 4)
        c0 = tl.load(row + 5)
        c1 = tl.load(row + 6)
        if VEC > 1:  # segments.aligned holds: 16-byte vector loads are safe
            address = tl.multiple_of(address, VEC)
            stride = tl.multiple_of(stride, VEC)
            c0 = tl.multiple_of(c0, VEC)
            c1 = tl.multiple_of(c1, VEC)
            cw = tl.multiple_of(cw, VEC)
        c = tl.arange(0, CB)
        # while, not range(): Triton's interpreter (the CPU tests) cannot take a loaded
        # scalar as a range bound
        r0 = rows * 0
        if RB == 1:  # wide rows: one row at a time, the row weight a scalar
            acc = tl.zeros([CB], dtype=tl.uint32)
            while r0 < rows:
                wr = tl.load(roww + rw + r0).to(tl.uint32, bitcast=True)
                start = address + r0 * stride
                k = c0
                while k < c1:
                    if VEC > 1:
                        k = tl.multiple_of(k, VEC)
                    cc = k + c
                    cmask = cc < c1
                    wc = tl.load(colw + cw + cc, mask=cmask, other=0).to(tl.uint32, bitcast=True)
                    x = tl.load(base + start + cc, mask=cmask, other=0)
                    if WORD == 2:  # int16 words are read unsigned
                        x = x.to(tl.uint16, bitcast=True)
                    acc += x.to(tl.uint32) * wc * wr
                    k += CB
                r0 += 1
            total = tl.sum(acc, axis=0)
        else:  # narrow rows: a tile of RB rows, weighted per row after summing each row
            r = tl.arange(0, RB)
            per_row = tl.zeros([RB], dtype=tl.uint32)
            while r0 < rows:
                rr = r0 + r
                rmask = rr < rows
                start = address + rr.to(tl.int64) * stride
                acc2 = tl.zeros([RB, CB], dtype=tl.uint32)
                k = c0
                while k < c1:
                    cc = k + c
                    cmask = cc < c1
                    # a 2-D (row-stride 0) load: the layout of the words, no shuffle
                    wc2 = tl.load(colw + cw + cc[None, :] + r[:, None] * 0, mask=cmask[None, :], other=0)
                    x2 = tl.load(base + start[:, None] + cc[None, :], mask=rmask[:, None] & cmask[None, :],
                                 other=0)
                    if WORD == 2:
                        x2 = x2.to(tl.uint16, bitcast=True)
                    acc2 += x2.to(tl.uint32) * wc2.to(tl.uint32, bitcast=True)
                    k += CB
                wr2 = tl.load(roww + rw + rr, mask=rmask, other=0).to(tl.uint32, bitcast=True)
                per_row += tl.sum(acc2, axis=1) * wr2
                r0 += RB
            total = tl.sum(per_row, axis=0)
        tl.store(out + tl.program_id(0), total.to(tl.int32, bitcast=True))

    return segment_sums


def available(device_type: str) -> bool:
    """Whether the kernel can run on this device type: CUDA with Triton, or any device
    under Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    return triton_runs(device_type, _kernel)


def launch(base: torch.Tensor, base_word: int, table: torch.Tensor, roww: torch.Tensor, colw: torch.Tensor,
           word: int, tile: str, vector: bool) -> torch.Tensor:
    """int32 partial sums (uint32 bits), one per segment of ``table`` (int64
    ``[segments, FIELDS]``), on the current stream. ``base`` is an int16 (``word`` 2) or
    uint8 (``word`` 1) tensor; ``vector``: every segment is aligned (``segments.aligned``)
    and ``base`` 16-byte aligned."""
    assert table.shape[1] == FIELDS
    out = torch.empty(table.shape[0], dtype=torch.int32, device=table.device)
    if table.shape[0]:
        rb, cb = TILES[tile]
        _kernel()[(table.shape[0],)](base, table, roww, colw, out, base_word, RB=rb, CB=cb, WORD=word,
                                     VEC=VECTOR[word] if vector else 1, num_warps=4)
    return out

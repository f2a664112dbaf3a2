"""Many dense copies in one kernel launch, planned once when a program is compiled.

A MoE model is thousands of 1-20 MB expert tensors. Copied one by one (one copy
kernel or graph node each), every copy pays its start and its drain: on an H200 a
3 MB copy alone reaches ~0.8 TB/s of the 4.3 TB/s a large one does, and eight
parallel branches of such copies still ran 1.15x the floor for qwen3-shaped
models (``benchmarks/diagnose_moe_copies.py``). Here every such copy is cut into
fixed-size tiles and one kernel launch moves all tiles, one program per tile, so
the device sees one copy of all their bytes; inside a CUDA graph it is one node.
Opt-in (``TORCHREFIT_BATCHED_COPY=1``): measured slower than the per-copy graph on an
H200 so far (see :func:`kernel_available`).

:func:`batchable` is the rule for which copies qualify, :func:`plan_tiles` the
pure tiling (integer addresses in, a table out; the CPU suite checks it against
an oracle), :func:`compile_batch` builds the device table and warms the kernel
(Triton, imported lazily: where it is missing the copies take the per-copy path).
Called by ``execute.local.compile_copies`` on every rank while compiling; the
launch (:meth:`Batch.launch`) runs inside the program's stream session.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["Batch", "batchable", "plan_tiles", "compile_batch", "kernel_available",
           "WORD", "ALIGN", "TILE_BYTES", "BATCH_MAX_BYTES"]

#: bytes the kernel moves per element (int32 words; four make one 16-byte vector access)
WORD = 4
#: addresses and sizes of a batched copy are multiples of this (16-byte vector loads)
ALIGN = 16
#: words per load step of one program, steps per tile, warps per program: 512 KB tiles of
#: 16 warps ran 1.039-1.043x the floor on one H200 for qwen3-30b-a3b-shaped copies, against
#: 1.066x with 64 KB tiles of 8 warps (``benchmarks/mid_copy_lab.py``, ``tile_kernel_lab.py``)
BLOCK, STEPS, WARPS = 8192, 16, 16
#: bytes one program (one tile) copies; runs are cut into tiles of this size
TILE_BYTES = BLOCK * STEPS * WORD
#: copies at least this large stay per-copy on the parallel branches: each is at the
#: floor alone (3.4-4.3 TB/s for 33-1050 MB tensors), so batching them gains nothing
BATCH_MAX_BYTES = 32 << 20


def batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether one copy can be a batched one: a plain byte copy (same dtype, both dense,
    same device), 16-byte aligned on both sides and in size, below ``BATCH_MAX_BYTES``.
    Casts, strided views and odd sizes take the per-copy path. (Whether the device can
    run the kernel at all is :func:`kernel_available`'s question.)"""
    n = dst.nbytes
    return (dst.dtype == src.dtype and dst.device == src.device
            and 0 < n < BATCH_MAX_BYTES and n == src.nbytes
            and dst.is_contiguous() and src.is_contiguous()
            and (dst.data_ptr() | src.data_ptr() | n) % ALIGN == 0)


def plan_tiles(copies: Sequence[tuple[int, int, int]], anchor: int, tile_bytes: int = TILE_BYTES) -> torch.Tensor:
    """The tile table of ``copies`` given as (destination address, source address, bytes):
    one int64 row (source offset, destination offset, words) per tile, offsets in words
    from ``anchor`` (the kernel's base pointer), every copy cut into tiles of
    ``tile_bytes`` in order, its last tile the remainder. Pure: no device involved."""
    if tile_bytes % ALIGN:
        raise ValueError(f"tile of {tile_bytes} bytes is not a multiple of {ALIGN}")
    if anchor % ALIGN:
        raise ValueError(f"anchor {anchor:#x} is not {ALIGN}-byte aligned")
    for dst, src, n in copies:
        if n <= 0 or (dst | src | n) % ALIGN:
            raise ValueError(f"copy {src:#x} -> {dst:#x} of {n} bytes is not {ALIGN}-byte aligned")
    if not copies:
        return torch.zeros((0, 3), dtype=torch.int64)
    c = torch.tensor(list(copies), dtype=torch.int64)
    dst, src, n = c.unbind(1)
    tiles = (n + tile_bytes - 1) // tile_bytes
    owner = torch.repeat_interleave(torch.arange(len(copies)), tiles)
    first = torch.cumsum(tiles, 0) - tiles  # index of each copy's first tile
    start = (torch.arange(len(owner)) - first[owner]) * tile_bytes  # byte offset in its copy
    words = torch.minimum(n[owner] - start, torch.tensor(tile_bytes)) // WORD
    return torch.stack([(src[owner] + start - anchor) // WORD,
                        (dst[owner] + start - anchor) // WORD, words], dim=1)


@dataclass(frozen=True)
class Batch:
    """A compiled batch: ``table`` (tiles, on the device), ``anchor`` (the int32 tensor
    whose address the table's offsets count from) and the copies it moves, held so
    their memory stays alive as long as the table points into it."""

    table: torch.Tensor
    anchor: torch.Tensor
    dst: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    names: tuple[str, ...]

    @property
    def tiles(self) -> int:
        return self.table.shape[0]

    def launch(self) -> None:
        """Queue the one kernel on the current stream (capturable in a CUDA graph)."""
        _kernel()[(self.tiles,)](self.anchor, self.table, BLOCK=BLOCK, STEPS=STEPS, num_warps=WARPS)


def kernel_available(device: torch.device) -> bool:
    """Whether batched copies run on ``device``: switched on by
    ``TORCHREFIT_BATCHED_COPY=1``, CUDA, and Triton importable.

    Off by default: importing Triton and loading the kernel add ~0.45 s to a process's
    first refit (1.3 s with Triton's cache empty), and what it gains is small. On one
    H200 with 64 KB tiles it was slower than the per-copy graph (qwen3-shaped MoE 1.348x
    the floor against 1.29x, ``benchmarks/results/h200/h200_shapes.log``); with today's
    512 KB tiles, every qwen3-shaped copy batched ran 1.042x on the device against 1.057x
    as SM kernels (``execute.kernel_copies``), DeepSeek-V3-shaped copies 1.041x against
    1.014x as memcpy nodes (``benchmarks/mid_copy_lab.py``). It stays a tested, opt-in
    path."""
    return (device.type == "cuda" and os.environ.get("TORCHREFIT_BATCHED_COPY", "0") == "1"
            and _kernel() is not None)


def compile_batch(copies: Sequence[tuple[torch.Tensor, torch.Tensor, str]], device: torch.device) -> Batch | None:
    """Plan the tiles of ``copies`` (all :func:`batchable`), upload the table and load
    the kernel with a launch on scratch memory, so that capturing ``launch`` in a
    graph compiles and loads nothing. None where there is nothing to batch."""
    if not copies:
        return None
    anchor = torch.zeros(2 * ALIGN // WORD, dtype=torch.int32, device=device)
    table = plan_tiles([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s, _ in copies], anchor.data_ptr())
    _warm(anchor)
    dst, src, names = zip(*copies)
    return Batch(table.to(device), anchor, dst, src, names)


def _warm(anchor: torch.Tensor) -> None:
    """Compile and load the kernel by copying the anchor's first 16 bytes onto its next
    16 (scratch: nothing of the user's is touched) on the current stream."""
    scratch = torch.tensor([[0, ALIGN // WORD, ALIGN // WORD]], dtype=torch.int64, device=anchor.device)
    _kernel()[(1,)](anchor, scratch, BLOCK=BLOCK, STEPS=STEPS, num_warps=WARPS)


@lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_tiles(anchor, table, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        # One program per tile. Offsets are in words from `anchor` (they may be negative:
        # the copies live anywhere in the device's address space); the hints let Triton
        # use 16-byte vector loads and stores, which plan_tiles guarantees are aligned.
        row = table + 3 * tl.program_id(0)
        src = tl.multiple_of(tl.load(row), 4)
        dst = tl.multiple_of(tl.load(row + 1), 4)
        n = tl.multiple_of(tl.load(row + 2), 4)
        for step in tl.static_range(STEPS):
            offs = step * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(anchor + dst + offs, tl.load(anchor + src + offs, mask=mask), mask=mask)

    return copy_tiles

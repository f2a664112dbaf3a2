"""Many dense copies in one kernel launch, planned once when a program is compiled.

A MoE model is thousands of 1-20 MB expert tensors. Copied one by one, every copy pays
its start and its drain, as a memcpy graph node even on parallel branches and (less) as
an elementwise kernel each (``execute.kernels.elementwise_copies``). Here every such copy is cut into
4 KB tiles and one launch of ``execute.kernels.copy_runs`` moves all of them, one block per
tile, so the device sees one copy of all their bytes; inside a CUDA graph it is one node.

Which copies (:func:`batch_from`, ``settings.batched_copy``): ``auto`` (default)
batches every :func:`batchable` large copy of a program made of many mid-sized copies
(``elementwise_copies.mostly_mid_sized`` with at least ``BATCH_MIN_COPIES`` of them: the MoE
case, and a small dense model's) and nothing elsewhere, where large copies are memcpy
nodes at the floor already; ``all`` batches every batchable copy; ``none`` none.

Strided copies (a TP half into ``full[:, :half]``, or out of it) are batched in
``auto`` and ``all`` wherever :func:`strided_runs` cuts them into rows of at least
``MIN_RUN_BYTES`` contiguous on both sides, 16-byte aligned: a 2-D half is one run of
its rows at both sides' pitches, which the device cuts into tiles (the host plans and
uploads one row per copy, not one per 4 KB row, which would make building the table a
large part of a first refit). Their other path is an elementwise kernel on widened
views (``elementwise_copies.widened``).

:func:`compile_batch` uploads the table and loads the kernel; where the kernel cannot be
built (no NVRTC) the copies take the per-copy path. Called by
``execute.local.compile_copies`` on every rank while compiling; the launch
(:meth:`Batch.launch`) runs inside the program's ``SideStreams.session()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import settings
from .._util.strides import dense_rows, row_offsets
from .kernels import elementwise_copies
from .kernels.copy_runs import VECTOR, ByteRuns, CopyKernel, TileTable, copy_kernel, plan_tiles

__all__ = ["Batch", "batchable", "batch_from", "batch_mode", "strided_runs", "byte_runs", "plan_tiles",
           "compile_batch", "kernel_available", "ALIGN", "BATCH_MIN_COPIES",
           "MIN_RUN_BYTES"]

#: addresses and sizes of a batched copy are multiples of this (16-byte vector accesses)
ALIGN = VECTOR
#: strided copies are batched where their rows (runs contiguous on both sides) are at
#: least this long: a shorter row leaves most of its 4 KB tile's block idle
MIN_RUN_BYTES = 2048
#: a program of at least this many large copies, mostly mid-sized, is batched (auto):
#: fewer than ``elementwise_copies.KERNEL_MIN_COPIES``, which asks for one kernel per copy: one
#: launch pays for itself with fewer copies than a kernel per copy does (a 0.5 B dense
#: model's ~100 copies, most of their bytes below 24 MiB, run faster batched); dense
#: models whose copies are not mid-sized (a gpt-4b or llama-8b shape) stay memcpy nodes
BATCH_MIN_COPIES = 64


def batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether one copy can be a batched one: a plain byte copy (same dtype, both dense,
    same device), 16-byte aligned on both sides and in size. Casts, strided views and
    odd sizes take the per-copy path. (Whether the device can run the kernel at all is
    :func:`kernel_available`'s question.)"""
    n = dst.nbytes
    return (dst.dtype == src.dtype and dst.device == src.device and 0 < n == src.nbytes
            and dst.is_contiguous() and src.is_contiguous()
            and (dst.data_ptr() | src.data_ptr() | n) % ALIGN == 0)


def strided_runs(dst: torch.Tensor, src: torch.Tensor) -> ByteRuns | None:
    """A strided plain copy (same dtype, shape and device; not both dense) as byte runs of
    rows contiguous on both sides (the innermost dims both keep dense), in row-major
    order: one run per index of the outer dims but the last, which its rows and pitches
    cover (a 2-D half: one run). None where a row is shorter than ``MIN_RUN_BYTES`` or
    not 16-byte aligned (size or any address), or the destination's rows overlap (a
    broadcast)."""
    if (dst.dtype != src.dtype or dst.shape != src.shape or dst.device != src.device or dst.numel() == 0
            or (dst.is_contiguous() and src.is_contiguous())):
        return None
    shape, ds, ss, row = dense_rows(dst.shape, dst.stride(), src.stride())
    size = dst.element_size()
    if not shape or row * size < MIN_RUN_BYTES or (row * size) % ALIGN or not _disjoint(shape, ds, row):
        return None
    # every row starts aligned iff both first rows do and every outer step is aligned
    # (each start is the first plus a sum of steps): checked here, not per row
    if (dst.data_ptr() | src.data_ptr()) % ALIGN or any(x * size % ALIGN for x in (*ds, *ss)):
        return None
    # one run per row of the outer dims but the last, whose rows its pitches step over:
    # a 2-D half is one run, so the host plans and uploads O(copies), not O(rows)
    d = row_offsets(shape[:-1], [x * size for x in ds[:-1]], dst.data_ptr())
    s = row_offsets(shape[:-1], [x * size for x in ss[:-1]], src.data_ptr())
    return ByteRuns(d, s, torch.full_like(d, row * size), torch.full_like(d, shape[-1]),
                    torch.full_like(d, ds[-1] * size), torch.full_like(d, ss[-1] * size))


def byte_runs(dst: torch.Tensor, src: torch.Tensor) -> ByteRuns:
    """The runs of a copy :func:`batchable` or with :func:`strided_runs`."""
    if dst.is_contiguous() and src.is_contiguous():
        return ByteRuns.of([(dst.data_ptr(), src.data_ptr(), dst.nbytes)])
    runs = strided_runs(dst, src)
    if runs is None:
        raise ValueError("a copy that is neither dense nor cut into aligned rows cannot be batched")
    return runs


def _disjoint(shape: list[int], strides: list[int], row: int) -> bool:
    """Whether rows of ``row`` elements at these outer dims never overlap: each stride,
    smallest first, steps past everything the dims inside it reach (no broadcast)."""
    reach = row
    for stride, n in sorted(zip(strides, shape)):
        if stride < reach:
            return False
        reach = stride * (n - 1) + reach
    return True


def batch_mode() -> str:
    """``settings.batched_copy`` (``auto``, ``all`` or ``none``), read when compiling."""
    return settings.current().batched_copy


def batch_from(sizes: Sequence[int], small: int, mode: str | None = None) -> int | None:
    """Bytes from which a batchable copy is batched in a program whose large copies (at
    least ``small`` bytes), as planned, have ``sizes`` bytes; None: none is. ``mode``:
    :func:`batch_mode`'s (read now where None)."""
    mode = batch_mode() if mode is None else mode
    if mode == "all":
        return 0
    if mode == "auto" and elementwise_copies.mostly_mid_sized(sizes, BATCH_MIN_COPIES):
        return small
    return None


@dataclass(frozen=True)
class Batch:
    """A compiled batch: ``table`` (its runs and each tile's run, on the device: 4 bytes
    per 4 KB tile, 0.1% of the bytes it copies), the loaded ``kernel``, and the copies it
    moves, held so their memory stays alive as long as the table points into it."""

    table: TileTable
    kernel: CopyKernel
    runs: int
    dst: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    names: tuple[str, ...]

    @property
    def tiles(self) -> int:
        return self.table.tiles

    def launch(self) -> None:
        """Queue the one kernel on the current stream (capturable in a CUDA graph)."""
        self.kernel.launch(self.table, torch.cuda.current_stream(self.table.owner.device))


def kernel_available(device: torch.device) -> bool:
    """Whether batched copies can run on ``device``: CUDA, and the kernel compiled and
    loaded there (NVRTC found; see ``execute.kernels.copy_runs``)."""
    return device.type == "cuda" and copy_kernel(device) is not None


def compile_batch(copies: Sequence[tuple[torch.Tensor, torch.Tensor, str]], device: torch.device,
                  runs: Sequence[ByteRuns | None] | None = None) -> Batch | None:
    """Plan the tiles of ``copies`` (each :func:`batchable` or with
    :func:`strided_runs`) and upload the table, with the kernel loaded, so that
    capturing ``launch`` in a graph compiles and loads nothing. ``runs``: per copy,
    its runs where the caller has them already (a strided copy's :func:`strided_runs`),
    else None. None where there is nothing to batch."""
    if not copies:
        return None
    kernel = copy_kernel(device)
    if kernel is None:
        raise RuntimeError("the batched copy kernel is not available: check kernel_available() first")
    known = runs if runs is not None else [None] * len(copies)
    every = ByteRuns.cat([r if r is not None else byte_runs(d, s) for (d, s, _), r in zip(copies, known)])
    table = kernel.tiles(every, device)
    dst, src, names = zip(*copies)
    return Batch(table, kernel, len(every), dst, src, names)

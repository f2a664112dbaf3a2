"""Many dense copies in one kernel launch, planned once when a program is compiled.

A MoE model is thousands of 1-20 MB expert tensors. Copied one by one, every copy pays
its start and its drain: on one H200, qwen3-30b-a3b-shaped copies (3-12 MiB) ran 1.10-1.15x
the copy floor as memcpy graph nodes even on 8 parallel branches, and 1.04-1.06x as one
elementwise kernel each (``execute.kernel_copies``; BENCHMARKS.md "Mid-sized copies").
Here every such copy is cut into 4 KB tiles and one launch of ``execute.copy_kernel``
moves all of them, one block per tile, so the device sees one copy of all their bytes;
inside a CUDA graph it is one node. 3072 separate 3 MiB tensors copied this way took
1.007-1.012x one ``cudaMemcpyAsync`` of the same bytes (``benchmarks/copy_kernel_lab.py``).

Which copies (:func:`batch_from`, ``TORCHREFIT_BATCHED_COPY``): ``auto`` (default)
batches every :func:`batchable` large copy of a program made of many mid-sized copies
(``kernel_copies.mostly_mid_sized``: the MoE case) and nothing elsewhere, where large
copies are memcpy nodes at the floor already; ``1`` batches every batchable copy;
``0`` none. :func:`compile_batch` uploads the table and loads the kernel; where the
kernel cannot be built (no NVRTC) the copies take the per-copy path. Called by
``execute.local.compile_copies`` on every rank while compiling; the launch
(:meth:`Batch.launch`) runs inside the program's stream session.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import kernel_copies
from .copy_kernel import VECTOR, CopyKernel, copy_kernel, plan_tiles

__all__ = ["Batch", "batchable", "batch_from", "plan_tiles", "compile_batch", "kernel_available",
           "ALIGN", "BATCH_ENV", "MODES"]

#: addresses and sizes of a batched copy are multiples of this (16-byte vector accesses)
ALIGN = VECTOR
BATCH_ENV = "TORCHREFIT_BATCHED_COPY"
MODES = ("auto", "1", "0")


def batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether one copy can be a batched one: a plain byte copy (same dtype, both dense,
    same device), 16-byte aligned on both sides and in size. Casts, strided views and
    odd sizes take the per-copy path. (Whether the device can run the kernel at all is
    :func:`kernel_available`'s question.)"""
    n = dst.nbytes
    return (dst.dtype == src.dtype and dst.device == src.device and 0 < n == src.nbytes
            and dst.is_contiguous() and src.is_contiguous()
            and (dst.data_ptr() | src.data_ptr() | n) % ALIGN == 0)


def batch_from(sizes: Sequence[int], small: int) -> int | None:
    """Bytes from which a batchable copy is batched in a program whose large copies (at
    least ``small`` bytes), as planned, have ``sizes`` bytes; None: none is. Read when
    compiling from ``TORCHREFIT_BATCHED_COPY`` (module text); a value that is no mode
    warns and counts as ``auto`` (compiling runs inside ``refit()``: raising on one rank
    would leave its peers waiting; either choice copies the same bytes)."""
    mode = os.environ.get(BATCH_ENV, "auto").strip() or "auto"
    if mode not in MODES:
        warnings.warn(f"torchrefit: {BATCH_ENV}={mode!r} is not one of {', '.join(MODES)}; using auto",
                      stacklevel=2)
        mode = "auto"
    if mode == "1":
        return 0
    if mode == "auto" and kernel_copies.mostly_mid_sized(sizes):
        return small
    return None


@dataclass(frozen=True)
class Batch:
    """A compiled batch: ``table`` (tiles, on the device: 24 bytes per 4 KB tile, 0.6% of
    the bytes it copies), the loaded ``kernel``, and the copies it moves, held so their
    memory stays alive as long as the table points into it."""

    table: torch.Tensor
    kernel: CopyKernel
    dst: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    names: tuple[str, ...]

    @property
    def tiles(self) -> int:
        return self.table.shape[0]

    def launch(self) -> None:
        """Queue the one kernel on the current stream (capturable in a CUDA graph)."""
        self.kernel.launch(self.table, torch.cuda.current_stream(self.table.device))


def kernel_available(device: torch.device) -> bool:
    """Whether batched copies can run on ``device``: CUDA, and the kernel compiled and
    loaded there (NVRTC found; see ``execute.copy_kernel``)."""
    return device.type == "cuda" and copy_kernel(device) is not None


def compile_batch(copies: Sequence[tuple[torch.Tensor, torch.Tensor, str]], device: torch.device) -> Batch | None:
    """Plan the tiles of ``copies`` (all :func:`batchable`) and upload the table, with
    the kernel loaded, so that capturing ``launch`` in a graph compiles and loads
    nothing. None where there is nothing to batch."""
    if not copies:
        return None
    kernel = copy_kernel(device)
    if kernel is None:
        raise RuntimeError("the batched copy kernel is not available: check kernel_available() first")
    table = kernel.tiles([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s, _ in copies], device)
    dst, src, names = zip(*copies)
    return Batch(table, kernel, dst, src, names)

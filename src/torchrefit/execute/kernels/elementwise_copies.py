"""Copies as elementwise kernels on other views of the same bytes: strided ones widened,
and plain ones where a program is made of many mid-sized copies.

**Plain copies.** A memcpy node of a few MiB runs below the device's copy bandwidth,
even with eight of them on parallel graph branches, while an elementwise kernel over the
same bytes does not; on large copies (tens of MiB and up) memcpy streams a few percent
faster than the kernel. Mixing the two in one graph is slower than either, so a program
takes all or none:

- a program of many mid-sized copies (the large ones as planned, before runs merge, at
  least ``KERNEL_MIN_COPIES`` of them with at least half of their bytes in copies below
  ``MID_COPY_BYTES``: :func:`mostly_mid_sized`; the MoE experts' case) runs every plain
  large copy that the batched launch (``execute.batched``) does not take as a kernel;
- every other program keeps memcpy nodes (dense models' projections, experts of 28 MiB
  and more).

``settings.sm_copy_below`` (bytes) replaces that rule: every plain large copy below it
is a kernel; 0, none is. ``benchmarks/`` times both forms per preset; a CPU test checks
the rule's choice for every preset of the matrix.

**Strided copies** (a TP half into ``full[:, :half]``) whose rows the batched kernel
takes (``batched.strided_runs``: aligned rows of at least 2 KB) run there; the others
run on the widest views of the same bytes that fit, 16-byte complex128 elements first
(:func:`widened`): an elementwise copy's cost follows its element count, so a bf16 half
moved as complex128 takes an eighth of the elements for the same bytes, and every bit
pattern survives (a same-dtype copy only moves elements). A 2-D ``cuMemcpy2DAsync`` of
such a half is no faster than the bf16 kernel.

The kernel is ``torch.bitwise_or(src, 0, out=dst)`` on integer views of the same
bytes: an exact copy of every bit pattern (NaN payloads and FP8 included), with no
kernel of torchrefit's own to load. Called by ``execute.local.compile_copies`` while
compiling, on every rank; ``run`` on the copy's side stream (or inside the graph).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import settings

__all__ = ["MID_COPY_BYTES", "KERNEL_MIN_COPIES", "ALL", "sm_copy_below", "mostly_mid_sized",
           "word_views", "widened", "run"]

_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
#: what strided copies are widened to: a complex128 element is 16 bytes, one vector access;
#: a same-dtype copy only moves it (no arithmetic), so every bit pattern survives
_WIDE = ((torch.complex128, 16), *_WORDS)
#: copies below this size are mid-sized: as memcpy nodes they run below full bandwidth
MID_COPY_BYTES = 24 << 20
#: fewer large copies than this stay memcpy nodes: each one's overhead is small next to
#: the kernels' lower streaming rate (2.5-4% below memcpy on large copies)
KERNEL_MIN_COPIES = 256
#: a threshold above every copy: all plain large copies run as kernels
ALL = 1 << 62


def mostly_mid_sized(sizes: Sequence[int], least: int = KERNEL_MIN_COPIES) -> bool:
    """Whether a program whose large copies, as planned (before runs merge), have
    ``sizes`` bytes is made of many mid-sized copies: at least ``least`` of them, with
    at least half their bytes in copies below ``MID_COPY_BYTES``. Pure."""
    if len(sizes) < least:
        return False
    mid = sum(n for n in sizes if n < MID_COPY_BYTES)
    return 2 * mid >= sum(sizes)


def sm_copy_below(sizes: Sequence[int]) -> int:
    """Bytes below which a plain large copy of a program whose large copies, as planned,
    have ``sizes`` runs as a kernel (0: none), read when compiling:
    ``settings.sm_copy_below`` where set, else all of them (``ALL``) where they are
    :func:`mostly_mid_sized`, else none."""
    below = settings.current().sm_copy_below
    if below is None:
        return ALL if mostly_mid_sized(sizes) else 0
    return below


def word_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(dst, src)`` as flat integer tensors of the widest word both sizes and addresses
    allow, or None where the copy is no plain byte copy (a cast, a strided view)."""
    if (dst.dtype != src.dtype or dst.device != src.device or dst.nbytes != src.nbytes
            or not (dst.is_contiguous() and src.is_contiguous()) or dst.numel() == 0):
        return None
    d, s = _bytes(dst), _bytes(src)
    for dtype, size in _WORDS:
        if d.numel() % size == 0 and all(t.data_ptr() % size == 0 and t.storage_offset() % size == 0
                                         for t in (d, s)):
            return d.view(dtype), s.view(dtype)
    return None


def widened(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A strided plain copy (same dtype and shape, not both dense: e.g. a TP half into
    ``full[:, :half]``) as the same copy on views of the widest element (16-byte
    complex128, then integers), wider than its own, that both tensors' last dim (stride
    1), other strides and offsets allow: the same bytes move, in fewer and wider
    elements (an elementwise kernel either way: only dense pairs are memcpys). None
    where none fits or nothing is strided."""
    if (dst.dtype != src.dtype or dst.shape != src.shape or dst.dim() == 0 or dst.numel() == 0
            or (dst.is_contiguous() and src.is_contiguous())):
        return None
    for dtype, size in _WIDE:
        if size <= dst.element_size():
            return None
        try:
            return dst.view(dtype), src.view(dtype)
        except RuntimeError:  # the last dim, a stride or the offset does not divide
            continue
    return None


def run(words: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One kernel copy on the current stream."""
    dst, src = words
    torch.bitwise_or(src, 0, out=dst)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)

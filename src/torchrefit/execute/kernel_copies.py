"""Copies as elementwise kernels on other views of the same bytes: strided ones widened,
and plain ones where a program is made of many mid-sized copies (both by default).

**Plain copies.** A program of many mid-sized copies (large ones as planned, before runs
merge, at least half of their bytes in copies below ``MID_COPY_BYTES``:
:func:`mostly_mid_sized`) moves its plain large copies in one batched launch where it
can, from ``batched.BATCH_MIN_COPIES`` of them (``execute.batched``, 1.011-1.015x on the
device for the qwen3-shaped preset on an H200); in a program of at least
``KERNEL_MIN_COPIES`` such copies, the large plain copies the batch does not take (all of
them where the batched kernel cannot be built) run as elementwise kernels instead of
memcpy nodes; other programs keep memcpy nodes (:func:`sm_copy_below`). The figures
below are from before the batched kernel, with every plain large copy per copy:
Measured on one H200 (``benchmarks/mid_copy_lab.py``, ``benchmarks/h200_mid_check.sh``;
BENCHMARKS.md "Mid-sized copies"), device time of the program's graph over the copy
floor, memcpy nodes against all kernels:

- qwen3-30b-a3b-shaped toy models, 8 layers (2066 planned large copies: 2064 of 3-12
  MiB, two 594 MiB embeddings), in two allocator layouts: 1424 copies after merging,
  1.155x against 1.060x; 524 merged runs (the shape matrix's layout), 1.102x against
  1.044x. The same 1424 copies as memcpy nodes between
  two flat buffers (no scatter) took the same 1.146x, while one copy of all those bytes
  took 1.000x: memcpy nodes of a few MB each run below full bandwidth even on 8 parallel
  branches, and kernels do not. Mixing the two in one graph is worse than either
  (kernels below 16 MB next to 72 memcpy nodes: 1.115x), hence all or none.
- Fewer or larger copies stay memcpy, faster there: DeepSeek-V3-shaped 28 and 56 MiB
  experts 1.019x against 1.040x, a 0.5 B dense model's copies (97 planned) 1.036-1.059x
  against 1.048-1.069x, the seed model's and llama-8b's 32-1002 MiB copies ~1.00x.
  Batched in one launch, though, that 0.5 B model's copies took 1.019x against
  1.063-1.065x as memcpy nodes (twentieth session): the batch asks for fewer copies
  (``batched.BATCH_MIN_COPIES``) than these per-copy kernels do.

The bounds sit between those measurements (qwen3's mid copies at most 12 MiB, DeepSeek's
at least 28 MiB; the dense presets have at most 130 large copies); the rule in this form
chose as the measurements did for every preset of the matrix (a CPU test checks its choice
per preset), but was not itself re-timed on a GPU (see BENCHMARKS.md).
``TORCHREFIT_SM_COPY_BELOW=<bytes>`` overrides it: every plain large copy below that size
is a kernel; 0, none is.

**Strided copies** (a TP half into ``full[:, :half]``) whose rows the batched kernel
takes (``batched.strided_runs``: aligned rows of at least 2 KB) run there, 1.098x their
floor for the seed's halves on one H200 (BENCHMARKS.md "Eleventh session"); the others
run on the widest views of the same bytes that fit, 16-byte complex128 elements first (:func:`widened`; off with
``TORCHREFIT_STRIDED_WORDS=0``). On one H200, 40 such copies of the seed's model took
2.07 ms on bf16 elements, 1.03 ms on int64 views, 0.98 ms on complex128 views (1.25x the
copy floor; 0.93 ms the same bytes contiguous), exact for random bits; a 2-D
``cuMemcpy2DAsync`` took 2.17 ms (``benchmarks/strided_copies.py``). Collocated TP2 -> TP1
through ipc went from 1.82x to 1.20x the floor (BENCHMARKS.md "Transports run 7").

The kernel is ``torch.bitwise_or(src, 0, out=dst)`` on integer views of the same
bytes: an exact copy of every bit pattern (NaN payloads and FP8 included), with no
kernel of torchrefit's own to load. Called by ``execute.local.compile_copies`` while
compiling, on every rank; ``run`` on the copy's side stream (or inside the graph).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

__all__ = ["SM_COPY_ENV", "STRIDED_WORDS_ENV", "MID_COPY_BYTES", "KERNEL_MIN_COPIES", "ALL", "sm_copy_below",
           "mostly_mid_sized", "strided_words", "word_views", "widened", "run"]

SM_COPY_ENV = "TORCHREFIT_SM_COPY_BELOW"
STRIDED_WORDS_ENV = "TORCHREFIT_STRIDED_WORDS"
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
    ``TORCHREFIT_SM_COPY_BELOW`` where set, else all of them (``ALL``) where they are
    :func:`mostly_mid_sized`, else none. A value that is no byte count is ignored with a
    warning naming it rather than raised: compiling runs inside ``refit()`` on one rank,
    whose peers would otherwise wait for it until their timeout (either choice copies the
    same bytes)."""
    raw = os.environ.get(SM_COPY_ENV, "").strip()
    if not raw:
        return ALL if mostly_mid_sized(sizes) else 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        warnings.warn(f"torchrefit: {SM_COPY_ENV}={raw!r} is not a number of bytes >= 0; "
                      "copying with memcpy", stacklevel=2)
        return 0
    return n


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


def strided_words() -> bool:
    """Whether strided plain copies run on wider views (:func:`widened`), read when
    compiling: on unless ``TORCHREFIT_STRIDED_WORDS=0``."""
    return os.environ.get(STRIDED_WORDS_ENV, "1").strip() != "0"


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

"""Plain copies run as elementwise kernels instead of memcpy nodes (opt-in, issue 16).

On one H200 (``benchmarks/results/h200/h200_refit_phases_a5b9d01.json``) the 1424 copies
of a qwen3-30b-a3b-shaped refit (3-20 MB each), captured on 8 graph branches, took
5.47 ms as elementwise kernels against 5.93 ms as memcpy nodes (1.059x against 1.147x
the copy floor); DeepSeek-V3's 29-59 MB copies were slower as kernels (1.043x against
1.016x). So the choice is by size, and off until a matrix run measures it in the
executor: ``TORCHREFIT_SM_COPY_BELOW=<bytes>`` makes every plain copy (same dtype,
both dense) of fewer bytes a kernel; unset or 0, none is.

The kernel is ``torch.bitwise_or(src, 0, out=dst)`` on integer views of the same
bytes: an exact copy of every bit pattern (NaN payloads and FP8 included), with no
kernel of torchrefit's own to load. Called by ``execute.local.compile_copies`` while
compiling, on every rank; ``run`` on the copy's side stream (or inside the graph).
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["SM_COPY_ENV", "sm_copy_below", "word_views", "run"]

SM_COPY_ENV = "TORCHREFIT_SM_COPY_BELOW"
_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def sm_copy_below() -> int:
    """Bytes below which a plain copy runs as a kernel (0: never), read when compiling.
    A value that is no byte count is ignored with a warning naming it rather than raised:
    compiling runs inside ``refit()`` on one rank, whose peers would otherwise wait for it
    until their timeout (either choice copies the same bytes)."""
    raw = os.environ.get(SM_COPY_ENV, "0").strip() or "0"
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


def run(words: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One kernel copy on the current stream."""
    dst, src = words
    torch.bitwise_or(src, 0, out=dst)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)

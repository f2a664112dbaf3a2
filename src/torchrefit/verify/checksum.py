"""A position-aware checksum of tensor regions in global coordinates (pure, no collectives).

Each element of a global tensor is read as 16-bit words (bytes for 1-byte dtypes),
and each word ``x`` at global coordinate ``c`` (the last dim counted in words)
contributes ``x * H_0(c_0) * ... * H_{n-1}(c_{n-1}) mod 2**32``, where every ``H_d`` is
an odd 31-bit hash of the coordinate along dim ``d``. The checksum of a set of
regions is the sum of the contributions mod ``2**32``, so:

* partial sums add exactly: ranks sum their own pieces and an all-reduce adds them,
  whatever way a tensor is cut (the source side and the destination side cut it
  differently and still reach the same total when the values agree);
* any single flipped bit changes the sum: a word changes by ``±2**k`` with
  ``k < 16``, times a product of odd numbers, which is never 0 mod ``2**32``;
* a value written at the wrong place changes it with probability ``1 - 2**-31``
  per mismatch (the weights are pseudo-random per coordinate).

Arithmetic is int64 with every product masked back to 32 bits, so no step relies
on signed overflow (which CPU and CUDA kernels need not agree on).
"""

from __future__ import annotations

import torch

from ..layout._types import Box

__all__ = ["MOD", "region_sum", "coordinate_weights"]

MOD = 1 << 32
_MASK = MOD - 1
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants, as signed int64
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_K3 = 0x94D049BB133111EB - (1 << 64)
#: elements of int64 scratch per step (128 MiB): bounds verify's extra memory
CHUNK_ELEMENTS = 1 << 24


def coordinate_weights(dim: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """``H_dim(c)`` for ``lo <= c < hi``: odd, below ``2**31``, int64."""
    x = torch.arange(lo, hi, dtype=torch.int64, device=device) * _K1 + _signed((dim + 1) * _K2)
    x = x ^ (x >> 31)  # arithmetic shift on both CPU and CUDA: the same bits everywhere
    x = x * _K3
    x = x ^ (x >> 29)
    return (x & 0x7FFFFFFF) | 1


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _words(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's bits as words (int16 or uint8 view) and words per element."""
    if x.dim() == 0:
        x = x.reshape(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    size = x.element_size()
    if size == 1:
        return x.view(torch.uint8), 1
    return x.view(torch.int16), size // 2


def region_sum(x: torch.Tensor, box: Box) -> torch.Tensor:
    """Checksum (0-dim int64 tensor on ``x``'s device, in ``[0, 2**32)``) of ``x``, whose
    elements sit at global coordinates ``box`` (same extents; ``box`` of a 0-dim tensor
    is empty)."""
    words, per = _words(x)
    offset = box.offset if box.ndim else (0,)
    offset = offset[:-1] + (offset[-1] * per,)  # the last dim counted in words
    device = words.device
    weights = [coordinate_weights(d, o, o + s, device) for d, (o, s) in enumerate(zip(offset, words.shape))]
    ndim = words.dim()
    shaped = [w.view([-1 if d == k else 1 for k in range(ndim)]) for d, w in enumerate(weights)]
    total = torch.zeros((), dtype=torch.int64, device=device)
    row = max(1, words[0].numel()) if ndim > 1 else 1
    step = max(1, CHUNK_ELEMENTS // row)
    for lo in range(0, words.shape[0], step):
        hi = min(lo + step, words.shape[0])
        t = words[lo:hi].to(torch.int64).bitwise_and_(0xFFFF)
        for d, w in enumerate(shaped):
            t.mul_(w[lo:hi] if d == 0 else w).bitwise_and_(_MASK)
        total = (total + t.sum()).bitwise_and_(_MASK)
    return total

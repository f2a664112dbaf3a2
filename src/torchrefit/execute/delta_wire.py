"""The wire format of delta refits (docs/delta.md, "Wire format"): one definition for
every diff and apply (the torch ops of ``execute.delta``, the native CPU kernels of
``execute.delta_native``, the Triton kernels of ``execute.kernels.delta_blocks``), so that
any sender's payload is any receiver's.

A message goes *dense* (its bytes as a full refit sends them) or *sparse*: per part, the
count of changed elements per block of :data:`BLOCK` (int32), then each change's 16-bit
position within its block, then the changed values, each section aligned to
``plan.messages.ALIGN`` bytes.
"""

from __future__ import annotations

from ..plan.messages import ALIGN

__all__ = ["BLOCK", "DENSE", "SPARSE", "align", "sparse_nbytes"]

#: elements per position block: positions travel as 16 bits within their block
BLOCK = 1 << 16
DENSE, SPARSE = 0, 1


def align(n: int) -> int:
    """``n`` bytes rounded up to the wire's section alignment."""
    return -(-n // ALIGN) * ALIGN


def sparse_nbytes(numel: int, changed: int, itemsize: int) -> int:
    """Bytes of one part's sparse encoding: block counts, 16-bit positions, values."""
    if not changed:
        return 0
    return align(4 * -(-numel // BLOCK)) + align(2 * changed) + align(itemsize * changed)

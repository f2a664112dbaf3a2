"""Comparing the witness's sums over the refit group (collective).

Called by ``Refitter.verify()`` on every rank of the group, in the same order: one
all-reduce of two int64 sums per destination tensor; where any differ, one more
all-reduce per differing tensor (up to three) to name the region and ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..errors import VerificationError
from ..transport.collectives import collective, collective_device
from .checksum import MOD
from .witness import Witness

__all__ = ["check"]

_NAMED = 3  # differing tensors localized to a region and rank


def check(witness: Witness, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
          group: dist.ProcessGroup, timeout: float | None = None) -> None:
    """Raise :class:`VerificationError` on every rank unless every destination replica
    holds the source's values (cast as a refit casts them) at the right places."""
    device = collective_device(group)
    sums = witness.sums(src, dst, device)
    collective("verify's all-reduce", dist.all_reduce, sums, group=group, timeout=timeout)
    bad = _differing(sums)
    if not bad:
        return
    where = []
    for tensor in bad[:_NAMED]:
        cell = witness.cell_sums(tensor, src, dst, device)
        collective("verify's all-reduce", dist.all_reduce, cell, group=group, timeout=timeout)
        slots = _differing(cell)
        first = witness.describe_slot(tensor, slots[0]) if slots else witness.names[tensor]
        more = f" and {len(slots) - 1} more region(s)" if len(slots) > 1 else ""
        where.append(first + more)
    others = f"; and {len(bad) - _NAMED} more tensor(s)" if len(bad) > _NAMED else ""
    raise VerificationError(
        f"destination differs from source in {len(bad)} tensor(s) (checksums in global "
        f"coordinates): " + "; ".join(where) + others)


def _differing(sums: torch.Tensor) -> list[int]:
    return ((sums[0] - sums[1]) % MOD).nonzero().flatten().tolist()

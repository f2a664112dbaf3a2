"""NCCL transport: one ``batch_isend_irecv`` per round, on GPU message buffers.

PyTorch's NCCL process group orders its internal stream after the caller's
current stream when ops are posted, and ``Work.wait()`` makes the caller's
stream wait for it, so no host synchronisation is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import (
    Availability,
    Exchange,
    RoundsTransport,
    register_transport,
    require_backend,
    require_cuda,
)

__all__ = ["NcclTransport"]


@register_transport
class NcclTransport(RoundsTransport):
    name = "nccl"
    preference = 20
    needs_cuda = True
    backend = "nccl"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        require_cuda(device, "nccl")
        require_backend(group, "nccl", "nccl", "sends its messages")
        # Batched P2P needs the group's communicator to exist on every rank before the
        # first batch, which idle ranks never post: create it now, collectively.
        dist.all_reduce(torch.zeros(1, device=device), group=group)

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_nccl_available(), "this torch build has no NCCL"),
            (torch.cuda.is_available(), "no CUDA GPU is visible"),
        ])

    def wire_device(self) -> torch.device:
        return self.device

    def start(self, sends: Exchange, recvs: Exchange) -> object:
        ops = [dist.P2POp(dist.isend, t, self.global_rank(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(p), self.group) for p, t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def finish(self, handle: object) -> None:
        for w in handle:  # type: ignore[union-attr]
            w.wait()

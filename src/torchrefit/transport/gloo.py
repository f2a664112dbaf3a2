"""Gloo transport: CPU messages; GPU tensors are staged through pinned host memory."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Availability, Exchange, RoundsTransport, register_transport, require_backend

__all__ = ["GlooTransport"]


@register_transport
class GlooTransport(RoundsTransport):
    name = "gloo"
    preference = 0
    host_staged = True  # gloo reads and writes message bytes from the host

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        require_backend(group, "gloo", "gloo", "sends its messages")

    @classmethod
    def available(cls) -> Availability:
        return Availability.first_missing([
            (dist.is_available() and dist.is_gloo_available(), "this torch build has no Gloo"),
        ])

    def wire_device(self) -> torch.device:
        return torch.device("cpu")

    def start(self, sends: Exchange, recvs: Exchange) -> object:
        return self.post(sends, recvs, self._op)

    def _op(self, kind: str, peer: int, buf: torch.Tensor) -> object:
        if kind == "send":
            return dist.isend(buf, peer, group=self.group)
        return dist.irecv(buf, peer, group=self.group)

    def finish(self, handle: object) -> None:
        self.wait(handle)  # type: ignore[arg-type]

"""The transport interface and registry.

A transport moves the bytes of one round: a list of (peer, uint8 tensor) to send
and a list of (peer, uint8 tensor) to receive into, peers being ranks of the
refit group. The executor packs, unpacks and orders streams (through
``execute.streams``); a transport only posts and completes the exchange.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.distributed as dist

from ..errors import TransportError

__all__ = ["Transport", "register_transport", "get_transport", "transport_names", "Exchange",
           "require_backend", "require_cuda"]

Exchange = list[tuple[int, torch.Tensor]]


class Transport(ABC):
    """Moves message bytes between ranks of ``group``.

    Constructed collectively (on every rank of the group, in the same order).
    ``start`` posts one round and returns a handle; ``finish`` completes it so that,
    for work the caller queues afterwards, received bytes are in place and sent
    buffers may be reused.
    """

    name: ClassVar[str]
    #: bytes handed to ``start`` must be complete on the host (a CPU transport fed from GPU)
    host_staged: ClassVar[bool] = False
    #: no message rounds: receivers read regions of the senders' tensors mapped into
    #: their process, through ``post`` / ``incoming`` / ``read`` / ``complete`` (ipc)
    peer_mapped: ClassVar[bool] = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] \
            if group is not dist.GroupMember.WORLD else list(range(dist.get_world_size()))

    @classmethod
    def available(cls) -> bool:
        return dist.is_available()

    @abstractmethod
    def wire_device(self) -> torch.device:
        """Where message buffers live."""

    @abstractmethod
    def start(self, sends: Exchange, recvs: Exchange) -> object: ...

    @abstractmethod
    def finish(self, handle: object) -> None: ...

    def global_rank(self, group_rank: int) -> int:
        return self._global[group_rank]

    def close(self) -> None:
        """Release what the transport holds (nothing by default)."""


def require_backend(group: dist.ProcessGroup, backend: str, transport: str, use: str) -> None:
    """Raise unless ``group`` has ``backend`` (alone or in a mixed ``cpu:...,cuda:...``)."""
    have = str(dist.get_backend(group))
    if backend not in have:
        raise TransportError(
            f"the {transport} transport {use} over {backend}; the refit group's backend is "
            f"{have!r} (create it with backend='cpu:gloo,cuda:nccl' or pass a {backend} group)"
        )


def require_cuda(device: torch.device, transport: str) -> None:
    if device.type != "cuda":
        raise TransportError(f"the {transport} transport needs CUDA tensors on every rank that holds a model")


_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(cls: type[Transport]) -> type[Transport]:
    _REGISTRY[cls.name] = cls
    return cls


def transport_names() -> list[str]:
    return sorted(_REGISTRY)


def get_transport(name: str) -> type[Transport]:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise TransportError(
            f"unknown transport {name!r}; registered: {transport_names()}"
        ) from None
    if not cls.available():
        raise TransportError(f"transport {name!r} is not available on this machine")
    return cls

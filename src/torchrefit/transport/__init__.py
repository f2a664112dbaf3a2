"""Transports: one module per backend, looked up by name, speaking one of two protocols.

``nccl``, ``gloo`` and the optional ``nvshmem`` move messages per round
(``base.RoundsTransport``; nvshmem puts them into peers' symmetric inboxes); ``ipc``
and the optional ``nixl`` are one-sided: one side reads or writes memory its peer
registered (``one_sided.OneSidedTransport``).
"""

from .base import (
                   Availability,
                   RoundsTransport,
                   Transport,
                   get_transport,
                   register_transport,
                   registered,
                   transport_names,
)
from .gloo import GlooTransport
from .ipc import IpcTransport
from .nccl import NcclTransport
from .nixl import NixlTransport
from .nvshmem import NvshmemTransport
from .one_sided.protocol import OneSidedTransport

__all__ = ["Availability", "Transport", "RoundsTransport", "OneSidedTransport", "get_transport",
           "register_transport", "registered", "transport_names", "GlooTransport", "IpcTransport",
           "NcclTransport", "NixlTransport", "NvshmemTransport"]

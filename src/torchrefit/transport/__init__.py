"""Transports: one module per backend, looked up by name, speaking one of two protocols.

``nccl`` and ``gloo`` move messages per round (``base.RoundsTransport``); ``ipc``
(and the optional ``nvshmem`` and ``nixl``) are one-sided: one side reads or writes
memory its peer registered (``one_sided.OneSidedTransport``).
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
from .one_sided import OneSidedTransport

__all__ = ["Availability", "Transport", "RoundsTransport", "OneSidedTransport", "get_transport",
           "register_transport", "registered", "transport_names", "GlooTransport", "IpcTransport",
           "NcclTransport", "NixlTransport"]

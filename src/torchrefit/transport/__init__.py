"""Transports: one module per backend behind :class:`Transport`, looked up by name.

``nccl`` and ``gloo`` move messages per round; ``ipc`` is peer-mapped: receivers
copy regions straight out of the senders' GPU memory (see ``transport.ipc``).
"""

from .base import Transport, get_transport, register_transport, transport_names
from .gloo import GlooTransport
from .ipc import IpcTransport
from .nccl import NcclTransport

__all__ = ["Transport", "get_transport", "register_transport", "transport_names",
           "GlooTransport", "IpcTransport", "NcclTransport"]

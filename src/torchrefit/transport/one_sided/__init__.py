"""The one-sided protocol (``protocol``: one side reads or writes memory its peer
registered; ``ipc`` and ``nixl`` speak it) and its control words in host shared
memory (``mailbox``)."""

from .protocol import OneSidedTransport, Table

__all__ = ["OneSidedTransport", "Table"]

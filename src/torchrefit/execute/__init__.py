"""Execution: a rank's plan compiled into views and buffers, replayed on each refit.

``program`` composes one program per protocol: ``local`` (copies within the rank),
``rounds`` (two-sided message rounds) and ``one_sided`` (peers' registered memory).
"""

from .local import LocalCopies
from .messages import Chunk, Message, cut_messages
from .program import Compiled, Program, RunStats
from .streams import SideStreams, host_wait_current

__all__ = ["Chunk", "Message", "cut_messages", "Compiled", "LocalCopies", "Program", "RunStats",
           "SideStreams", "host_wait_current"]

"""Execution: a rank's plan compiled into views and buffers, replayed on each refit."""

from .messages import Chunk, Message, cut_messages
from .program import Program, RunStats
from .streams import SideStreams, host_wait_current

__all__ = ["Chunk", "Message", "cut_messages", "Program", "RunStats", "SideStreams",
           "host_wait_current"]

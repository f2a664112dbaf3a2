"""Execution: a rank's plan compiled into views and buffers, replayed on each refit.

``program`` composes one program per protocol: ``local`` (copies within the rank),
``rounds`` (two-sided message rounds) and ``one_sided`` (peers' registered memory).
"""

from .local import LocalCopies
from .program import Compiled, Program, RunStats
from .streams import SideStreams

__all__ = ["Compiled", "LocalCopies", "Program", "RunStats", "SideStreams"]

"""``Refitter.verify()``: an independent witness that the destination equals the source.

Each side checksums its own pieces in global coordinates (``checksum``), derived
from the rosters and the name map only (``witness``), never from the plan's
transfers or messages, and the sums are compared over the group (``compare``).
"""

from .checksum import region_sum
from .compare import check
from .witness import Witness

__all__ = ["Witness", "check", "region_sum"]

"""How the regions a pair of ranks exchange are cut into messages (pure).

Sender and receiver run the same function on the same ordered transfers, so
both see the same messages: message m of a pair is exchanged in round m. A
message packs whole regions at 16-byte aligned offsets up to ``limit`` bytes; a
region larger than ``limit`` is cut along its first dim into row blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..layout._types import Box
from ..plan.types import Transfer

__all__ = ["Chunk", "Message", "cut_messages", "rows_of", "ALIGN"]

ALIGN = 16


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``rows`` (along dim 0; None: all) of transfer ``index``, at ``offset`` in a message."""

    index: int
    rows: tuple[int, int] | None
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Message:
    peer: int
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        last = self.chunks[-1]
        return last.offset + last.nbytes


def rows_of(box: Box, rows: tuple[int, int] | None) -> Box:
    """The sub-box of ``box`` made of its rows ``rows`` along dim 0."""
    return box if rows is None else box.rows(*rows)


def _pieces(index: int, t: Transfer, limit: int) -> list[tuple[int, tuple[int, int] | None, int]]:
    nbytes = t.nbytes
    size = t.region.size
    if nbytes <= limit or not size or size[0] <= 1:
        return [(index, None, nbytes)]
    row = nbytes // size[0]
    step = max(1, limit // row)
    return [(index, (lo, min(lo + step, size[0])), (min(lo + step, size[0]) - lo) * row)
            for lo in range(0, size[0], step)]


def cut_messages(peer: int, transfers: Sequence[Transfer], limit: int) -> list[Message]:
    """Messages for the transfers of one pair, in the order both ends agree on."""
    if limit < ALIGN:
        raise ValueError(f"message limit {limit} is below {ALIGN} bytes")
    messages: list[Message] = []
    chunks: list[Chunk] = []
    end = 0
    for i, t in enumerate(transfers):
        for index, rows, nbytes in _pieces(i, t, limit):
            offset = -(-end // ALIGN) * ALIGN
            if chunks and offset + nbytes > limit:
                messages.append(Message(peer, tuple(chunks)))
                chunks, offset = [], 0
            chunks.append(Chunk(index, rows, offset, nbytes))
            end = offset + nbytes
    if chunks:
        messages.append(Message(peer, tuple(chunks)))
    return messages

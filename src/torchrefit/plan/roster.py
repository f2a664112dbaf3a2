"""The compact metadata one rank contributes about one model: its roster.

A roster lists, for each local tensor, the global name, global shape, dtype,
whether it is a buffer, and the global boxes it holds; plus the model's aliases.
Local keys and local offsets stay on the rank: peers never need them. Rosters
of data-parallel replicas are byte-identical, which lets the index decode each
distinct roster once.
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass

from ..layout._types import ModelLayout

__all__ = ["RosterEntry", "Roster", "encode_roster", "decode_roster"]

# (name, global_shape, dtype, is_buffer, ((offset, size), ...))
RosterEntry = tuple[str, tuple[int, ...], str, bool, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]


@dataclass(frozen=True)
class Roster:
    entries: tuple[RosterEntry, ...]
    aliases: tuple[tuple[str, str], ...]


def roster_of(layout: ModelLayout) -> Roster:
    # Equal tuples become one object, so pickle writes each distinct shape and box list
    # once (layers and experts repeat them) and the decoder builds it once.
    same: dict = {}
    entries = tuple(
        (t.name, _one(same, t.global_shape), t.dtype, t.is_buffer,
         _one(same, tuple(_one(same, (p.box.offset, p.box.size)) for p in t.pieces)))
        for _, t in layout
    )
    return Roster(entries, tuple(layout.aliases))


def _one(same: dict, value: tuple) -> tuple:
    return same.setdefault(value, value)


def encode_roster(layout: ModelLayout | Roster) -> bytes:
    """Roster bytes: pickled plain tuples, deflated (names repeat per layer)."""
    roster = layout if isinstance(layout, Roster) else roster_of(layout)
    return zlib.compress(pickle.dumps((roster.entries, roster.aliases), protocol=5), 1)


def decode_roster(blob: bytes) -> Roster:
    entries, aliases = pickle.loads(zlib.decompress(blob))
    return Roster(entries, aliases)

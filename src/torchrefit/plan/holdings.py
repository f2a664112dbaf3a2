"""What every rank holds, indexed by global tensor: the planner's view of the world.

Built on every rank from the gathered rosters. Ranks with byte-identical rosters
(data-parallel replicas, identical engines) form one *class*, decoded once, so the
cost grows with the number of distinct rosters, not with world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._util.gc_pause import gc_paused
from .._util.identity import identity
from ..errors import PlanError
from ..layout._types import Box
from .roster import decode_roster

__all__ = ["TensorInfo", "Holdings"]


@dataclass(slots=True)
class TensorInfo:
    """One global tensor as one role (src or dst) holds it across all ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    is_buffer: bool
    first_rank: int
    boxes: dict[Box, list[int]] = field(default_factory=dict)  # box -> class ids, ascending
    _disjoint: bool | None = None
    _geometry: int | None = None

    @property
    def disjoint(self) -> bool:
        """Whether the distinct boxes held of this tensor never overlap (the usual case)."""
        if self._disjoint is None:
            if len(self.boxes) == 1:
                self._disjoint = True
                return True
            bs = list(self.boxes)
            self._disjoint = not any(
                a.intersect(b) is not None for i, a in enumerate(bs) for b in bs[i + 1:]
            )
        return self._disjoint


class Holdings:
    """All ranks' holdings of one role (source or destination), keyed by global tensor name."""

    @gc_paused
    def __init__(self, role: str, rosters: Sequence[bytes | None]) -> None:
        self.role = role
        self.members: list[list[int]] = []  # class id -> ranks, ascending
        self.names: list[list[str]] = []  # class id -> the global tensors it holds
        self.tensors: dict[str, TensorInfo] = {}
        self.aliases: dict[str, str] = {}
        self._ranks_cache: dict[tuple[int, ...], tuple[int, ...]] = {}
        # One Box per distinct (offset, size): layers and experts repeat the same boxes.
        self._boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Box] = {}
        self._geometries: dict[tuple, int] = {}
        self._by_holders: dict[tuple[int, ...], list[str]] | None = None
        self._overlapping: set[str] = set()
        self.rank_class: dict[int, int] = {}
        by_bytes: dict[bytes, int] = {}
        for rank, blob in enumerate(rosters):
            if blob is None:
                continue
            cid = by_bytes.get(blob)
            if cid is None:
                cid = by_bytes[blob] = len(self.members)
                self.members.append([])
                self.names.append([])
                self._add_class(cid, rank, blob)
            self.members[cid].append(rank)
            self.rank_class[rank] = cid
        self.holders = sorted(self.rank_class)

    def _add_class(self, cid: int, rank: int, blob: bytes) -> None:
        roster = decode_roster(blob)
        tensors = self.tensors
        # A roster holds each distinct box list once (layers and experts share them):
        # convert each once, by identity, while the decoded roster keeps them alive.
        converted: dict[int, tuple[Box, ...]] = {}
        self.names[cid] = [e[0] for e in roster.entries]
        for name, shape, dtype, is_buffer, boxes in roster.entries:
            shape = tuple(shape)  # (the same object where it is one already)
            got = converted.get(key := identity(boxes))
            if got is None:
                got = converted[key] = self._as_boxes(boxes)
            info = tensors.get(name)
            if info is None:  # the first class holding it (every expert of a wide EP)
                tensors[name] = TensorInfo(name, shape, dtype, is_buffer, rank,
                                           {box: [cid] for box in got})
                continue
            if info.shape != shape or info.dtype != dtype:
                raise PlanError(
                    f"{name}: {self.role} ranks disagree about the model's structure: rank "
                    f"{info.first_rank} has global shape {list(info.shape)} {info.dtype}, rank "
                    f"{rank} has {list(shape)} {dtype}"
                )
            held = info.boxes
            for box in got:
                cids = held.get(box)
                if cids is None:
                    held[box] = [cid]
                else:
                    cids.append(cid)
        for alias, target in roster.aliases:
            known = self.aliases.setdefault(alias, target)
            if known != target:
                raise PlanError(
                    f"{alias}: {self.role} ranks disagree about what it aliases: "
                    f"{known!r} and {target!r} (rank {rank})"
                )

    def _as_boxes(self, pairs) -> tuple[Box, ...]:
        """One interned :class:`Box` per distinct (offset, size)."""
        out = []
        for pair in pairs:
            box = self._boxes.get(pair)
            if box is None:
                box = self._boxes[pair] = Box(*pair)
            out.append(box)
        return tuple(out)

    def geometry(self, info: TensorInfo) -> int:
        """A small id that tensors of equal shape, dtype, kind and held boxes share
        (read once the index is built; what validation depends on besides names)."""
        gid = info._geometry
        if gid is None:
            key = (info.shape, info.dtype, info.is_buffer, tuple(info.boxes))
            gid = info._geometry = self._geometries.setdefault(key, len(self._geometries))
        return gid

    def held_by(self, holders: tuple[int, ...]) -> list[str]:
        """The tensors of which some region may have exactly the classes ``holders`` as its
        holders: those with a box held by exactly those classes, and those whose boxes
        overlap (their regions are cut into cells of any holder combination). The
        planner's share lines start here rather than scanning a holder's every tensor
        (at 16k ranks a DeepSeek-V3 stage's dense tensors sat beside each expert set's)."""
        if self._by_holders is None:
            table: dict[tuple[int, ...], list[str]] = {}
            for name, info in self.tensors.items():
                boxes = info.boxes
                if len(boxes) == 1:  # the usual case: one box, one holder set
                    for cids in boxes.values():
                        table.setdefault(tuple(cids), []).append(name)
                elif not info.disjoint:
                    self._overlapping.add(name)
                else:
                    for cids in boxes.values():
                        names = table.setdefault(tuple(cids), [])
                        if not names or names[-1] != name:
                            names.append(name)
            self._by_holders = table
        got = self._by_holders.get(holders, [])
        if not self._overlapping:
            return got
        mine = self.names[holders[0]]
        return got + sorted(n for n in self._overlapping.intersection(mine) if n not in got)

    def ranks(self, class_ids: Sequence[int]) -> tuple[int, ...]:
        """The ranks of some classes, ascending (cached: few distinct combinations recur)."""
        key = tuple(class_ids)
        got = self._ranks_cache.get(key)
        if got is None:
            if len(key) == 1:
                got = tuple(self.members[key[0]])
            else:
                got = tuple(sorted(r for c in key for r in self.members[c]))
            self._ranks_cache[key] = got
        return got


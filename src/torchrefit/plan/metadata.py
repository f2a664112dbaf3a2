"""Gathering rosters in bytes that grow with the distinct layouts, not with the world.

Data-parallel replicas hold byte-identical rosters, so gathering every rank's
roster (world x 20 KB for DeepSeek-V3, 316 MB per rank at 16k ranks) moves the
same bytes thousands of times. Instead every rank contributes a small
:class:`RosterRef` per role (a digest and a length) to one gather; the lowest
rank holding each distinct roster then sends it once (one broadcast per such
*owner*, see :func:`torchrefit.transport.collectives.all_gather_rosters`), and every rank
rebuilds the full per-rank table with :func:`assemble`: replicas share one
``bytes`` object, so the planner's index (which groups equal rosters into
classes) sees exactly what a full gather would have given it.

This module is the pure half (no process group), shared by the real gather and
by ``torchrefit plan``, which reports what every rank would gather.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RosterRef", "ref_of", "owners", "split", "assemble", "record", "read_record",
           "record_bytes", "Gathered"]


@dataclass(frozen=True, slots=True)
class RosterRef:
    """What a rank says about one of its rosters in the first gather."""

    digest: bytes  # 16 bytes of SHA-256: equal digests stand for equal rosters
    size: int


def ref_of(blob: bytes | None) -> RosterRef | None:
    if blob is None:
        return None
    return RosterRef(hashlib.sha256(blob).digest()[:16], len(blob))


def owners(refs: Sequence[Sequence[RosterRef | None]]) -> dict[int, list[RosterRef]]:
    """Who sends which distinct roster: ``{rank: [refs it sends, in role order]}``.

    ``refs[rank]`` holds the rank's refs, one per role. The lowest rank holding a
    roster sends it (in any role: a source and a destination roster that happen
    to be equal travel once). Deterministic: every rank derives the same owners
    from the same gathered refs.
    """
    seen: set[bytes] = set()
    out: dict[int, list[RosterRef]] = {}
    for rank, mine in enumerate(refs):
        for ref in mine:
            if ref is not None and ref.digest not in seen:
                seen.add(ref.digest)
                out.setdefault(rank, []).append(ref)
    return out


def split(buffer: bytes, sent: Sequence[RosterRef]) -> dict[bytes, bytes]:
    """The rosters an owner sent, concatenated in ``sent`` order, by digest; raises
    ValueError where one does not hash to its digest (a corrupted or mis-sized gather)."""
    out: dict[bytes, bytes] = {}
    pos = 0
    for ref in sent:
        blob = bytes(buffer[pos:pos + ref.size])
        pos += ref.size
        if ref_of(blob) != ref:
            raise ValueError(f"a roster of {ref.size} B arrived with a different digest")
        out[ref.digest] = blob
    if pos != len(buffer):
        raise ValueError(f"an owner sent {len(buffer)} B for rosters of {pos} B")
    return out


def assemble(refs: Sequence[Sequence[RosterRef | None]], distinct: dict[bytes, bytes],
             role: int) -> list[bytes | None]:
    """Every rank's roster of one role (``role`` indexes each rank's refs), as a full
    gather would have returned it; ranks with equal rosters share one object."""
    return [None if mine[role] is None else distinct[mine[role].digest] for mine in refs]


def record(extra: Any, refs: Sequence[RosterRef | None]) -> tuple:
    """One rank's first-gather record: plain tuples, so that pickling it does not
    spell out a class path per rank (16k ranks x 100 B adds up)."""
    return extra, tuple(None if r is None else (r.digest, r.size) for r in refs)


def read_record(rec: tuple) -> tuple[Any, tuple[RosterRef | None, ...]]:
    extra, refs = rec
    return extra, tuple(None if r is None else RosterRef(*r) for r in refs)


def record_bytes(extra: Any, refs: Sequence[RosterRef | None]) -> int:
    """Bytes one rank's first-gather record takes (pickled, as the gather sends it)."""
    return len(pickle.dumps(record(extra, refs), protocol=5))


@dataclass(frozen=True)
class Gathered:
    """Bytes one rank receives in the two gathers: the records (padded to the
    largest, as an all-gather of equal-sized buffers pads them) and the distinct
    rosters, each once."""

    records: int
    rosters: int
    owners: int  # broadcasts in the second step

    @property
    def total(self) -> int:
        return self.records + self.rosters

    @staticmethod
    def of(record_sizes: Sequence[int], refs: Sequence[Sequence[RosterRef | None]]) -> Gathered:
        sent = owners(refs)
        return Gathered(len(record_sizes) * max(record_sizes, default=0),
                        sum(r.size for rs in sent.values() for r in rs), len(sent))

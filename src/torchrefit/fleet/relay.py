"""Pure planning of a fleet update: who feeds whom (no store, no process group).

Each update's bytes leave the trainer once: the trainer feeds one replica, and the
replicas relay to one another along a tree of out-degree ``fanout`` (1: a chain), each
edge pipelined part by part (``parts``; a replica forwards a part once every one of its
ranks received it, so what it forwards is never a mix). When a relay node drops, the
replicas behind it are *orphans*: the next round feeds them from a replica that now holds
the version (the trainer only where none does), again as one tree.

A newcomer is seeded by a peer that holds the fleet's current version whole
(:func:`seed_source`); a peer marked as holding a mix is never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TRAINER", "Edge", "Holding", "relay_edges", "refeed_sources", "seed_source"]

#: the trainer job's name in plans and in the store
TRAINER = "trainer"


@dataclass(frozen=True)
class Edge:
    """One hop of an update: every rank of ``src`` sends to every rank of ``dst`` what a
    torchrefit plan between their two layouts says."""

    src: str
    dst: str

    def __post_init__(self) -> None:
        if self.src == self.dst:
            raise ValueError(f"a relay edge from {self.src!r} to itself")


@dataclass(frozen=True)
class Holding:
    """What one replica holds, as the fleet knows it: its committed ``version`` and whether
    its live weights are a ``mixed`` cut of two versions (an unstaged replica cut mid-update)."""

    name: str
    version: int
    mixed: bool = False

    def whole_at(self, version: int) -> bool:
        return self.version == version and not self.mixed


def relay_edges(sources: list[str], targets: list[str], fanout: int = 1) -> list[Edge]:
    """The edges that feed every target once: the first source feeds the first target,
    and each target fed feeds up to ``fanout`` more, breadth first (``fanout=1``: a chain).
    Only ``sources[0]`` sends; the others are spares the caller may use another round.
    Deterministic: the same lists give the same edges."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, not {fanout}")
    if not targets:
        return []
    if not sources:
        raise ValueError(f"no source to feed {targets}")
    edges = [Edge(sources[0], targets[0])]
    parents = [targets[0]]
    rest = targets[1:]
    while rest:
        feeding = parents.pop(0)
        for _ in range(fanout):
            if not rest:
                break
            child = rest.pop(0)
            edges.append(Edge(feeding, child))
            parents.append(child)
    return edges


def refeed_sources(holders: list[Holding], version: int) -> list[str]:
    """Who may feed the orphans of an update to ``version``: replicas holding it whole,
    then the trainer (last: each byte it sends again is egress the relay was to save)."""
    return [h.name for h in holders if h.whole_at(version)] + [TRAINER]


def seed_source(peers: list[Holding], version: int, busy: frozenset[str] = frozenset()) -> str | None:
    """The peer that seeds a newcomer at the fleet's current ``version``: the first one
    holding it whole and not ``busy`` seeding another; None where no peer does (the
    newcomer then joins the next update, fed from the trainer's side of the relay)."""
    if version <= 0:
        return None
    for p in peers:
        if p.whole_at(version) and p.name not in busy:
            return p.name
    return None

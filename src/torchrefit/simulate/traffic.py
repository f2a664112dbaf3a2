"""The traffic of a whole refit: bytes from every source rank to every destination rank.

Computed from the planner's replica choice (its share lines, :mod:`torchrefit.plan.shares`),
holder set by holder set, without building every rank's plan: the same bytes as the
ranks' plans, at a fraction of the cost, so ``torchrefit plan`` can total a
16384-rank refit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.planner import Planner
from ..plan.types import itemsize

__all__ = ["Traffic", "traffic"]


@dataclass(frozen=True, eq=False)
class Traffic:
    """``pairs[(s, d)]``: bytes source rank ``s`` sends destination rank ``d`` (pairs that
    move nothing are absent: at 16k ranks a dense matrix would be 2 GB of mostly zeros);
    ``local[r]``: bytes rank ``r`` copies locally; ``candidates``: the source ranks
    that hold a replica of something some rank receives (the ranks that could send)."""

    world: int
    pairs: dict[tuple[int, int], int]
    local: tuple[int, ...]
    candidates: tuple[int, ...]
    floor: int  # no choice of replicas can make the busiest sender send less (see traffic())

    def link(self, s: int, d: int) -> int:
        """Bytes source rank ``s`` sends destination rank ``d``."""
        return self.pairs.get((s, d), 0)

    def sent(self) -> list[int]:
        out = [0] * self.world
        for (s, _), n in self.pairs.items():
            out[s] += n
        return out

    def received(self) -> list[int]:
        out = [0] * self.world
        for (_, d), n in self.pairs.items():
            out[d] += n
        return out

    @property
    def bytes_remote(self) -> int:
        return sum(self.pairs.values())

    @property
    def bytes_local(self) -> int:
        return sum(self.local)

    def links(self) -> list[int]:
        """Bytes of every (source, destination) pair that moves any."""
        return [b for b in self.pairs.values() if b]

    def mean_send(self) -> float:
        """Mean bytes sent over the ranks that could send (hold a replica of what is needed)."""
        if not self.candidates:
            return 0.0
        sent = self.sent()
        return sum(sent[r] for r in self.candidates) / len(self.candidates)

    def max_send_over_mean(self) -> float:
        """Balance: the busiest sender against the mean over the ranks that could send."""
        mean = self.mean_send()
        return max(self.sent()) / mean if mean else 1.0

    def max_send_over_floor(self) -> float:
        """Balance against the least the busiest sender could send under any replica choice
        (where the layout itself is uneven, e.g. one expert per rank, the mean is not reachable)."""
        floor = max(self.floor, self.mean_send())
        return max(self.sent()) / floor if floor else 1.0


def traffic(planner: Planner, world: int) -> Traffic:
    """Whole-world traffic of a validated planner (every rank's plan, summed).

    Per holder set, not per region and rank: its share line gives each (holder,
    destination) pair's bytes in one step per destination rank
    (:meth:`ShareLine.bytes_by_pair`), and local copies are summed per (destination
    classes, holder set) before they are spread over the ranks that copy. At 16k
    ranks that is ~10^6 steps where dealing each region to each rank was ~10^9.
    """
    copies: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for name in sorted(planner.dst.tensors):
        if planner.segments(name) is None:
            continue  # skipped on purpose
        info = planner.dst.tensors[name]
        size = itemsize(info.dtype)  # a local copy writes the destination's dtype
        for box in info.boxes:
            for region in planner.regions(name, box):
                key = (region.dst_classes, region.holders)
                copies[key] = copies.get(key, 0) + region.dst_box.numel * size
    local = [0] * world
    for (dst_classes, holders), nbytes in copies.items():
        for r in planner.local_ranks(dst_classes, holders):
            local[r] += nbytes
    pairs: dict[tuple[int, int], int] = {}
    dealt: dict[tuple[int, ...], int] = {}  # remote bytes per holder set
    for holders in sorted({h for _, h in copies}):
        line = planner.share_line(holders)
        if not line.total:
            continue
        dealt[holders] = line.total
        ranks = planner.src.ranks(holders)
        for i, d, nbytes in line.bytes_by_pair():
            key = (ranks[i], d)
            pairs[key] = pairs.get(key, 0) + nbytes
    candidates = sorted({c for h in dealt for c in h})
    ranks = planner.src.ranks(candidates) if candidates else ()
    return Traffic(world, pairs, tuple(local), tuple(ranks), _floor(planner, dealt))


def _floor(planner: Planner, dealt: dict[tuple[int, ...], int]) -> int:
    """A lower bound on the busiest sender under any choice of replicas: whatever only
    the ranks of a holder set H hold (its bytes and those of every set inside it)
    is sent by those ranks, so one of them sends at least that over their number."""
    sets = [(frozenset(h), len(planner.src.ranks(h)), b) for h, b in dealt.items()]
    best = 0
    for h, n, _ in sets:
        inside = sum(b for g, _, b in sets if g <= h)
        best = max(best, -(-inside // n))
    return best

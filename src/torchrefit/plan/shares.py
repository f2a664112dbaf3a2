"""Sharing transfers among source replicas by bytes, so that every replica sends its share.

The regions one set of source ranks holds (a *holder set*, such as the 32
data-parallel replicas of one TP x PP shard) are sent to the destination ranks
that need them and do not hold them. Each (region, destination) *pair* is laid on
a line of bytes: destination ranks in ascending order, and for each, the regions
it needs from the set in the regions' canonical order (its *block*, see
:attr:`~torchrefit.plan.planner.Region.order`). The line is cut into
``n`` equal stretches, holder ``i`` (ascending rank) sending stretch ``i``; a
pair that straddles a cut is split by rows (dim 0 of the region), rounded to the
nearest row. So every holder sends ``total / n`` bytes give or take a row, a
large region (an embedding shard) is shared by several replicas rather than
loading one, and each holder talks to few destinations (``destinations / n``
plus one or two), each destination to few holders.

Destination ranks of one class (identical holdings) have identical blocks, so a
block is built once per class and where a rank's block starts is a sum over
classes: sender and receiver compute the same rows from the rosters alone, in
time proportional to what the holder set holds and the classes it serves.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import merge

__all__ = ["ClassBlock", "ShareLine", "split_pair"]

Key = Hashable  # names one region of the holder set (the planner uses Region.id)


@dataclass
class ClassBlock:
    """What each destination rank of one class receives from the holder set, in line order
    (built once per class by the planner, then read by :class:`ShareLine`)."""

    ranks: list[int]  # the class's ranks that receive it (those not among the holders)
    keys: list[Key] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each pair starts in the block
    sizes: list[int] = field(default_factory=list)  # bytes of each pair
    rows: list[int] = field(default_factory=list)  # rows (dim 0) of each pair
    width: int = 0
    index: dict[Key, int] = field(default_factory=dict)

    def add(self, key: Key, size: int, rows: int) -> None:
        self.index[key] = len(self.keys)
        self.keys.append(key)
        self.offsets.append(self.width)
        self.sizes.append(size)
        self.rows.append(rows)
        self.width += size

    def before(self, x: int) -> int:
        """Bytes of this block before block position ``x``, each pair cut at the row
        :meth:`ShareLine.senders` cuts it (the pairs before the one holding ``x`` whole,
        that one to its nearest row)."""
        j = bisect_right(self.offsets, x) - 1
        if j < 0:
            return 0
        size, rows = self.sizes[j], self.rows[j]
        return self.offsets[j] + size // rows * _cut(x, self.offsets[j], size, rows)


class ShareLine:
    """One holder set's line of bytes, cut into one equal share per holder (see the
    module docstring). Receivers ask :meth:`senders`, holders ask :meth:`sent_by`;
    both read the same cuts, so they agree without talking."""

    def __init__(self, n: int, blocks: dict[int, ClassBlock]) -> None:
        self.n = n
        self.blocks = {c: b for c, b in blocks.items() if b.ranks and b.width}
        self.total = sum(b.width * len(b.ranks) for b in self.blocks.values())
        self.cut = [i * self.total // n for i in range(n + 1)]
        self._starts: dict[int, int] = {}
        self._sent: dict[int, dict[Key, list[tuple[int, int, int]]]] = {}

    def block_start(self, rank: int) -> int:
        """Where the block of destination ``rank`` starts: blocks of lower ranks first."""
        got = self._starts.get(rank)
        if got is None:
            got = self._starts[rank] = sum(b.width * bisect_left(b.ranks, rank)
                                           for b in self.blocks.values())
        return got

    def senders(self, cls: int, rank: int, key: Key) -> list[tuple[int, int, int]]:
        """``(holder index, first row, end row)`` of each holder sending part of the
        pair (``key``, ``rank``); ``cls`` is the rank's class (receivers call this)."""
        b = self.blocks[cls]
        j = b.index[key]
        start = self.block_start(rank) + b.offsets[j]
        return split_pair(start, b.sizes[j], b.rows[j], self.cut)

    def sent_by(self, i: int) -> dict[Key, list[tuple[int, int, int]]]:
        """What holder ``i`` sends: ``{key: [(destination rank, first row, end row)]}``
        (computed once per holder)."""
        got = self._sent.get(i)
        if got is None:
            got = self._sent[i] = self._share(i)
        return got

    def bytes_by_pair(self) -> Iterator[tuple[int, int, int]]:
        """``(holder index, destination rank, bytes)`` for each holder and destination
        between which bytes move: what :meth:`senders` gives, summed over the
        destination's whole block in closed form (a holder's rows of each pair run
        from cut to cut, so the sum telescopes to :meth:`ClassBlock.before` at the two
        cuts). For whole-world totals: one step per destination rank, not per region."""
        cut = self.cut
        pos = 0
        for rank, cls in self._line_order():
            b = self.blocks[cls]
            end = pos + b.width
            i = bisect_right(cut, pos) - 1
            if end <= cut[i + 1]:  # the block lies in one holder's stretch (the usual case)
                yield i, rank, b.width
            else:
                done = 0
                while i < self.n and cut[i] < end:
                    upto = b.before(cut[i + 1] - pos)
                    if upto > done:
                        yield i, rank, upto - done
                    done = upto
                    i += 1
            pos = end

    def _line_order(self) -> Iterator[tuple[int, int]]:
        """``(destination rank, its class)`` in line order: ascending rank."""
        return merge(*([(r, c) for r in b.ranks] for c, b in self.blocks.items()))

    def _share(self, i: int) -> dict[Key, list[tuple[int, int, int]]]:
        a, e = self.cut[i], self.cut[i + 1]
        out: dict[Key, list[tuple[int, int, int]]] = {}
        pos = 0
        for rank, cls in self._line_order():
            b = self.blocks[cls]
            if pos + b.width > a:
                self._sends_of_block(b, rank, pos, a, e, out)
            pos += b.width
            if pos >= e:
                break
        return out

    @staticmethod
    def _sends_of_block(b: ClassBlock, rank: int, pos: int, a: int, e: int,
                        out: dict[Key, list[tuple[int, int, int]]]) -> None:
        j = max(0, bisect_right(b.offsets, a - pos) - 1)
        while j < len(b.keys) and pos + b.offsets[j] < e:
            s = pos + b.offsets[j]
            lo, hi = _cut(a, s, b.sizes[j], b.rows[j]), _cut(e, s, b.sizes[j], b.rows[j])
            if hi > lo:
                out.setdefault(b.keys[j], []).append((rank, lo, hi))
            j += 1


def split_pair(start: int, size: int, rows: int, cut: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(holder, first row, end row)`` of each stretch ``[cut[i], cut[i + 1])`` that
    holds part of the pair laid at ``start``, rounded to the nearest row."""
    i = max(0, bisect_right(cut, start) - 1)
    out = []
    while i < len(cut) - 1 and cut[i] < start + size:
        lo, hi = _cut(cut[i], start, size, rows), _cut(cut[i + 1], start, size, rows)
        if hi > lo:
            out.append((i, lo, hi))
        i += 1
    return out


def _cut(edge: int, start: int, size: int, rows: int) -> int:
    """The row of a pair laid at ``start`` nearest to line position ``edge``."""
    return min(max((2 * (edge - start) * rows + size) // (2 * size), 0), rows)

"""What one rank checksums for ``Refitter.verify()``, derived from the rosters alone.

The witness never looks at the plan's transfers, its replica choice or its message
cutting: it only needs what every rank holds (the planner's index of the rosters)
and the name map's segments. Both sides sum, per destination global tensor, in the
destination's global coordinates and dtype:

* destination side: every rank sums every piece it holds, so each replica of the
  destination is checked;
* source side: each source element is counted by one owner, the lowest rank
  holding it (replicas once), cast to the destination's dtype as a refit casts it,
  moved to where the name map puts it, and weighted by how many destination ranks
  hold that place.

The two totals agree exactly when every destination replica holds the source's
values at the right places. To name where they differ, :meth:`Witness.cell_sums`
splits one tensor by destination *cells* (the distinct boxes the destination holds,
or where they overlap, the grid of their boundaries) and by destination rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..execute.kernels.region_checksums import available as kernel_available
from ..layout._types import Box, ModelLayout, dtype_from_name
from ..maps import relocate
from ..plan.holdings import Holdings, TensorInfo
from ..plan.planner import Planner
from .checksum import MOD, region_sum
from .fp8_units import Unit, plan_units, quantize_unit
from .fused import FusedSums, Item

__all__ = ["Witness", "Term", "cells"]


@dataclass(frozen=True, slots=True)
class Term:
    """One region this rank sums: ``box`` of local tensor ``key`` (``side``), whose
    elements sit at ``region`` of destination tensor number ``tensor``, inside
    destination cell ``cell``."""

    side: str  # "src" or "dst"
    key: str
    box: Box
    tensor: int
    region: Box
    cell: int
    dtype: str  # the destination's dtype (what the source is cast to)


def cells(info: TensorInfo, index: Holdings) -> list[tuple[Box, tuple[int, ...]]]:
    """Boxes that partition what a role holds of one tensor, each with the ranks holding
    all of it, in offset order: the held boxes where they do not overlap, else the grid
    their boundaries cut."""
    if info.disjoint:
        out = [(box, index.ranks(cids)) for box, cids in info.boxes.items()]
        return sorted(out, key=lambda c: c[0].offset)
    boxes = list(info.boxes)
    ndim = len(info.shape)
    cuts = [sorted({p for b in boxes for p in (b.offset[d], b.end[d])}) for d in range(ndim)]
    grid = [((), ())]
    for d in range(ndim):
        grid = [(o + (a,), s + (b - a,)) for o, s in grid for a, b in zip(cuts[d], cuts[d][1:])]
    out = []
    for off, size in grid:
        cell = Box(off, size)
        cids = sorted({c for b, cs in info.boxes.items() if b.contains(cell) for c in cs})
        if cids:
            out.append((cell, index.ranks(cids)))
    return out


class Witness:
    """The terms one rank sums. Built on every rank from the same planner (pure)."""

    def __init__(self, planner: Planner, rank: int, src: ModelLayout | None,
                 dst: ModelLayout | None) -> None:
        fed = sorted(n for n in planner.dst.tensors if planner.segments(n) is not None)
        # FP8 targets' scales are compared too (``verify.fp8_units``): they have slots of their own
        self.names = fed + sorted(t.scale for n, t in planner.fp8.items() if n in fed)
        self._number = {n: i for i, n in enumerate(self.names)}
        self._cells = {n: cells(planner.dst.tensors[n], planner.dst) for n in self.names}
        self.units: list[Unit] = []
        #: FP8 blocks no single source rank holds, per target: not checked here
        self.unchecked: dict[str, int] = {}
        for name in sorted(planner.fp8):
            if name in self._number:
                got, missing = plan_units(planner, name, self._cells[name],
                                          self._cells[planner.fp8[name].scale])
                self.units.extend(got)
                if missing:
                    self.unchecked[name] = missing
        self._src_cells: dict[str, list] = {}
        self.planner = planner
        self.rank = rank
        self.terms: list[Term] = []
        self.weight: list[int] = []  # per term: destination ranks holding its region
        self._fused: FusedSums | None = None
        self._src = src
        if dst is not None:
            self._dst_terms(dst)
            self._fp8_dst_terms(dst)
        if src is not None:
            self._src_terms(src)

    def _dst_terms(self, dst: ModelLayout) -> None:
        for key, t in dst:
            i = self._number.get(t.name)
            if i is None or t.name in self.planner.fp8 or self.planner.segments(t.name) is None:
                continue  # skipped on purpose (nothing feeds it), or FP8 (by units)
            # only what the name map fills: padding (an engine's spare vocabulary rows)
            # is left alone by a refit, so it is not compared either
            fed = [seg.dst_box for seg in self.planner.segments(t.name) or ()]
            for piece in t.pieces:
                for j, (cell, _) in enumerate(self._cells[t.name]):
                    part = cell.intersect(piece.box) if cell.ndim else cell
                    for seg_box in (fed if part is not None else ()):
                        q = part.intersect(seg_box) if part.ndim else part
                        if q is not None:
                            local = q.moved(piece.box.offset, piece.local_offset)
                            self._add(Term("dst", key, local, i, q, j, t.dtype), 1)

    def _src_terms(self, src: ModelLayout) -> None:
        planner = self.planner
        for key, t in src:
            owned = [(cell, p) for cell, ranks in self._owned_src_cells(t.name) if ranks[0] == self.rank
                     for p in t.pieces if p.box.contains(cell)]
            for name in planner.consumers(t.name):
                i = self._number.get(name)
                if i is None or name in planner.fp8:
                    continue
                dtype = planner.dst.tensors[name].dtype
                for seg in planner.segments(name) or ():
                    if seg.src_name != t.name:
                        continue
                    wanted = relocate(seg.dst_box, seg.dst_box.offset, seg.src_offset)
                    for cell, piece in owned:
                        part = cell.intersect(wanted) if cell.ndim else cell
                        if part is None:
                            continue
                        at = relocate(part, seg.src_offset, seg.dst_box.offset)
                        for j, (dcell, dranks) in enumerate(self._cells[name]):
                            q = dcell.intersect(at) if dcell.ndim else dcell
                            if q is not None:
                                sbox = relocate(q, seg.dst_box.offset, seg.src_offset)
                                local = sbox.moved(piece.box.offset, piece.local_offset)
                                self._add(Term("src", key, local, i, q, j, dtype), len(dranks))

    def _fp8_dst_terms(self, dst: ModelLayout) -> None:
        """What this rank holds of every FP8 unit: its bytes and its scales."""
        held = {t.name: (key, t) for key, t in dst}
        for u in self.units:
            if self.rank not in u.dst_ranks:
                continue
            for name, box, cell, dtype in ((u.name, u.box, u.cell, "float8_e4m3fn"),
                                           (u.scale, u.scale_box, u.scale_cell, "float32")):
                key, t = held[name]
                piece = next(p for p in t.pieces if (p.box.contains(box) if box.ndim else True))
                local = box.moved(piece.box.offset, piece.local_offset) if box.ndim else box
                self._add(Term("dst", key, local, self._number[name], box, cell, dtype), 1)

    def _fp8_src_sums(self, src: Mapping[str, torch.Tensor]):
        """(tensor, cell, destination ranks, checksum) of what this rank quantizes: the
        values and the scales of the FP8 units it owns."""
        for u in self.units:
            if u.owner != self.rank:
                continue
            q, s = quantize_unit(u, self._src, src, self.planner.fp8_block)
            yield self._number[u.name], u.cell, u.dst_ranks, region_sum(q, u.box)
            yield self._number[u.scale], u.scale_cell, u.dst_ranks, region_sum(s, u.scale_box)

    def _owned_src_cells(self, name: str):
        got = self._src_cells.get(name)
        if got is None:
            got = self._src_cells[name] = cells(self.planner.src.tensors[name], self.planner.src)
        return got

    def _add(self, term: Term, weight: int) -> None:
        self.terms.append(term)
        self.weight.append(weight)

    # ------------------------------------------------------------------ summing
    def _value(self, term: Term, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]):
        table = src if term.side == "src" else dst
        x = table[term.key].detach()
        x = x[term.box.slices()] if term.box.ndim else x
        if tuple(x.shape) != term.region.size:  # unit dims where source and destination differ
            x = x.reshape(term.region.size)
        dtype = dtype_from_name(term.dtype)
        return x if x.dtype == dtype else x.to(dtype)  # the cast a refit makes

    def sums(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
             device: torch.device) -> torch.Tensor:
        """int64 ``[2, tensors]``: this rank's destination and (weighted) source sums,
        each in ``[0, 2**32)``; all-reduced over the group they must agree mod ``2**32``.
        On CUDA (or under Triton's interpreter) in a few kernel launches (``verify.fused``),
        else term by term with :func:`region_sum` (the reference)."""
        tables = {"src": src, "dst": dst}
        if self._fusable(tables):
            if self._fused is None:
                self._fused = FusedSums(self._items(), 2 * len(self.names))
            out = self._fused.sums(tables, self._home(tables)).view(2, -1).to(device)
        else:
            out = self.reference_sums(src, dst, device, fp8=False)
        for i, _, dranks, x in self._fp8_src_sums(src):
            out[1, i] = (out[1, i] + x.to(device) * len(dranks)) % MOD
        return out

    def _home(self, tables) -> torch.device:
        term = self.terms[0]
        return tables[term.side][term.key].device

    def _fusable(self, tables) -> bool:
        """Every term's tensor on one device where the kernel runs."""
        if not self.terms:
            return False
        devices = {tables[t.side][t.key].device for t in self.terms}
        return len(devices) == 1 and kernel_available(next(iter(devices)).type)

    def _items(self) -> list[Item]:
        n = len(self.names)
        return [Item(t.side, t.key, t.box.slices() if t.box.ndim else (), t.region.size, t.region.offset,
                     dtype_from_name(t.dtype), w, (0 if t.side == "dst" else n) + t.tensor)
                for t, w in zip(self.terms, self.weight)]

    def reference_sums(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                       device: torch.device, fp8: bool = True) -> torch.Tensor:
        """What :meth:`sums` returns, term by term with :func:`region_sum` (on any device);
        ``fp8=False``: without the FP8 units' source side."""
        out = torch.zeros(2, len(self.names), dtype=torch.int64, device=device)
        for term, weight in zip(self.terms, self.weight):
            s = region_sum(self._value(term, src, dst), term.region).to(device)
            row = 0 if term.side == "dst" else 1
            out[row, term.tensor] = (out[row, term.tensor] + s * weight) % MOD
        for i, _, dranks, x in (self._fp8_src_sums(src) if fp8 else ()):
            out[1, i] = (out[1, i] + x.to(device) * len(dranks)) % MOD
        return out

    def slots(self, tensor: int) -> list[tuple[int, int]]:
        """(cell, destination rank) slots of one tensor, in order."""
        return [(j, r) for j, (_, ranks) in enumerate(self._cells[self.names[tensor]]) for r in ranks]

    def cell_sums(self, tensor: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                  device: torch.device) -> torch.Tensor:
        """int64 ``[2, slots]`` for one tensor: what each destination rank holds of each
        cell, and what the source says it should hold there."""
        slots = self.slots(tensor)
        where = {s: k for k, s in enumerate(slots)}
        out = torch.zeros(2, len(slots), dtype=torch.int64, device=device)
        for term in self.terms:
            if term.tensor != tensor:
                continue
            s = region_sum(self._value(term, src, dst), term.region).to(device)
            if term.side == "dst":
                k = where[(term.cell, self.rank)]
                out[0, k] = (out[0, k] + s) % MOD
            else:
                for r in self._cells[self.names[tensor]][term.cell][1]:
                    k = where[(term.cell, r)]
                    out[1, k] = (out[1, k] + s) % MOD
        for i, cell, dranks, x in self._fp8_src_sums(src):
            if i == tensor:
                for r in dranks:
                    k = where[(cell, r)]
                    out[1, k] = (out[1, k] + x.to(device)) % MOD
        return out

    def describe_slot(self, tensor: int, slot: int) -> str:
        """``name[box] on destination rank r (source ranks [...])`` of one slot."""
        name = self.names[tensor]
        j, r = self.slots(tensor)[slot]
        box = self._cells[name][j][0]
        try:
            owners = sorted({self.planner.src.ranks(reg.holders)[0] for reg in self.planner.regions(name, box)})
        except KeyError:  # an FP8 scale's cell: no region of its own
            owners = sorted({u.owner for u in self.units if u.scale == name and u.scale_cell == j})
        return f"{name}{box} on destination rank {r} (source rank{'s' if len(owners) != 1 else ''} {owners})"
